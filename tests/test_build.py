"""tvmamp.build end to end on the CPU: numerics against fp32, export, errors, sources."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from tvm import relax

import tvmamp
from tvmamp import models
from tvmamp.benchmark import max_rel_error

TARGET = "llvm -num-cores=1"

MODELS = {
    "mlp": lambda: models.simple_net(batch=8, hidden=64, layers=3),
    "conv_bn_relu": lambda: models.conv_net(batch=2, channels=16, size=12),
    "transformer": lambda: models.transformer_layer(batch=2, seq=8, dim=32, heads=4),
}


@pytest.fixture(scope="module")
def fp32_outputs():
    """O0 (fp32) outputs of each model on its example inputs."""
    results = {}
    for name, make in MODELS.items():
        mod, params = make()
        inputs = models.example_inputs(mod)
        results[name] = (
            mod,
            params,
            inputs,
            tvmamp.build(mod, "O0", TARGET, params=params)(*inputs),
        )
    return results


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize(
    "level,dtype", [("O1", "float16"), ("O2", "bfloat16"), ("O2", "float16"), ("auto", "bfloat16")]
)
def test_numerics_against_fp32(fp32_outputs, name, level, dtype):
    mod, params, inputs, reference = fp32_outputs[name]
    exe = tvmamp.build(mod, level, TARGET, dtype=dtype, params=params)
    out = exe(*inputs)
    assert out.dtype == np.float32  # keep_io_types
    error = max_rel_error(out, reference)
    assert 0 < error <= 1e-2, f"{name} {level} {dtype}: relative error {error}"
    assert exe.stats.ops_per_dtype().get(dtype, 0) > 0


def test_converted_module_and_stats_are_exposed():
    mod, params = MODELS["mlp"]()
    exe = tvmamp.build(mod, "O2", TARGET, dtype="float16", params=params)
    text = exe.mod.script()
    assert 'out_dtype="float32"' in text and "float16" in text
    assert exe.stats.level == "O2" and exe.stats.casts_inserted >= 1


def test_export_and_reload_in_a_fresh_process(tmp_path):
    mod, params = MODELS["mlp"]()
    x = models.example_inputs(mod)[0]
    exe = tvmamp.build(mod, "O2", TARGET, dtype="bfloat16", params=params)
    expected = exe(x)
    lib, data, result = tmp_path / "model.so", tmp_path / "x.npy", tmp_path / "out.npy"
    exe.export_library(str(lib))
    np.save(data, x)
    script = textwrap.dedent(f"""
        import numpy as np, tvm
        from tvm import relax
        vm = relax.VirtualMachine(tvm.runtime.load_module({str(lib)!r}), tvm.cpu())
        np.save({str(result)!r}, vm["main"](tvm.runtime.tensor(np.load({str(data)!r}))).numpy())
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    np.testing.assert_array_equal(np.load(result), expected)


def test_relax_function_is_accepted_and_non_models_are_type_errors():
    mod, params = MODELS["mlp"]()
    exe = tvmamp.build(mod["main"], "O1", TARGET, dtype="float16", params=params)
    assert exe(*models.example_inputs(mod)).shape == (8, 64)
    for bad in (None, "model.onnx", 3, np.zeros(3)):
        with pytest.raises(TypeError, match="expected a tvm.IRModule or relax.Function"):
            tvmamp.build(bad)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(level="O5"), ValueError, "level 'O5' is not one of O0, O1, O2, O3, OD, auto"),
        (dict(dtype="fp8"), ValueError, "dtype 'fp8' is not one of float16, bfloat16"),
        (dict(target="tpu"), ValueError, "unknown target 'tpu'"),
        (dict(custom_white_list=["conv9d"]), ValueError, "unknown op name 'conv9d'"),
        (dict(params={"nope": np.ones(3, "float32")}), ValueError, "not inputs of main"),
        (dict(tuning_log="/nonexistent/log"), FileNotFoundError, "is not a directory"),
    ],
)
def test_bad_input_gets_a_clear_error(kwargs, error, match):
    mod, params = MODELS["mlp"]()
    kwargs.setdefault("params", params)
    with pytest.raises(error, match=match):
        tvmamp.build(mod, **{"target": TARGET, **kwargs})


def test_inputs_are_checked_when_called():
    mod, params = MODELS["mlp"]()
    exe = tvmamp.build(mod, "O1", TARGET, dtype="float16", params=params)
    with pytest.raises(TypeError, match="dtype float64, but the model expects float32"):
        exe(np.ones((8, 64)))
    with pytest.raises(ValueError, match=r"shape \(2, 64\), but the model expects \(8, 64\)"):
        exe(np.ones((2, 64), "float32"))
    with pytest.raises(TypeError, match="takes 1 inputs"):
        exe()


