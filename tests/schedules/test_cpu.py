"""Numerical and structural tests of the default CPU schedule rules."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.script import tirx as T

import tvmamp
from tvmamp.pipeline import legalize_passes
from tvmamp.schedules.cpu import CPUConv2d, CPUMatmul, cpu_schedule_passes, default_cpu_rules

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": 2})
LEGALIZE = legalize_passes()


def _schedule(mod: tvm.IRModule) -> tvm.IRModule:
    with TARGET:
        passes = [*LEGALIZE, *cpu_schedule_passes(TARGET)]
        return tvm.transform.Sequential(passes)(mod)


def _run(mod: tvm.IRModule, *arrays: np.ndarray) -> tuple[np.ndarray, tvm.IRModule]:
    """Schedule, build and run ``mod``; return its output and the scheduled module."""
    scheduled = _schedule(mod)
    vm = relax.VirtualMachine(tvm.compile(scheduled, target=TARGET), tvm.cpu())
    out = vm["main"](*[tvm.runtime.tensor(a) for a in arrays])
    return out.numpy(), scheduled


def _prim_funcs(mod: tvm.IRModule) -> dict[str, tvm.tirx.PrimFunc]:
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}


def _assert_scheduled(mod: tvm.IRModule, name_part: str, parallel: bool = True) -> None:
    """Assert the PrimFunc whose name contains ``name_part`` was scheduled and vectorised."""
    funcs = [(name, f) for name, f in _prim_funcs(mod).items() if name_part in name]
    assert funcs, f"no PrimFunc named like {name_part!r} in {list(_prim_funcs(mod))}"
    for name, func in funcs:
        assert func.attrs["tirx.is_scheduled"]
        text = func.script()
        # a ragged weight pack calls the SIMD pair-interleaving helper on its whole tiles
        assert "T.vectorized" in text or "tvmamp_pack_pairs_2x32" in text
        if not name.endswith("_prepack"):  # bf16 packing copies: parallel only when large
            assert ("T.parallel" in text) == parallel


def _module(inputs: dict[str, tuple[tuple[int, ...], str]], body) -> tvm.IRModule:
    """Build a one-function Relax module; ``body(bb, *vars)`` returns the output expression."""
    bb = relax.BlockBuilder()
    params = [relax.Var(name, relax.TensorType(shape, dt)) for name, (shape, dt) in inputs.items()]
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(body(bb, *params))
        bb.emit_func_output(out)
    return bb.get()


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def _randn(rng: np.random.Generator, shape, dtype="float32") -> np.ndarray:
    return (rng.standard_normal(shape) + 0.1).astype(dtype)


@pytest.mark.parametrize(
    ("m", "k", "n", "dtype", "rtol"),
    [
        (256, 128, 96, "float32", 1e-5),
        (37, 45, 29, "float32", 1e-5),
        (1, 64, 100, "float32", 1e-5),
        (64, 96, 80, "bfloat16", 1e-2),
        (37, 45, 29, "bfloat16", 1e-2),
    ],
)
def test_matmul_bias_relu(m, k, n, dtype, rtol):
    rng = np.random.default_rng(0)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    x, w, b = _randn(rng, (m, k), np_dtype), _randn(rng, (k, n), np_dtype), _randn(rng, (n,))

    def body(bb, x, w, b):
        y = bb.emit(relax.op.matmul(x, w, out_dtype="float32"))
        return relax.op.nn.relu(relax.op.add(y, b))

    inputs = {"x": ((m, k), dtype), "w": ((k, n), dtype), "b": ((n,), "float32")}
    out, mod = _run(_module(inputs, body), x, w, b)
    ref = np.maximum(x.astype("float64") @ w.astype("float64") + b, 0)
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol * np.sqrt(k))
    _assert_scheduled(mod, "matmul", parallel=m * k * n >= 1 << 16)


def test_matmul_bf16_output_cast():
    rng = np.random.default_rng(1)
    x, w = _randn(rng, (48, 70), ml_dtypes.bfloat16), _randn(rng, (70, 40), ml_dtypes.bfloat16)

    def body(bb, x, w):
        return relax.op.astype(bb.emit(relax.op.matmul(x, w, out_dtype="float32")), "bfloat16")

    inputs = {"x": ((48, 70), "bfloat16"), "w": ((70, 40), "bfloat16")}
    out, mod = _run(_module(inputs, body), x, w)
    assert out.dtype == ml_dtypes.bfloat16
    ref = x.astype("float64") @ w.astype("float64")
    np.testing.assert_allclose(out.astype("float64"), ref, rtol=1e-2, atol=1e-1)
    _assert_scheduled(mod, "matmul")


@pytest.mark.parametrize(
    ("a_shape", "b_shape"), [((3, 17, 40), (3, 40, 24)), ((2, 5, 33), (33, 20))]
)
def test_batch_matmul(a_shape, b_shape):
    rng = np.random.default_rng(2)
    a, b = _randn(rng, a_shape), _randn(rng, b_shape)
    inputs = {"a": (a_shape, "float32"), "b": (b_shape, "float32")}
    out, mod = _run(_module(inputs, lambda bb, a, b: relax.op.matmul(a, b)), a, b)
    np.testing.assert_allclose(out, np.matmul(a.astype("float64"), b), rtol=1e-5, atol=1e-4)
    assert _prim_funcs(mod)["matmul"].attrs["tirx.is_scheduled"]


@T.prim_func(s_tir=True)
def _dense(
    x: T.Buffer((40, 72), "float32"),
    w: T.Buffer((50, 72), "float32"),
    y: T.Buffer((40, 50), "float32"),
):
    for i, j, k in T.grid(40, 50, 72):
        with T.sblock("dense"):
            vi, vj, vk = T.axis.remap("SSR", [i, j, k])
            with T.init():
                y[vi, vj] = T.float32(0)
            y[vi, vj] = y[vi, vj] + x[vi, vk] * w[vj, vk]


def test_dense_transposed_weight():
    sch = CPUMatmul().apply(_dense, TARGET, False)
    assert sch is not None
    assert "T.vectorized" in sch.mod["main"].script()
    lib = tvm.compile(sch.mod, target=TARGET)
    rng = np.random.default_rng(3)
    x, w = _randn(rng, (40, 72)), _randn(rng, (50, 72))
    y = tvm.runtime.tensor(np.zeros((40, 50), "float32"))
    lib["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(w), y)
    np.testing.assert_allclose(y.numpy(), x.astype("float64") @ w.T, rtol=1e-5, atol=1e-4)


def test_matmul_over_symbolic_rows():
    """``x[n, 32] @ w``, fp32, ``n`` symbolic: the rows are padded to whole tiles in the kernel
    (the rule declined: a scalar loop), and ``w``'s panels are packed by a function of their
    own."""
    n = tvm.tirx.Var("n", "int64")
    inputs = {"x": ((n, 32), "float32"), "w": ((32, 48), "float32")}
    mod = _module(inputs, lambda bb, x, w: relax.op.matmul(x, w))
    kernels = _prim_funcs(_schedule(mod))
    assert sorted(kernels) == ["matmul_prepacked", "matmul_weight_prepack"]
    kernel = kernels["matmul_prepacked"]
    assert kernel.attrs["tirx.is_scheduled"] and "T.vectorized" in kernel.script()
    rng = np.random.default_rng(5)
    w = _randn(rng, (32, 48))
    for rows in (1, 13):
        x = _randn(rng, (rows, 32))
        out, _ = _run(mod, x, w)
        np.testing.assert_allclose(out, x.astype("float64") @ w, rtol=1e-5, atol=1e-4)


def test_a_constant_weight_over_symbolic_rows_is_packed_at_compile_time():
    """``x[b, s, 64] @ W + bias`` with ``W`` a constant, ``b`` and ``s`` symbolic (a Linear layer
    exported with dynamic axes): ``W``'s panels are folded into a constant, and the kernel is
    the only one left to run. Packed in the kernel, they were packed again on every call (an
    fp32 GPT-2 decode step: 12 of 13 ms in its Linear kernels)."""
    rng = np.random.default_rng(6)
    w, bias = _randn(rng, (64, 40)), _randn(rng, (40,))
    b, s = (tvm.tirx.Var(name, "int64") for name in "bs")
    mod = _module(
        {"x": ((b, s, 64), "float32")},
        lambda bb, x: relax.op.add(relax.op.matmul(x, relax.const(w)), relax.const(bias)),
    )
    scheduled = _schedule(mod)
    assert not any(name.endswith("_prepack") for name in _prim_funcs(scheduled))
    calls = [
        binding.value
        for block in scheduled["main"].body.blocks
        for binding in block.bindings
        if isinstance(binding.value, relax.Call)
    ]
    assert len(calls) == 1
    constants = [a for a in calls[0].args[1].fields if isinstance(a, Constant)]
    # two 32-column panels of W, and the bias
    assert [list(a.value.shape) for a in constants] == [[1, 2, 64, 32], [40]]
    for shape in [(1, 1), (1, 7), (3, 3), (2, 33)]:
        x = _randn(rng, (*shape, 64))
        out, _ = _run(mod, x)
        np.testing.assert_allclose(out, x.astype("float64") @ w + bias, rtol=1e-5, atol=1e-4)


def _scores(bb, q, k):
    return relax.op.matmul(q, bb.emit(relax.op.permute_dims(k, [0, 2, 1])), out_dtype="float32")


def _context(bb, p, v):
    return relax.op.matmul(p, v, out_dtype="float32")


@pytest.mark.parametrize(
    ("body", "operands"),
    [(_scores, lambda n: [(n, 40), (n, 40)]), (_context, lambda n: [(n, n), (n, 24)])],
    ids=["q @ k.T", "p @ v"],
)
def test_attention_over_a_symbolic_length(body, operands):
    """An attention's bf16 GEMMs over a dynamic sequence length ``n``: ``q @ k.T`` has ``n``
    columns, ``p @ v`` reduces over ``n``. Neither fits the bf16 rule (its packed ``B`` must
    be split out of the kernel, which TVM does for static shapes only), and the widening rule
    declined them too: scalar loops, 30x slower (MPT exported with dynamic axes spent most
    of its time there). The widening rule now pads and packs them in the kernel."""
    b, n = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("n", "int64")
    names = body.__code__.co_varnames[1:3]
    shapes = [(b, *shape) for shape in operands(n)]
    inputs = {name: (shape, "bfloat16") for name, shape in zip(names, shapes, strict=True)}
    mod = _module(inputs, body)
    kernel = _schedule(mod)["matmul"]
    assert kernel.attrs["tirx.is_scheduled"] and "T.vectorized" in kernel.script()
    rng = np.random.default_rng(6)
    for batch, length in ((2, 32), (3, 77)):
        a, c = (_randn(rng, (batch, *s), "bfloat16") for s in operands(length))
        out, _ = _run(mod, a, c)
        c64 = c.astype("float64")
        ref = a.astype("float64") @ (c64.transpose(0, 2, 1) if body is _scores else c64)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("dtype", "in_place"), [("float32", True), ("bfloat16", False)])
def test_values_of_whole_tiles_over_a_symbolic_length(dtype, in_place):
    """``p @ v`` over ``n`` keys, ``v`` of 64 columns (two column tiles, no padding): an fp32
    ``v`` is read in place, each of its rows two panels' width already (packed in the kernel
    on every call, it cost a copy of ``v`` with a bounds check per element: an fp32 decoder's
    step over its cache). A bf16 ``v`` keeps its panels, which TVM stores as fp32."""
    b, n = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("n", "int64")
    inputs = {"p": ((b, n, n), dtype), "v": ((b, n, 64), dtype)}
    mod = _module(inputs, _context)
    kernel = _schedule(mod)["matmul"]
    assert ("v_reindex" not in kernel.script()) == in_place
    assert "T.vectorized" in kernel.script()
    rng = np.random.default_rng(7)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    for batch, length in ((1, 1), (2, 9), (3, 77)):
        p, v = (_randn(rng, (batch, length, c), np_dtype) for c in (length, 64))
        out, _ = _run(mod, p, v)
        ref = p.astype("float64") @ v.astype("float64")
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)


SERIAL = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": 1})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scores_over_a_symbolic_key_count_check_only_the_last_tile(dtype):
    """``q @ k^T`` over ``n`` keys and ``s`` queries (a decode step's scores), one core: the
    padded panels of ``k^T`` and the padded tiles are bounds-checked ``likely``, so that
    LoopPartition splits the whole tiles off the last (TVM vectorised the checked loads and
    stores lane by lane, on every tile). Exact against float64 on both sides of the tiles."""
    b, s, n = (tvm.tirx.Var(name, "int64") for name in "bsn")
    inputs = {"q": ((b, 4, s, 64), dtype), "k": ((b, 4, 64, n), dtype)}
    mod = _module(inputs, lambda bb, q, k: relax.op.matmul(q, k, out_dtype="float32"))
    with SERIAL:
        scheduled = tvm.transform.Sequential([*LEGALIZE, *cpu_schedule_passes(SERIAL)])(mod)
    assert scheduled["matmul"].script().count('"tvmamp.likely_in_bounds"') == 2
    vm = relax.VirtualMachine(tvm.compile(scheduled, target=SERIAL), tvm.cpu())
    rng = np.random.default_rng(8)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    for batch, queries, keys in ((1, 1, 1), (1, 1, 31), (2, 1, 32), (1, 3, 33), (2, 9, 65)):
        q = _randn(rng, (batch, 4, queries, 64), np_dtype)
        k = _randn(rng, (batch, 4, 64, keys), np_dtype)
        out = vm["main"](tvm.runtime.tensor(q), tvm.runtime.tensor(k)).numpy()
        ref = q.astype("float64") @ k.astype("float64")
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cores", [1, 2])
def test_one_query_against_a_symbolic_key_count_reads_the_keys_in_place(dtype, cores):
    """``sum(q * k, -1)``: one query's scores against ``n`` keys of 64 values (a decoder's
    step, as ``DecomposeAttention`` writes it). The matmul rule takes it as dot products that
    read ``k`` in place, each adding its partial results in halves: packed into column panels
    on every call, ``k`` was read through a transposing gather (12 heads x 2049 keys, fp32, one
    thread: 0.51 -> 0.12 ms). Exact against float64 on both sides of a vector of keys."""
    b, n = (tvm.tirx.Var(name, "int64") for name in "bn")
    inputs = {"q": ((b, 4, 1, 64), dtype), "k": ((b, 4, n, 64), dtype)}

    def scores(_bb, q, k):
        q, k = (relax.op.astype(x, "float32") for x in (q, k))
        return relax.op.sum(relax.op.multiply(q, k), axis=[3])

    mod = _module(inputs, scores)
    target = TARGET if cores == 2 else SERIAL
    with target:
        scheduled = tvm.transform.Sequential([*LEGALIZE, *cpu_schedule_passes(target)])(mod)
    (kernel,) = _prim_funcs(scheduled).values()
    script = kernel.script()
    assert kernel.attrs["tirx.is_scheduled"]
    buffers = [line for line in script.splitlines() if "sblock_alloc_buffer" in line]
    assert all('scope="local"' in line for line in buffers)  # no copy of either operand
    assert "for ax0 in T.vectorized(T.int64(2)):" in script  # the last of the halves
    assert ("T.parallel" in script) == (cores == 2)
    vm = relax.VirtualMachine(tvm.compile(scheduled, target=target), tvm.cpu())
    rng = np.random.default_rng(9)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    for batch, keys in ((1, 1), (2, 17), (1, 2049)):
        q = _randn(rng, (batch, 4, 1, 64), np_dtype)
        k = _randn(rng, (batch, 4, keys, 64), np_dtype)
        out = vm["main"](tvm.runtime.tensor(q), tvm.runtime.tensor(k)).numpy()
        ref = (q.astype("float64") * k.astype("float64")).sum(-1)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("batch", [1, 3])
def test_batch_matmul_over_a_symbolic_batch(batch):
    """An attention's ``q @ k`` under a dynamic batch: both operands are run-time tensors
    with a symbolic batch, which the register tiles take (it was a scalar loop)."""
    s = tvm.tirx.Var("s", "int64")
    inputs = {"a": ((s, 17, 40), "bfloat16"), "b": ((s, 40, 24), "bfloat16")}

    def body(bb, a, b):
        return relax.op.matmul(a, b, out_dtype="float32")

    kernel = _schedule(_module(inputs, body))["matmul"]
    assert kernel.attrs["tirx.is_scheduled"] and "T.vectorized" in kernel.script()
    rng = np.random.default_rng(batch)
    a = _randn(rng, (batch, 17, 40), "bfloat16")
    b = _randn(rng, (batch, 40, 24), "bfloat16")
    out, _ = _run(_module(inputs, body), a, b)
    ref = np.matmul(a.astype("float64"), b.astype("float64"))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "stride", "padding", "dilation"),
    [
        ((1, 3, 15, 17), (5, 3, 3, 3), 2, 1, 1),
        ((2, 7, 20, 19), (13, 7, 3, 3), 2, 1, 2),
        ((1, 16, 9, 9), (48, 16, 1, 1), 1, 0, 1),
        ((1, 32, 14, 14), (64, 32, 3, 3), 1, 1, 1),
    ],
)
def test_conv2d_bias_relu(x_shape, w_shape, stride, padding, dilation):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    x, w, b = _randn(rng, x_shape), _randn(rng, w_shape), _randn(rng, (1, w_shape[0], 1, 1))

    def body(bb, x, w, b):
        y = relax.op.nn.conv2d(x, w, strides=stride, padding=padding, dilation=dilation)
        return relax.op.nn.relu(relax.op.add(bb.emit(y), b))

    inputs = {"x": (x_shape, "float32"), "w": (w_shape, "float32"), "b": (b.shape, "float32")}
    out, mod = _run(_module(inputs, body), x, w, b)
    conv = torch.nn.functional.conv2d(
        *(torch.from_numpy(a).double() for a in (x, w)), None, stride, padding, dilation
    )
    ref = torch.relu(conv + torch.from_numpy(b).double()).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
    _assert_scheduled(mod, "conv2d", parallel=out.size * np.prod(w_shape[1:]) >= 1 << 16)


def _legalized(inputs, body) -> tvm.IRModule:
    with TARGET:
        return tvm.transform.Sequential(LEGALIZE)(_module(inputs, body))


def test_rules_do_not_overlap():
    matmul = _legalized(
        {"x": ((32, 32), "float32"), "w": ((32, 32), "float32")},
        lambda bb, x, w: relax.op.matmul(x, w),
    )["matmul"]
    conv = _legalized(
        {"x": ((1, 8, 10, 10), "float32"), "w": ((16, 8, 3, 3), "float32")},
        lambda bb, x, w: relax.op.nn.conv2d(x, w, padding=1),
    )["conv2d"]
    assert CPUConv2d().apply(matmul, TARGET, False) is None
    assert CPUMatmul().apply(conv, TARGET, False) is None
    assert CPUConv2d().apply(conv, TARGET, False) is not None


@pytest.mark.parametrize(
    ("shapes", "body", "ref"),
    [
        (
            [(37, 53), (53,)],
            lambda bb, x, y: relax.op.nn.relu(relax.op.add(x, y)),
            lambda x, y: np.maximum(x + y, 0),
        ),
        ([(128, 256)], lambda bb, x: relax.op.permute_dims(x), lambda x: x.T),
        ([(64, 1000)], lambda bb, x: relax.op.nn.softmax(x), lambda x: _softmax(x)),
    ],
)
def test_injective_and_reduction(shapes, body, ref):
    rng = np.random.default_rng(5)
    arrays = [_randn(rng, s) for s in shapes]
    inputs = {f"x{i}": (s, "float32") for i, s in enumerate(shapes)}
    out, mod = _run(_module(inputs, body), *arrays)
    np.testing.assert_allclose(out, ref(*arrays), rtol=1e-5, atol=1e-6)
    assert all(f.attrs["tirx.is_scheduled"] for f in _prim_funcs(mod).values())


def test_default_rules_reject_non_cpu_target():
    with pytest.raises(ValueError, match="target kind 'cuda' is not 'llvm'"):
        default_cpu_rules(tvm.target.Target({"kind": "cuda", "arch": "sm_80"}))


@pytest.mark.parametrize(
    ("rows", "cols", "side"), [(48, 144, 16), (24, 40, 8), (64, 64, 16), (121, 64, 16), (9, 11, 16)]
)
def test_transposes_take_the_largest_square_tile_that_divides_them(rows, cols, side):
    """bf16 [48, 144]: 144 is not a multiple of 32 lanes, so 16 x 16 tiles (not a flat copy).

    Sides that are not multiples of 16 but at least 16 (121 = 11 x 11 pixels, 24 x 40) are
    copied by 16 x 16 register transposes too, the last tile of a side overlapping the one
    before; sides under 16 (9 x 11) keep vectorised square tiles.
    """
    from tvm import te

    from tvmamp.schedules.cpu.elementwise import CPUElementwise

    a = te.placeholder((rows, cols), "bfloat16", name="a")
    b = te.compute((cols, rows), lambda i, j: a[j, i], name="b")
    sch = CPUElementwise().apply(te.create_prim_func([a, b]), TARGET, False)
    if rows % 16 == 0 and cols % 16 == 0:  # whole 16 x 16 tiles: shuffled in registers
        assert '"tvmamp_transpose_16x16_i16"' in sch.mod.script()
        assert int(sch.get(sch.get_loops(sch.get_sblock("b_o"))[0]).extent) == rows * cols // 256
    elif min(rows, cols) >= 16:  # ragged: register transposes, the last tile overlapping
        assert '"tvmamp_transpose_16x16_i16"' in sch.mod.script()
        assert "T.vectorized" not in sch.mod.script()
    else:
        loops = sch.get_loops(sch.get_sblock("b"))
        assert [int(sch.get(loop).extent) for loop in loops[-2:]] == [side, side]
        assert sch.get(loops[-1]).kind == tvm.tirx.ForKind.VECTORIZED
    lib = tvm.compile(sch.mod, target=TARGET)
    x = np.random.default_rng(7).standard_normal((rows, cols)).astype(ml_dtypes.bfloat16)
    dev = tvm.cpu()
    out = tvm.runtime.tensor(np.zeros((cols, rows), ml_dtypes.bfloat16), dev)
    lib(tvm.runtime.tensor(x, dev), out)
    np.testing.assert_array_equal(out.numpy(), x.T)


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int32", "int8"])
def test_whole_tile_transposes_shuffle_in_registers_and_copy_exactly(dtype, cores, rng):
    """[3, 48, 80] -> [3, 80, 48] (attention's K^T): 16- and 32-bit elements take the register
    transpose (:mod:`tvmamp.schedules.cpu.transpose_intrin`), int8 keeps the vector copy."""
    from tvm import te

    from tvmamp.schedules.cpu.elementwise import CPUElementwise

    target = tvm.target.Target({"kind": "llvm", "mcpu": "x86-64-v4", "num-cores": cores})
    a = te.placeholder((3, 48, 80), dtype, name="a")
    b = te.compute((3, 80, 48), lambda n, i, j: a[n, j, i], name="b")
    sch = CPUElementwise().apply(te.create_prim_func([a, b]), target, False)
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    bits = np.dtype(np_dtype).itemsize * 8
    assert (f'"tvmamp_transpose_16x16_i{bits}"' in sch.mod.script()) == (bits in (16, 32))
    lib = tvm.compile(sch.mod, target=target)
    x = (rng.standard_normal((3, 48, 80)) * 50).astype(
        ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype
    )
    out = tvm.runtime.tensor(np.zeros((3, 80, 48), x.dtype), tvm.cpu())
    lib(tvm.runtime.tensor(x, tvm.cpu()), out)
    np.testing.assert_array_equal(out.numpy(), x.transpose(0, 2, 1))


@pytest.mark.parametrize("dst", ["bfloat16", "float16"])
def test_a_casting_transpose_rounds_like_the_cast(dst, rng):
    """fp32 -> bf16 transposed: rounded in registers (to nearest even; NaN stays NaN, +-inf
    and overflow as the cast); fp32 -> fp16 keeps the vector copy. Both exact."""
    from tvm import te

    from tvmamp.schedules.cpu.elementwise import CPUElementwise

    a = te.placeholder((32, 64), "float32", name="a")
    b = te.compute((64, 32), lambda i, j: a[j, i].astype(dst), name="b")
    sch = CPUElementwise().apply(te.create_prim_func([a, b]), TARGET, False)
    assert ("tvmamp_transpose_16x16_i16_from_f32" in sch.mod.script()) == (dst == "bfloat16")
    lib = tvm.compile(sch.mod, target=TARGET)
    x = rng.standard_normal((32, 64)).astype("float32")
    # ties to even both ways, the largest finite value, specials
    x.reshape(-1)[:8] = np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x80000001], "uint32").view(
        "float32"
    ).tolist() + [np.inf, -np.inf, np.nan, -0.0]
    low = ml_dtypes.bfloat16 if dst == "bfloat16" else np.float16
    out = tvm.runtime.tensor(np.zeros((64, 32), low), tvm.cpu())
    lib(tvm.runtime.tensor(x, tvm.cpu()), out)
    with np.errstate(over="ignore"):
        ref = x.T.astype(low)
    np.testing.assert_array_equal(out.numpy().view(np.uint16), ref.view(np.uint16))


def test_rows_to_nchw_transpose_takes_the_register_transpose():
    """``out[0, c, h, w] = rows[h * 11 + w, c]``: pixels merged to 121, 16 x 16 register
    transposes (the last tile of the 121 overlapping)."""
    from tvm import te

    from tvmamp.schedules.cpu.elementwise import CPUElementwise

    rows = te.placeholder((121, 64), "bfloat16", name="rows")
    out = te.compute((1, 64, 11, 11), lambda n, c, h, w: rows[h * 11 + w, c], name="out")
    sch = CPUElementwise().apply(te.create_prim_func([rows, out]), TARGET, False)
    assert '"tvmamp_transpose_16x16_i16"' in sch.mod.script()
    assert "T.vectorized" not in sch.mod.script()
    lib = tvm.compile(sch.mod, target=TARGET)
    x = np.random.default_rng(8).standard_normal((121, 64)).astype(ml_dtypes.bfloat16)
    dev = tvm.cpu()
    y = tvm.runtime.tensor(np.zeros((1, 64, 11, 11), ml_dtypes.bfloat16), dev)
    lib(tvm.runtime.tensor(x, dev), y)
    np.testing.assert_array_equal(y.numpy(), x.T.reshape(1, 64, 11, 11))


def _elementwise_script(mod: tvm.IRModule, target) -> str:
    """The one kernel of ``mod``, legalized and scheduled by the elementwise rule, as text."""
    from tvmamp.schedules.cpu.elementwise import CPUElementwise

    fused = tvm.transform.Sequential(legalize_passes())(mod)
    (func,) = [f for _, f in fused.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    return CPUElementwise().apply(func, target, False).mod.script()


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("widths", [(64, 32, 32, 32), (3, 17, 40), (256, 5)])
@pytest.mark.parametrize("symbolic", [False, True], ids=["7 rows", "symbolic rows"])
def test_concat_on_the_last_axis_is_cut_into_one_loop_per_input(
    widths, dtype, cores, symbolic, rng
):
    """DenseNet's concat of NHWC rows, with its batch-norm and ReLU fused: one partition per
    input (no per-element select), exact against numpy at odd widths. Over symbolic rows (an
    image of any size) too: there it selected per element, 43x slower (DenseNet-121 took 1.7x
    onnxruntime's time with dynamic sizes)."""
    bb = relax.BlockBuilder()
    rows = tvm.tirx.Var("rows", "int64") if symbolic else 7
    xs = [relax.Var(f"x{i}", relax.TensorType((rows, w), dtype)) for i, w in enumerate(widths)]
    scale = relax.Var("scale", relax.TensorType((sum(widths),), "float32"))
    with bb.function("main", [*xs, scale]):
        with bb.dataflow():
            y = bb.emit(relax.op.astype(relax.op.concat(xs, axis=1), "float32"))
            out = bb.emit_output(relax.op.nn.relu(relax.op.multiply(y, scale)))
        bb.emit_func_output(out)
    mod = bb.get()
    target = tvm.target.Target(
        {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": cores}
    )
    script = _elementwise_script(mod, target)
    assert script.count("_partition") == len(widths)
    low = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    arrays = [rng.standard_normal((7, w)).astype(low) for w in widths]
    s = rng.standard_normal(sum(widths)).astype("float32")
    exe = tvmamp.build(mod, "O0", target)
    ref = np.maximum(np.concatenate([a.astype("float32") for a in arrays], 1) * s, 0)
    np.testing.assert_array_equal(exe(*arrays, s), ref)


@pytest.mark.parametrize("cores", [1, 2])
@pytest.mark.parametrize(("channels", "size"), [((300, 300, 300, 300), 4), ((3, 17, 40), 5)])
def test_concat_of_channels_is_cut_into_one_loop_per_input(channels, size, cores, rng):
    """MixNet's mixed depthwise convs, concatenated on the NCHW channels with a sigmoid after:
    one partition of the channel loop per input, each vectorised over its pixels (fused into
    one vector loop, every lane picked its input by selects of gathers: 2.2 ms for 2 x 1200 x
    4 x 4); exact against numpy."""
    bb = relax.BlockBuilder()
    shapes = [(2, c, size, size) for c in channels]
    xs = [relax.Var(f"x{i}", relax.TensorType(shape, "float32")) for i, shape in enumerate(shapes)]
    with bb.function("main", xs):
        with bb.dataflow():
            out = bb.emit_output(relax.op.sigmoid(relax.op.concat(xs, axis=1)))
        bb.emit_func_output(out)
    mod = bb.get()
    target = tvm.target.Target(
        {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": cores}
    )
    script = _elementwise_script(mod, target)
    assert script.count("_partition") == len(channels), script
    arrays = [rng.standard_normal(shape).astype("float32") for shape in shapes]
    exe = tvmamp.build(mod, "O0", target)
    ref = 1 / (1 + np.exp(-np.concatenate(arrays, 1)))
    np.testing.assert_allclose(exe(*arrays), ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("frames", "fused"), [(3199, False), (3200, True)])
def test_a_long_ragged_row_with_a_per_row_operand_is_not_fused_across_rows(frames, fused, rng):
    """wav2vec 2.0's group norm scale and shift over 3199 frames: vectors across rows made the
    per-channel operands gathers (9.8 GB/s). The row is left to LLVM's loop vectoriser, the
    rows in one parallel loop; whole vectors (3200) keep the TVM vector."""
    inputs = {"x": ((1, 256, frames), "float32"), "g": ((256, 1), "float32")}
    mod = _module(inputs, lambda bb, x, g: relax.op.add(relax.op.multiply(x, g), g))
    x, g = _randn(rng, (1, 256, frames)), _randn(rng, (256, 1))
    out, scheduled = _run(mod, x, g)
    np.testing.assert_allclose(out, x * g + g, rtol=1e-6, atol=1e-6)
    (func,) = _prim_funcs(scheduled).values()
    text = func.script()
    assert ("T.vectorized" in text) == fused, text
    assert "T.parallel(T.int64(256))" in text or fused, text


def test_elementwise_over_a_symbolic_batch_is_vectorised():
    """``gelu(x) * y`` under a dynamic batch: vectorised and parallel, not a scalar loop."""
    n = tvm.tirx.Var("n", "int64")
    inputs = {"x": ((n, 7, 48), "float32"), "y": ((n, 7, 48), "float32")}

    def body(bb, x, y):
        return relax.op.multiply(relax.op.nn.gelu(x), y)

    (kernel,) = _prim_funcs(_schedule(_module(inputs, body))).values()
    script = kernel.script()
    assert "T.vectorized" in script and "T.parallel" in script
    rng = np.random.default_rng(5)
    for batch in (1, 4):
        x, y = _randn(rng, (batch, 7, 48)), _randn(rng, (batch, 7, 48))
        out, _ = _run(_module(inputs, body), x, y)
        gelu = 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))
        np.testing.assert_allclose(out, gelu * y, rtol=1e-5, atol=1e-5)


def test_rule_schedules_do_not_print_the_function_into_errors():
    """The rules take a refused primitive as "does not fit". TVM rendered the whole function
    into each ScheduleError: for Mamba's unrolled scan (elementwise kernels of hundreds of
    blocks) the refused inlines took 125 of its 147 s build."""
    from tvm.s_tir.dlight.analysis import get_root_block
    from tvm.s_tir.schedule import ScheduleError

    from tvmamp.schedules.cpu.common import rule_schedule

    inputs = {"x": ((8, 16), "float32")}
    mod = _schedule(_module(inputs, lambda bb, x: relax.op.nn.relu(x)))
    (func,) = _prim_funcs(mod).values()
    sch = rule_schedule(func.with_attr("global_symbol", "main"))
    (block,) = sch.get_child_blocks(get_root_block(sch))
    with pytest.raises(ScheduleError) as raised:
        sch.compute_inline(block)  # the function's output: refused
    assert "T.prim_func" not in str(raised.value) and "IR with diagnostic" not in str(raised.value)


def test_param_buffers_leaves_out_size_vars():
    """In TVM 0.27 ``tirx.Buffer`` is ``tvm.ir.Var``: a symbolic size parameter is no buffer."""
    from tvm import s_tir

    from tvmamp.schedules.cpu.common import param_buffers

    @T.prim_func(private=True, s_tir=True)
    def scale(a: T.handle, b: T.handle, n: T.int64):
        A = T.match_buffer(a, (n, 8), "float32")
        B = T.match_buffer(b, (n, 8), "float32")
        for i, j in T.grid(n, 8):
            with T.sblock("scale"):
                vi, vj = T.axis.remap("SS", [i, j])
                B[vi, vj] = A[vi, vj] * T.float32(2)

    sch = s_tir.Schedule(scale)
    assert [str(b.dtype) for b in param_buffers(sch)] == ["float32", "float32"]


def test_a_symbolic_innermost_axis_keeps_its_loop_nest():
    """A kernel over symbolic sizes ``(batch, heads, seq, 2 * seq - 1)``, as XLNet's relative
    shift. Fused into one loop with a vector of one lane, every index became ``//`` and ``%``
    of symbolic products, and XLNet's kernel took 141 s to build. The nest stays as it is
    (LLVM's loop vectoriser takes the innermost loop), its outermost loop parallel. (XLNet's
    kernel was a reshape, which is now a view: ``relay_passes/symbolic_reshape.py``.)"""
    b, s = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("s", "int64")
    inputs = {"x": ((b, 4, 2 * s - 1, s), "float32")}

    def body(bb, x):
        return relax.op.permute_dims(relax.op.add(x, relax.const(1.0)), [0, 1, 3, 2])

    funcs = _prim_funcs(_schedule(_module(inputs, body)))
    (kernel,) = [func for name, func in funcs.items() if "transpose" in name]
    import tvm_ffi

    loops = []
    tvm_ffi.structural_walk(kernel.body, [(tvm.tirx.For, loops.append)], order="pre")
    extents = [str(loop.extent) for loop in loops]  # the kernel's own size variables
    assert extents == ["b", "T.int64(4)", "s", "s * T.int64(2) - T.int64(1)"], kernel
    assert loops[0].kind == tvm.tirx.ForKind.PARALLEL, kernel
    rng = np.random.default_rng(11)
    for batch, seq in ((2, 5), (1, 9)):
        x = _randn(rng, (batch, 4, 2 * seq - 1, seq))
        out, _ = _run(_module(inputs, body), x)
        np.testing.assert_allclose(out, (x + 1).transpose(0, 1, 3, 2), rtol=1e-6)
