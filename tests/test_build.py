"""tvmamp.build end to end on the CPU: numerics against fp32, export, errors, sources."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from tolerances import assert_close, tolerance
from tvm import relax

import tvmamp
from tvmamp import models
from tvmamp.tensors import np_dtype

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


LEVELS = [
    ("O1", "float16"),
    ("O2", "bfloat16"),
    ("O2", "float16"),
    ("O3", "float16"),
    ("OD", "float16"),
    ("OD", "bfloat16"),
    ("auto", "bfloat16"),
]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("level,dtype", LEVELS)
def test_numerics_against_fp32(fp32_outputs, name, level, dtype):
    mod, params, inputs, reference = fp32_outputs[name]
    exe = tvmamp.build(mod, level, TARGET, dtype=dtype, params=params)
    out = exe(*inputs)
    assert out.dtype == np.float32  # keep_io_types
    assert_close(out, reference, **tolerance(dtype), what=f"{name} {level} {dtype}")
    assert not np.array_equal(out, reference)  # something ran low
    assert exe.stats.ops_per_dtype().get(dtype, 0) > 0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_od_runs_only_the_white_list_low_and_o3_runs_everything_low(name):
    mod, params = MODELS[name]()
    od = tvmamp.convert(mod, "OD", TARGET, "float16", params).report.nodes
    assert {n.op for n in od if n.dtype == "float16"} == {n.op for n in od if n.category == "white"}
    assert any(n.dtype == "float32" for n in od)
    o3 = tvmamp.convert(mod, "O3", TARGET, "float16", params).report.nodes
    assert {n.dtype for n in o3} == {"float16"}  # fp16 has kernels for every op here


@pytest.mark.parametrize(
    "name",
    [
        "conv_bn_relu",
        "mlp",
        "transformer",
    ],
)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_keep_io_types_false_takes_and_returns_the_low_dtype(fp32_outputs, name, dtype):
    mod, params, inputs, reference = fp32_outputs[name]
    exe = tvmamp.build(mod, "O2", TARGET, dtype=dtype, params=params, keep_io_types=False)
    low = np_dtype(dtype)
    with pytest.raises(TypeError, match=f"dtype float32, but the model expects {dtype}"):
        exe(*inputs)
    out = exe(*[x.astype(low) for x in inputs])
    assert_close(out, reference, **tolerance(dtype), what=f"{name} {dtype}")
    assert [str(p.ty.dtype) for p in exe.mod["main"].params] == [dtype] * len(inputs)
    assert out.dtype == low and str(exe.mod["main"].ret_ty.dtype) == dtype


def _long_dot_product(k=4096, n=16, m=4):
    """``x @ w.T`` with K=4096 positive terms: sums near 4096, where fp16's spacing is 2-4."""
    w = np.random.default_rng(0).uniform(0.5, 1.5, (n, k)).astype("float32")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    wv = relax.Var("w", relax.TensorType((n, k), "float32"))
    with bb.function("main", [x, wv]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, relax.op.permute_dims(wv)))
        bb.emit_func_output(out)
    mod = bb.get()
    mod["main"] = mod["main"].with_attr("num_input", 1)
    x = np.random.default_rng(1).uniform(0.5, 1.5, (m, k)).astype("float32")
    return mod, {"w": w}, x, x.astype("float64") @ w.T.astype("float64")


def _matmul_out_dtypes(exe):
    found = []
    relax.analysis.post_order_visit(
        exe.mod["main"],
        lambda e: (
            found.append(str(e.attrs.out_dtype))
            if isinstance(e, relax.Call) and getattr(e.op, "name", "") == "relax.matmul"
            else None
        ),
    )
    return found


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_accumulate_dtype_sets_the_matmul_out_dtype(dtype):
    mod, params = MODELS["mlp"]()
    for acc in ("float32", dtype):
        exe = tvmamp.build(mod, "O2", TARGET, dtype, params, accumulate_dtype=acc)
        assert _matmul_out_dtypes(exe) == [acc] * 3, acc