def test_get_source_asm_and_ll():
    mod, params = MODELS["mlp"]()
    exe = tvmamp.build(mod, "O2", TARGET, dtype="bfloat16", params=params)
    assert ".text" in exe.get_source("asm")
    assert "define" in exe.get_source("ll")
    with pytest.raises(ValueError, match="is not one of asm, ll, cuda, ptx"):
        exe.get_source("sass")
    with pytest.raises(ValueError, match="no cuda module"):
        exe.get_source("cuda")


def test_cuda_build_compiles_without_a_gpu():
    mod, params = MODELS["mlp"]()
    exe = tvmamp.build(mod, "O2", "cuda -arch=sm_80", dtype="float16", params=params)
    assert "__global__" in exe.get_source("cuda")


def test_cuda_hardware_checks():
    mod, params = MODELS["mlp"]()
    with pytest.warns(UserWarning, match="AMP only support NVIDIA GPU with Compute Capability 7.0"):
        tvmamp.convert(mod, "O1", "cuda -arch=sm_61", dtype="float16", params=params)
    with pytest.raises(ValueError, match="bfloat16 needs compute capability 8.0"):
        tvmamp.convert(mod, "O1", "cuda -arch=sm_75", dtype="bfloat16", params=params)


def test_default_dtype_follows_the_target():
    mod, params = MODELS["mlp"]()
    assert tvmamp.convert(mod, "O2", "cuda -arch=sm_80", params=params).policy.low_dtype == (
        "float16"
    )
    converted = tvmamp.convert(mod, "O2", "llvm -mcpu=sapphirerapids", params=params)
    assert converted.report.low_dtype == "bfloat16"
    with pytest.warns(UserWarning, match="has no avx512_bf16"):
        tvmamp.convert(mod, "O2", "llvm -mcpu=haswell", dtype="bfloat16", params=params)
    converted = tvmamp.convert(mod, "O2", "llvm -mcpu=haswell", params=params)
    assert converted.report.low_dtype == "float16"


def test_well_formed_after_the_pass_on_every_model():
    for make in MODELS.values():
        mod, params = make()
        for level in tvmamp.LEVELS:
            converted = tvmamp.convert(mod, level, TARGET, dtype="float16", params=params)
            relax.analysis.well_formed(converted.mod)


def test_cuda_ptx_comes_from_nvcc_without_a_gpu():
    mod, params = MODELS["mlp"]()
    exe = tvmamp.build(mod, "O2", "cuda -arch=sm_80", dtype="float16", params=params)
    ptx = exe.get_source("ptx")
    assert ".target sm_80" in ptx and ".entry" in ptx


def test_bf16_constant_fill_kernels_build():
    """A bf16 zeros kernel on its own (vector stores of a bf16 constant fail in TVM)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 64), "bfloat16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            zeros = bb.emit_output(relax.op.zeros((64, 64), "bfloat16"))
            out = bb.emit_output(relax.op.add(x, x))
        bb.emit_func_output(relax.Tuple([out, zeros]))
    import ml_dtypes

    data = np.random.default_rng(0).standard_normal((4, 64)).astype(ml_dtypes.bfloat16)
    out, zeros = tvmamp.build(bb.get(), "O0", TARGET)(data)
    assert zeros.shape == (64, 64) and not zeros.astype("float32").any()
    np.testing.assert_array_equal(out, data + data)


@pytest.mark.parametrize(
    "name,norm", [("transformer", "relax.nn.layer_norm"), ("conv_bn_relu", "relax.nn.batch_norm")]
)
def test_o3_bf16_keeps_ops_without_bf16_kernels_in_fp32(fp32_outputs, name, norm):
    """TVM cannot lower layer_norm or batch_norm in bf16: O3 bf16 used to fail to build."""
    mod, params, inputs, reference = fp32_outputs[name]
    exe = tvmamp.build(mod, "O3", TARGET, dtype="bfloat16", params=params)
    norms = [n for n in exe.stats.nodes if n.op == norm]
    assert norms and all(n.dtype == "float32" for n in norms)
    assert 0 < max_rel_error(exe(*inputs), reference) <= 5e-2
    forced = tvmamp.convert(
        mod, "O3", TARGET, "bfloat16", params, node_dtypes={norms[0].node: "low"}
    )
    node = next(n for n in forced.report.nodes if n.node == norms[0].node)
    assert (node.dtype, node.reason) == ("float32", "unsupported")
