"""GroupNormAsInstanceNorm: group norms as instance norms of the tensor viewed by groups."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import tvm
from tolerances import assert_close, tolerance
from tvm import relax

import tvmamp
from tvmamp.relay_passes.group_norm_as_instance_norm import GroupNormAsInstanceNorm


def _ops(mod) -> set[str]:
    found = set()
    relax.analysis.post_order_visit(
        mod["main"], lambda e: found.add(e.op.name) if isinstance(e, relax.Call) else None
    )
    return found


# (groups, channels, input shape, affine)
CASES = [
    (4, 32, (1, 32, 17, 13), True),
    (3, 12, (2, 12, 9, 10), True),  # batch 2, 4 channels a group
    (2, 6, (2, 6, 33), True),  # a 1-D signal
    (4, 8, (1, 8, 3, 5, 6), False),  # 3-D, no affine (TVM's importer failed on None weights)
    (1, 5, (1, 5, 7, 7), True),  # one group: layer norm over C, H, W
]


@pytest.mark.parametrize("level", ["O0", "O2"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_group_norm_matches_torch(case, level):
    groups, channels, shape, affine = case
    torch.manual_seed(0)
    norm = torch.nn.GroupNorm(groups, channels, affine=affine)
    if affine:
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
    model = torch.nn.Sequential(norm, torch.nn.ELU()).eval()
    x = torch.randn(shape) * 3 + 1
    with torch.no_grad():
        ref = model(x).numpy()
    mod, params = tvmamp.from_torch(model, (x,))
    assert "relax.nn.group_norm" in _ops(mod)
    assert "relax.nn.group_norm" not in _ops(GroupNormAsInstanceNorm()(mod))
    exe = tvmamp.build(mod, level, "llvm", params=params)
    out = exe.vm["main"](tvm.runtime.tensor(x.numpy(), exe.device)).numpy()
    dtype = "float32" if level == "O0" else exe.policy.low_dtype
    assert_close(out, ref, **tolerance(dtype, np.abs(ref).max()), what=f"{case} {level}")