def test_fp16_accumulation_loses_what_fp32_accumulation_keeps():
    """accumulate_dtype reaches the kernel: a 4096-term fp16 sum is far off, the fp32 one is not.

    Whatever the summation order, fp16 partial sums (and the fp16 result) are rounded to
    fp16's spacing near 4096, while fp32 accumulation leaves only the inputs' rounding, which
    averages out over the long sum.
    """
    mod, params, x, ref = _long_dot_product()
    errors = {}
    for acc in ("float32", "float16"):
        exe = tvmamp.build(mod, "O1", TARGET, "float16", params, accumulate_dtype=acc)
        errors[acc] = float(np.max(np.abs(exe(x) - ref) / np.abs(ref)))
    assert errors["float32"] < 1e-4, errors  # measured 1.0e-5
    assert 10 * errors["float32"] < errors["float16"] < 0.2, errors  # measured 0.069


def _conv3x3(x, w):
    """NCHW conv, 3x3 kernel, padding 1, stride 1, in float64."""
    h, wd = x.shape[2:]
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = 0.0
    for i in range(3):
        for j in range(3):
            window = padded[:, :, i : i + h, j : j + wd]
            out = out + np.einsum("nchw,fc->nfhw", window, w[:, :, i, j])
    return out


def numpy_conv_net(params, x, blocks=2, eps=1e-5):
    """models.conv_net in float64 numpy: inference batch norm with its running statistics."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    y = x.astype(np.float64)
    for i in range(blocks):
        per_channel = {k: p[f"bn{i}.{k}"][None, :, None, None] for k in ("weight", "bias")}
        mean = p[f"bn{i}.running_mean"][None, :, None, None]
        var = p[f"bn{i}.running_var"][None, :, None, None]
        y = (_conv3x3(y, p[f"conv{i}.weight"]) - mean) / np.sqrt(var + eps)
        y = np.maximum(y * per_channel["weight"] + per_channel["bias"], 0.0)
    return y.mean(axis=(2, 3)) @ p["head.weight"].T + p["head.bias"]


def test_conv_net_batch_norm_uses_its_running_statistics(fp32_outputs):
    """Against numpy: a batch norm that drops the variance or the mean is visibly wrong."""
    mod, params, inputs, reference = fp32_outputs["conv_bn_relu"]
    variances = np.concatenate([params[f"bn{i}.running_var"] for i in range(2)])
    assert variances.min() > 0 and np.abs(np.log(variances)).min() > 0.6  # none near 1
    want = numpy_conv_net(params, inputs[0])
    assert_close(reference, want, **tolerance("float32"), what="conv_net O0")
    exe = tvmamp.build(mod, "O2", TARGET, "float16", params=params)
    assert_close(exe(*inputs), want, **tolerance("float16"), what="conv_net O2 float16")


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
        (dict(accumulate_dtype="int8"), ValueError, "accumulate_dtype 'int8' is not one of"),
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


def _relu_bn(channels: int = 8):
    """relu -> inference batch_norm: a batch norm FoldBatchNorm cannot fold into a conv."""
    rng = np.random.default_rng(5)
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, channels, 6, 6), "float32"))
    stats = [rng.uniform(0.5, 1.5, channels), rng.uniform(-1, 1, channels)]
    stats += [rng.uniform(-1, 1, channels), rng.uniform(0.5, 2, channels)]
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(x))
            consts = [relax.const(v.astype("float32")) for v in stats]
            bn = bb.emit(relax.op.nn.batch_norm(y, *consts, axis=1, training=False))
            out = bb.emit_output(relax.TupleGetItem(bn, 0))
        bb.emit_func_output(out)
    mod = bb.get()
    inputs = [rng.standard_normal((2, channels, 6, 6)).astype("float32")]
    return mod, None, inputs, tvmamp.build(mod, "O0", TARGET)(*inputs)


@pytest.mark.parametrize(
    "name,norm", [("transformer", "relax.nn.layer_norm"), ("relu_bn", "relax.nn.batch_norm")]
)
def test_o3_bf16_keeps_ops_without_bf16_kernels_in_fp32(fp32_outputs, name, norm):
    """TVM cannot lower layer_norm or batch_norm in bf16: O3 bf16 used to fail to build."""
    mod, params, inputs, reference = _relu_bn() if name == "relu_bn" else fp32_outputs[name]
    exe = tvmamp.build(mod, "O3", TARGET, dtype="bfloat16", params=params)
    norms = [n for n in exe.stats.nodes if n.op == norm]
    assert norms and all(n.dtype == "float32" for n in norms)
    assert_close(exe(*inputs), reference, **tolerance("bfloat16"), what=f"{name} O3 bfloat16")
    forced = tvmamp.convert(
        mod, "O3", TARGET, "bfloat16", params, node_dtypes={norms[0].node: "low"}
    )
    node = next(n for n in forced.report.nodes if n.node == norms[0].node)
    assert (node.dtype, node.reason) == ("float32", "unsupported")


def test_o3_bf16_grid_sample_then_an_op_builds(rng):
    """topi's grid_sample returns fp32 for bf16 inputs: the multiply after it failed to build
    at O3 ("Binary operators must have the same datatype")."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 2, 16, 16), "float32"))
    g = relax.Var("g", relax.TensorType((1, 2, 8, 8), "float32"))
    with bb.function("main", [x, g]):
        with bb.dataflow():
            sampled = bb.emit(relax.op.image.grid_sample(x, g))
            out = bb.emit_output(relax.op.multiply(sampled, relax.const(2.0, "float32")))
        bb.emit_func_output(out)
    inputs = [rng.standard_normal((1, 2, 16, 16)).astype("float32")]
    inputs.append(rng.uniform(-1, 1, (1, 2, 8, 8)).astype("float32"))
    reference = tvmamp.build(bb.get(), "O0", TARGET)(*inputs)
    exe = tvmamp.build(bb.get(), "O3", TARGET, dtype="bfloat16")
    assert [n.dtype for n in exe.stats.nodes if n.op == "relax.image.grid_sample"] == ["float32"]
    np.testing.assert_allclose(exe(*inputs), reference, rtol=1e-2, atol=1e-2)


