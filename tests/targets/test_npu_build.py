"""The reference NPU end to end: numerics against fp32, fused conv/pool kernels, export/reload."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tvm
from tolerances import assert_close, tolerance
from tvm import relax

import tvmamp
import tvmamp.targets.npu as npu
from tvmamp import models
from tvmamp.executable import _walk

TARGET = "npu -num-cores=1"


def conv_pool_net(seed=0):
    """conv3x3+bias+relu (16->32), max_pool2d, a conv with dilation 2, and a 1x1 conv+relu."""
    rng = np.random.default_rng(seed)
    shapes = {"w0": (32, 16, 3, 3), "b0": (1, 32, 1, 1), "w1": (32, 32, 3, 3), "w2": (16, 32, 1, 1)}
    params = {
        n: (rng.standard_normal(s) / np.sqrt(np.prod(s[1:]))).astype("float32")
        for n, s in shapes.items()
    }
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 16, 32, 32), "float32"))
    ws = {n: relax.Var(n, relax.TensorType(s, "float32")) for n, s in shapes.items()}
    with bb.function("main", [x, *ws.values()]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.conv2d(x, ws["w0"], padding=1))
            y = bb.emit(relax.op.nn.relu(bb.emit(relax.op.add(y, ws["b0"]))))
            y = bb.emit(relax.op.nn.max_pool2d(y, 2, 2))
            y = bb.emit(relax.op.nn.conv2d(y, ws["w1"], padding=2, dilation=2))
            y = bb.emit(relax.op.nn.relu(bb.emit(relax.op.nn.conv2d(y, ws["w2"]))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    mod = bb.get()
    mod["main"] = mod["main"].with_attr("num_input", 1)
    return mod, params


def build_and_check(mod, params):
    exe = tvmamp.build(mod, "O2", TARGET, params=params)
    x = models.example_inputs(mod)
    ref = tvmamp.build(mod, "O0", "llvm -num-cores=1", params=params)(*x)
    out = exe(*x)
    assert_close(out, ref, **tolerance(exe.policy.low_dtype))
    return exe, x, out


def numpy_mlp(x, params, layers):
    """SimpleNet in float64: Linear layers with ReLU between them."""
    y = x.astype("float64")
    for i in range(layers):
        y = y @ params[f"linear{i}.weight"].T.astype("float64") + params[f"linear{i}.bias"]
        y = np.maximum(y, 0.0) if i < layers - 1 else y
    return y


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    """The MLP built for the NPU and exported once (one C++ compile serves both tests)."""
    mod, params = models.simple_net(batch=16, hidden=64, layers=3)
    exe = tvmamp.build(mod, "O2", TARGET, params=params)
    path = exe.export_library(str(tmp_path_factory.mktemp("npu") / "mlp_npu.so"))
    x = models.example_inputs(mod)[0]
    vm = relax.VirtualMachine(tvm.runtime.load_module(path), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(x, tvm.cpu())).numpy()
    return exe, path, x, out, numpy_mlp(x, params, 3)


def test_mlp_matches_fp32(mlp):
    exe, _, _, out, ref = mlp
    assert_close(out, ref, **tolerance(exe.policy.low_dtype))
    assert npu.partition_report(exe).patterns() == {"dense_bias_relu": 2, "dense_bias": 1}
    sources = [m.inspect_source() for m in _walk(exe.vm_exec.mod) if m.kind == "c"]
    assert len(sources) == 1 and sources[0].count("tvmamp_npu::Matmul<") == 3


@pytest.mark.slow  # conv2d, relu and the fp32 host fallback are also covered by conv_pool_net
def test_conv_net_matches_fp32_with_host_fallback():
    exe, _, _ = build_and_check(*models.conv_net(batch=1, channels=16, size=16))
    assert npu.partition_report(exe).patterns() == {"conv2d": 1, "relu": 2}


def test_transformer_layer_matches_fp32():
    build_and_check(*models.transformer_layer(batch=1, seq=16, dim=32, heads=2))


def test_fused_conv_bias_relu_and_max_pool_match_fp32():
    exe, _, _ = build_and_check(*conv_pool_net())
    rep = npu.partition_report(exe)
    assert rep.patterns() == {"conv2d_bias_relu": 1, "max_pool2d": 1, "conv2d_relu": 1}
    dilated = [p for p in rep.on_host if p.op == "relax.nn.conv2d"]
    assert [p.reason for p in dilated] == ["dilation (2, 2) > 1"]


def test_export_and_reload_in_a_fresh_process(mlp, tmp_path):
    _, path, x, out, _ = mlp
    np.save(tmp_path / "x.npy", x)
    script = textwrap.dedent(
        f"""
        import numpy as np, tvm
        from tvm import relax
        vm = relax.VirtualMachine(tvm.runtime.load_module({path!r}), tvm.cpu())
        x = tvm.runtime.tensor(np.load({str(tmp_path / "x.npy")!r}), tvm.cpu())
        np.save({str(tmp_path / "out.npy")!r}, vm["main"](x).numpy())
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    np.testing.assert_array_equal(np.load(tmp_path / "out.npy"), out)
