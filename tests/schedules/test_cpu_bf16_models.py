"""bf16 models through tvmamp.build on the CPU: conv via GEMM, odd channels, export and reload."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tvm
from tolerances import assert_close, tolerance
from tvm import relax

import tvmamp
import tvmamp.models
from tvmamp.relay_passes.conv2d_to_gemm import Conv2dToGemm
from tvmamp.targets.llvm import _host_flags

TARGETS = [
    pytest.param(
        "llvm -mcpu=znver4 -mattr=-sse4a -num-cores=1", "vdpbf16ps", "avx512_bf16", id="vdpbf16ps"
    ),
    pytest.param("llvm -mcpu=sapphirerapids -num-cores=1", "tdpbf16ps", "amx_bf16", id="amx"),
]


def _needs_host(flag: str) -> None:
    if flag not in _host_flags():
        pytest.skip(f"the host CPU lacks {flag}")


def _conv_model(rng, n: int, c: int, f: int, size: tuple[int, int], stride: int):
    """conv2d (3x3, padding 1) + bias + relu with random constant weights, fp32."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, c, *size), "float32"))
    weight = rng.standard_normal((f, c, 3, 3)).astype("float32") / np.sqrt(9 * c)
    bias = rng.standard_normal((1, f, 1, 1)).astype("float32")
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, relax.const(weight), strides=stride, padding=1))
            y = bb.emit(relax.op.add(y, relax.const(bias)))
            out = bb.emit_output(relax.op.nn.relu(y))
        bb.emit_func_output(out)
    return bb.get()


@pytest.mark.parametrize(("target", "instruction", "flag"), TARGETS)
@pytest.mark.parametrize(
    ("n", "c", "f", "size", "stride"), [(1, 3, 5, (17, 19), 1), (2, 7, 33, (9, 8), 2)]
)
def test_conv_odd_channels(rng, target, instruction, flag, n, c, f, size, stride):
    _needs_host(flag)
    mod = _conv_model(rng, n, c, f, size, stride)
    x = rng.standard_normal((n, c, *size)).astype("float32")
    ref = tvmamp.build(mod, "O0", target)(x)
    exe = tvmamp.build(mod, "O2", target, "bfloat16")
    assert instruction in exe.get_source("asm")
    assert_close(exe(x), ref, **tolerance("bfloat16"))


def test_conv2d_to_gemm_leaves_fp32_convs_alone(rng):
    mod = _conv_model(rng, 1, 4, 8, (6, 6), 1)
    tvm.ir.assert_structural_equal(Conv2dToGemm("bfloat16")(mod), mod)


_RELOAD = """
import sys, numpy as np, tvm
from tvm import relax
lib = tvm.runtime.load_module(sys.argv[1])
vm = relax.VirtualMachine(lib, tvm.cpu())
x = np.load(sys.argv[2])
np.save(sys.argv[3], vm["main"](tvm.runtime.tensor(x)).numpy())
"""


@pytest.mark.parametrize(("target", "instruction", "flag"), TARGETS)
def test_export_and_reload_in_a_fresh_process(tmp_path, rng, target, instruction, flag):
    _needs_host(flag)
    mod, params = tvmamp.models.simple_net(batch=32, hidden=64, layers=2)
    exe = tvmamp.build(mod, "O2", target, "bfloat16", params=params)
    x = rng.standard_normal((32, 64)).astype("float32")
    lib = str(tmp_path / "net.so")
    exe.export_library(lib)
    if shutil.which("objdump"):
        dump = subprocess.run(["objdump", "-d", lib], capture_output=True, text=True, check=True)
        assert instruction in dump.stdout
    np.save(tmp_path / "x.npy", x)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    args = [sys.executable, "-c", _RELOAD, lib, str(tmp_path / "x.npy"), str(tmp_path / "y.npy")]
    subprocess.run(args, check=True, env=env, timeout=120)
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), np.asarray(exe(x)), rtol=0, atol=0)
