"""Attention's head-split copies merged into each other and into the GEMMs that read them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tvm
from tolerances import assert_close

import tvmamp
from tvmamp.pipeline import run_front_phases
from tvmamp.relay_passes.gemm_layout import FuseLayoutIntoGemm
from tvmamp.schedules.cpu import cpu_schedule_passes
from tvmamp.targets import registry
from tvmamp.targets.llvm import _host_flags

ZNVER4 = "llvm -mcpu=znver4 -mattr=-sse4a -num-cores=1"
SAPPHIRE = "llvm -mcpu=sapphirerapids -num-cores=1"


def _mha(rng, batch, tokens, embed, heads):
    """torch's ``MultiheadAttention`` (seq-first: its head split reads ``qkv[tokens, batch,
    3 * embed]``) with random weights, and a random input."""
    import torch

    torch.manual_seed(int(rng.integers(1 << 30)))
    layer = torch.nn.MultiheadAttention(embed, heads).eval()
    x = torch.from_numpy(rng.standard_normal((tokens, batch, embed)).astype("float32"))

    class SelfAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return self.layer(x, x, x, need_weights=False)[0]

    model = SelfAttention().eval()
    with torch.inference_mode():
        ref = model(x).numpy()
    mod, params = tvmamp.from_torch(model, (x,))
    return mod, params, x.numpy(), ref


def _front(mod, params, target=ZNVER4) -> tuple[tvm.target.Target, tvm.IRModule]:
    """The target, and the kernels at O2 bf16 before scheduling."""
    converted = tvmamp.convert(mod, "O2", target, dtype="bfloat16", params=params)
    return converted.target, run_front_phases(converted)


def _kernels(mod, params, target=ZNVER4) -> list[str]:
    _, lowered = _front(mod, params, target)
    return [g.name_hint for g, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]


@pytest.mark.parametrize(
    ("batch", "tokens", "embed", "heads", "merged"),
    [(2, 32, 64, 2, 2), (1, 64, 512, 8, 2), (3, 20, 64, 2, 1), (2, 32, 64, 4, 0)],
    ids=["32-dim-heads", "64-dim-heads", "20-tokens", "16-dim-heads"],
)
def test_k_and_v_are_packed_from_the_projection_and_match_torch(
    rng, batch, tokens, embed, heads, merged
):
    """``K^T`` and ``V`` are read by the GEMMs' packing, never copied by a kernel of their own,
    where the packing takes its intrinsics: 20 keys are no whole 16-key panels of ``K^T``, and
    16-dim heads no whole 32-column tiles of either (each would be a gather per vector)."""
    mod, params, x, ref = _mha(rng, batch, tokens, embed, heads)
    names = _kernels(mod, params)
    assert sum(n.endswith("_gather_b") for n in names) == merged, names
    if "avx512_bf16" not in _host_flags():
        pytest.skip("the host CPU lacks avx512_bf16")
    out = np.asarray(tvmamp.build(mod, "O2", ZNVER4, dtype="bfloat16", params=params)(x))
    assert_close(out.astype("float32"), ref, rtol=3e-2, atol=3e-2)


def test_the_gathered_packs_use_the_packing_intrinsics_on_both_x86_paths(rng):
    """Whole 16 x 32 tiles of ``K`` (transposing) and 2 x 32 of ``V`` read straight from
    ``qkv[tokens, batch, 3 * embed]`` match the packing intrinsics, on vdpbf16ps and on AMX."""
    mod, params, _, _ = _mha(rng, 2, 32, 64, 2)
    for target in (ZNVER4, SAPPHIRE):
        resolved, lowered = _front(mod, params, target)
        assert sum(g.name_hint.endswith("_gather_b") for g in lowered.get_global_vars()) == 2
        with resolved:
            scheduled = tvm.transform.Sequential(cpu_schedule_passes(resolved))(lowered)
        packs = [
            f.script()
            for g, f in scheduled.functions_items()
            if g.name_hint.endswith("_gather_b_weight_prepack")
        ]
        assert len(packs) == 2, target
        assert all("tvmamp_" in p and "T.call_extern" in p for p in packs), target


def test_composed_layout_kernels_index_their_source_affinely(rng):
    """The Q slice, left a kernel of its own, reads ``qkv`` without ``//`` or ``%``."""
    mod, params, _, _ = _mha(rng, 2, 32, 64, 2)
    _, lowered = _front(mod, params)
    (q_slice,) = [
        f
        for g, f in lowered.functions_items()
        if isinstance(f, tvm.tirx.PrimFunc) and g.name_hint.startswith("fused_strided_slice")
    ]
    assert "//" not in q_slice.script() and "%" not in q_slice.script()


def _kernels_with(mod, params, layout_pass) -> list[str]:
    """The kernels with the LLVM entry's last fusion pass replaced by ``layout_pass`` (or
    dropped when None)."""
    entry = registry.REGISTRY["llvm"]

    def fusion(target):
        passes = entry.fusion_passes(target)[:-1]
        return passes if layout_pass is None else [*passes, layout_pass]

    registry.REGISTRY["llvm"] = dataclasses.replace(entry, fusion_passes=fusion)
    try:
        return _kernels(mod, params)
    finally:
        registry.REGISTRY["llvm"] = entry


def test_a_declined_gemm_keeps_its_layout_kernels_which_still_merge_together(rng):
    mod, params, _, _ = _mha(rng, 2, 32, 64, 2)
    before = _kernels_with(mod, params, None)
    declined = _kernels_with(mod, params, FuseLayoutIntoGemm(lambda kernel: False))
    assert not any(n.endswith("_gather_b") for n in declined)
    # the [3, tokens, batch, embed] copy is gone into the three slices that read it
    assert len(declined) == len(before) - 1


def test_a_module_without_layout_kernels_is_unchanged():
    bb = tvm.relax.BlockBuilder()
    x = tvm.relax.Var("x", tvm.relax.TensorType((4, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(bb.emit(tvm.relax.op.exp(x)))
        bb.emit_func_output(out)
    mod = tvm.transform.Sequential(
        [
            tvm.relax.transform.LegalizeOps(),
            tvm.relax.transform.AnnotateTIROpPattern(),
            tvm.relax.transform.FuseOps(),
        ]
    )(bb.get())
    tvm.ir.assert_structural_equal(FuseLayoutIntoGemm(lambda kernel: True)(mod), mod)


def test_a_layout_kernel_reshaping_to_a_scalar_is_left_alone(rng):
    """``einsum("ij,jk->")`` ends in a reshape to a 0-d tensor, whose copy block keeps an
    iterator of extent 1: composing it failed with "zip() argument 2 is shorter"."""
    torch = pytest.importorskip("torch")
    from torch_modules import check_against_torch

    a, b = (rng.standard_normal(s).astype("float32") for s in ((3, 4), (4, 5)))
    check_against_torch(lambda a, b: torch.einsum("ij,jk->", a, b), a, b)