def test_inference_batch_norms_fold_into_their_convs(fp32_outputs):
    """conv_net's batch norms (after convs, constant statistics) cost no kernel at any level."""
    mod, params, inputs, reference = fp32_outputs["conv_bn_relu"]
    for level in ("O0", "O2"):
        exe = tvmamp.build(mod, level, TARGET, dtype="bfloat16", params=params)
        assert not [n for n in exe.stats.nodes if n.op == "relax.nn.batch_norm"]
        tol = tolerance("float32" if level == "O0" else "bfloat16")
        assert_close(exe(*inputs), reference, **tol, what=f"conv_net {level}")


def test_a_float16_model_built_in_bfloat16_is_told(recwarn):
    """Its fp16 ops are recomputed in bf16 (3 fewer mantissa bits): 6x torch fp16's error on a
    model a helper tried, without a word."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float16"))
    w = relax.const(np.ones((8, 8), "float16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.nn.relu(relax.op.matmul(x, w)))
        bb.emit_func_output(out)
    with pytest.warns(UserWarning, match="2 ops of the model compute in float16; at O2"):
        tvmamp.convert(bb.get(), "O2", TARGET, "bfloat16")
    recwarn.clear()
    tvmamp.convert(bb.get(), "O2", TARGET, "float16")
    tvmamp.convert(bb.get(), "O0", TARGET, "bfloat16")
    assert not [w for w in recwarn if "compute in float16" in str(w.message)]
