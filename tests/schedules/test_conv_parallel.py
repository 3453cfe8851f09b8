"""Direct convs with fewer parallel tasks than cores spread their tiles over the cores.

Built for 16 cores, a depthwise conv staged a group of 16 channels at a time ran its output
rows serially inside each group (6 tasks for mobilenet_v2's 96 channels), a conv1d as a
height-1 conv2d ran its column tiles serially (2 to 8 tasks for up to 79 MFLOP), and a narrow
conv on a 7 x 7 image had 7 tasks. These tests check the parallel extent of each conv and its
numbers at odd shapes.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import tvm
from tvm import relax

from tvmamp.pipeline import legalize_passes
from tvmamp.schedules.cpu import cpu_schedule_passes

LEGALIZE = legalize_passes()
CORES = 16


def _conv(data, weight, stride, padding, groups) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(data, "float32"))
    w = relax.Var("w", relax.TensorType(weight, "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(
                relax.op.nn.conv2d(x, w, strides=stride, padding=padding, groups=groups)
            )
        bb.emit_func_output(out)
    return bb.get()


def _reference(x, w, stride, padding, groups):
    """The conv in float64 numpy (NCHW, OIHW)."""
    x, w = x.astype("float64"), w.astype("float64")
    ph, pw = padding
    x = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    n, c, h, wd = x.shape
    f, cg, kh, kw = w.shape
    fg = f // groups
    oh, ow = (h - kh) // stride[0] + 1, (wd - kw) // stride[1] + 1
    out = np.zeros((n, f, oh, ow))
    for g in range(groups):
        xs = x[:, g * cg : (g + 1) * cg]
        ws = w[g * fg : (g + 1) * fg]
        for ky in range(kh):
            for kx in range(kw):
                patch = xs[
                    :,
                    :,
                    ky : ky + stride[0] * (oh - 1) + 1 : stride[0],
                    kx : kx + stride[1] * (ow - 1) + 1 : stride[1],
                ]
                out[:, g * fg : (g + 1) * fg] += np.einsum("ncyx,fc->nfyx", patch, ws[:, :, ky, kx])
    return out


CONVS = [
    # (data, weight, stride, padding, groups)
    pytest.param((1, 32, 29, 29), (32, 1, 3, 3), (1, 1), (1, 1), 32, id="depthwise_s1"),
    pytest.param((1, 32, 57, 57), (32, 1, 3, 3), (2, 2), (1, 1), 32, id="depthwise_s2"),
    pytest.param((1, 16, 1, 250), (24, 16, 1, 5), (1, 1), (0, 2), 1, id="conv1d"),
    pytest.param((1, 96, 7, 7), (48, 96, 1, 1), (1, 1), (0, 0), 1, id="narrow_1x1_7x7"),
]


@pytest.mark.parametrize(("data", "weight", "stride", "padding", "groups"), CONVS)
def test_conv_has_a_task_per_core(rng, data, weight, stride, padding, groups):
    target = tvm.target.Target(
        {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": CORES}
    )
    with target:
        mod = tvm.transform.Sequential([*LEGALIZE, *cpu_schedule_passes(target)])(
            _conv(data, weight, stride, padding, groups)
        )
    scripts = [f.script() for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    conv = next(s for s in scripts if "conv2d" in s)
    # The conv's loop nest is the last root loop with a parallel loop (after the copies).
    tasks = [int(t) for t in re.findall(r"T\.parallel\(T\.int64\((\d+)\)", conv)]
    assert tasks and tasks[-1] >= CORES, tasks
    x = rng.standard_normal(data).astype("float32")
    w = rng.standard_normal(weight).astype("float32")
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
    ref = _reference(x, w, stride, padding, groups)
    assert out.shape == ref.shape
    assert np.abs(out - ref).max() / np.abs(ref).max() <= 1e-5


def test_padding_of_few_planes_runs_rows_in_parallel(rng):
    """A 3-channel image's padding copy ran its 3 planes as 3 parallel tasks."""
    data, weight = (1, 3, 37, 41), (32, 3, 3, 3)
    target = tvm.target.Target(
        {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": CORES}
    )
    with target:
        mod = tvm.transform.Sequential([*LEGALIZE, *cpu_schedule_passes(target)])(
            _conv(data, weight, (1, 1), (1, 1), 1)
        )
    scripts = [f.script() for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    conv = next(s for s in scripts if "conv2d" in s)
    tasks = [int(t) for t in re.findall(r"T\.parallel\(T\.int64\((\d+)\)", conv)]
    assert min(tasks) >= CORES, tasks
    x = rng.standard_normal(data).astype("float32")
    w = rng.standard_normal(weight).astype("float32")
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w)).numpy()
    ref = _reference(x, w, (1, 1), (1, 1), 1)
    assert np.abs(out - ref).max() / np.abs(ref).max() <= 1e-5
