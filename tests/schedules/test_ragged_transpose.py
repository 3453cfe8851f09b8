"""Transposing copies of ragged extents by 16 x 16 register transposes.

``schedules/cpu/common.py`` (``_tensorize_strided``) with ``transpose_intrin.strided_copy``:
a pure copy or fp32 -> bf16 cast whose two transposed extents are at least 16 but not
multiples of 16 (196 or 49 pixels), or with a group axis between them (``[196, 3, 160]``
read from ``[480, 196]``), copies its whole loop nest in 16 x 16 register transposes, the
last tile of a ragged extent overlapping the one before it. Exact against numpy; bf16 rounded
to nearest even.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from copies import TRANSPOSE_CALL, bits, numpy_dtype, target
from forced_cpus import forced, runs_here
from tvm import relax, s_tir, te

from tvmamp.pipeline import legalize_passes
from tvmamp.schedules.cpu import cpu_schedule_passes
from tvmamp.schedules.cpu import transpose_intrin as transpose
from tvmamp.schedules.cpu.elementwise import CPUElementwise


def schedule(tensors: list[te.Tensor], cores: int = 2) -> s_tir.Schedule:
    sch = CPUElementwise().apply(te.create_prim_func(tensors), target(cores), False)
    assert sch is not None
    return sch


def run(sch: s_tir.Schedule, x: np.ndarray, shape, dtype: str, cores: int = 2) -> np.ndarray:
    lib = tvm.compile(sch.mod, target=target(cores))
    out = tvm.runtime.tensor(np.zeros(shape, numpy_dtype(dtype)))
    lib(tvm.runtime.tensor(x), out)
    return out.numpy()


def uses_register_transpose(sch: s_tir.Schedule) -> bool:
    """Whether the kernel calls the 16 x 16 transpose and vectorises nothing itself."""
    script = sch.mod.script()
    return TRANSPOSE_CALL in script and "T.vectorized" not in script


def random_input(rng, shape, dtype: str) -> np.ndarray:
    return (rng.standard_normal(shape) * 10).astype(numpy_dtype(dtype))


def to_dtype(x: np.ndarray, dtype: str) -> np.ndarray:
    """numpy's conversion: bf16 rounded to nearest even (``ml_dtypes``)."""
    return x.astype(numpy_dtype(dtype))


# (source dtype, destination dtype): a bare copy of 32- and 16-bit elements, the fp32 -> bf16
# cast rounded in registers.
COPIES = [("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16")]


@pytest.mark.parametrize(("src", "dst"), COPIES)
@pytest.mark.parametrize(("rows", "cols"), [(17, 31), (31, 17), (49, 48), (196, 512), (40, 200)])
def test_2d_transposes_of_ragged_extents(src, dst, rows, cols, rng):
    a = te.placeholder((rows, cols), src, name="a")
    b = te.compute((cols, rows), lambda i, j: a[j, i].astype(dst), name="b")
    sch = schedule([a, b])
    assert uses_register_transpose(sch)
    x = random_input(rng, (rows, cols), src)
    out = run(sch, x, (cols, rows), dst)
    np.testing.assert_array_equal(bits(out), bits(to_dtype(x.T, dst)))


@pytest.mark.parametrize(("src", "dst"), COPIES)
@pytest.mark.parametrize(("channels", "height", "width"), [(512, 14, 14), (48, 7, 7), (20, 5, 4)])
def test_nchw_planes_to_pixel_rows(src, dst, channels, height, width, rng):
    """``out[p, c] = x[0, c, p // w, p % w]``: the input staging of an O2 conv."""
    x_t = te.placeholder((1, channels, height, width), src, name="x")
    out_t = te.compute(
        (height * width, channels),
        lambda p, c: x_t[0, c, p // width, p % width].astype(dst),
        name="rows",
    )
    sch = schedule([x_t, out_t])
    assert uses_register_transpose(sch)
    x = random_input(rng, (1, channels, height, width), src)
    out = run(sch, x, (height * width, channels), dst)
    ref = to_dtype(x.reshape(channels, height * width).T, dst)
    np.testing.assert_array_equal(bits(out), bits(ref))


@pytest.mark.parametrize(("src", "dst"), COPIES)
@pytest.mark.parametrize(("groups", "per_group"), [(3, 160), (3, 40)])
def test_grouped_rows_from_planes(src, dst, groups, per_group, rng):
    """ShuffleNet's grouped 1x1 input: ``[196, 3, 160]`` from ``[1, 480, 14, 14]``, the group
    axis between the transposed ones (and 40 channels a group: 120 is ragged too)."""
    channels = groups * per_group
    x_t = te.placeholder((1, channels, 14, 14), src, name="x")
    out_t = te.compute(
        (196, groups, per_group),
        lambda p, g, c: x_t[0, g * per_group + c, p // 14, p % 14].astype(dst),
        name="rows",
    )
    sch = schedule([x_t, out_t])
    assert uses_register_transpose(sch)
    x = random_input(rng, (1, channels, 14, 14), src)
    out = run(sch, x, (196, groups, per_group), dst)
    ref = to_dtype(x.reshape(channels, 196).T.reshape(196, groups, per_group), dst)
    np.testing.assert_array_equal(bits(out), bits(ref))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("pixels", "shape", "channel"),
    [
        (49, (49, 32, 16), lambda c: (c // 16, c % 16)),  # ResNeXt's grouped conv output
        (196, (196, 3, 40), lambda c: (c // 40, c % 40)),  # ShuffleNet's: 120 channels
    ],
)
def test_grouped_rows_back_to_planes(dtype, pixels, shape, channel, rng):
    """``out[0, c, h, w] = rows[h * W + w, c // k, c % k]``: the output of an O2 conv."""
    side = int(round(pixels**0.5))
    channels = shape[1] * shape[2]
    rows_t = te.placeholder(shape, dtype, name="rows")
    out_t = te.compute(
        (1, channels, side, side),
        lambda n, c, h, w: rows_t[(h * side + w, *channel(c))],
        name="out",
    )
    sch = schedule([rows_t, out_t])
    assert uses_register_transpose(sch)
    x = random_input(rng, shape, dtype)
    out = run(sch, x, (1, channels, side, side), dtype)
    np.testing.assert_array_equal(bits(out), bits(x.reshape(pixels, channels).T.reshape(out.shape)))


def test_batched_transpose_keeps_the_batch_outside(rng):
    """``[3, 17, 33] -> [3, 33, 17]``: the batch is an outer axis of the tiles."""
    a = te.placeholder((3, 17, 33), "bfloat16", name="a")
    b = te.compute((3, 33, 17), lambda n, i, j: a[n, j, i], name="b")
    sch = schedule([a, b])
    assert uses_register_transpose(sch)
    x = random_input(rng, (3, 17, 33), "bfloat16")
    np.testing.assert_array_equal(run(sch, x, (3, 33, 17), "bfloat16"), x.transpose(0, 2, 1))


def test_the_cast_rounds_to_nearest_even_like_numpy(rng):
    """Ties both ways, the largest finite value, a subnormal, infinities, NaN and -0.0."""
    a = te.placeholder((37, 45), "float32", name="a")
    b = te.compute((45, 37), lambda i, j: a[j, i].astype("bfloat16"), name="b")
    sch = schedule([a, b])
    assert uses_register_transpose(sch)
    x = rng.standard_normal((37, 45)).astype("float32")
    special = np.array([0x3F808000, 0x3F818000, 0x7F7FFFFF, 0x80000001, 0x00012345], "uint32")
    x.reshape(-1)[:5] = special.view("float32")
    x.reshape(-1)[-4:] = [np.inf, -np.inf, np.nan, -0.0]
    out = run(sch, x, (45, 37), "bfloat16")
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(bits(out), bits(x.T.astype(ml_dtypes.bfloat16)))


@pytest.mark.parametrize("cores", [1, 2])
def test_parallel_when_large_and_cores(cores, rng):
    """The tiles' outer loop runs in parallel on 2 cores for 100352 elements; the copy is exact
    either way."""
    x_t = te.placeholder((1, 512, 14, 14), "float32", name="x")
    out_t = te.compute(
        (196, 512), lambda p, c: x_t[0, c, p // 14, p % 14].astype("bfloat16"), name="rows"
    )
    sch = schedule([x_t, out_t], cores)
    assert uses_register_transpose(sch)
    assert ("T.parallel" in sch.mod.script()) == (cores > 1)
    x = random_input(rng, (1, 512, 14, 14), "float32")
    out = run(sch, x, (196, 512), "bfloat16", cores)
    np.testing.assert_array_equal(bits(out), bits(to_dtype(x.reshape(512, 196).T, "bfloat16")))


@pytest.mark.parametrize(
    "body",
    [
        lambda a: lambda i, j: a[j, i] * 2.0,  # arithmetic
        lambda a: lambda i, j: a[j, i] + a[j, 0],  # two loads
        lambda a: lambda i, j: a[j, i].astype("float16"),  # a cast other than fp32 -> bf16
        lambda a: lambda i, j: a[i, j],  # no transpose
    ],
)
def test_only_pure_transposing_copies_take_overlapping_tiles(body, rng):
    """Overlapping tiles write some elements twice: never for anything but a pure copy."""
    a = te.placeholder((40, 40), "float32", name="a")
    b = te.compute((40, 40), body(a), name="b")
    unscheduled = s_tir.Schedule(te.create_prim_func([a, b]))
    assert transpose.strided_copy(unscheduled.get(unscheduled.get_sblock("b"))) is None
    sch = schedule([a, b])
    assert TRANSPOSE_CALL not in sch.mod.script()
    x = random_input(rng, (40, 40), "float32")
    out = run(sch, x, (40, 40), str(b.dtype))
    ref = tvm.compile(te.create_prim_func([a, b]), target=target(2))
    expected = tvm.runtime.tensor(np.zeros((40, 40), numpy_dtype(str(b.dtype))))
    ref(tvm.runtime.tensor(x), expected)
    np.testing.assert_array_equal(bits(out), bits(expected.numpy()))


@pytest.mark.parametrize(("rows", "cols", "dtype"), [(9, 40, "float32"), (40, 40, "int8")])
def test_short_extents_and_bytes_keep_the_vector_copy(rows, cols, dtype, rng):
    a = te.placeholder((rows, cols), dtype, name="a")
    b = te.compute((cols, rows), lambda i, j: a[j, i], name="b")
    sch = schedule([a, b])
    assert TRANSPOSE_CALL not in sch.mod.script()
    x = (rng.standard_normal((rows, cols)) * 50).astype(dtype)
    np.testing.assert_array_equal(run(sch, x, (cols, rows), dtype), x.T)


def test_relax_grouped_staging_copies(rng):
    """The copies of an O2 grouped 1x1 conv in a Relax module: NCHW fp32 -> bf16 rows
    ``[196, 3, 160]`` and bf16 rows ``[196, 3, 40]`` -> NCHW, legalized, fused and scheduled
    by the CPU rules, run by the VM."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 480, 14, 14), "float32"))
    r = relax.Var("r", relax.TensorType((196, 3, 40), "bfloat16"))
    with bb.function("main", [x, r]):
        with bb.dataflow():
            nhwc = relax.op.permute_dims(relax.op.astype(x, "bfloat16"), [0, 2, 3, 1])
            rows = bb.emit(relax.op.reshape(nhwc, (196, 3, 160)))
            planes = relax.op.permute_dims(relax.op.reshape(r, (1, 14, 14, 120)), [0, 3, 1, 2])
            planes = bb.emit(planes)
            out = bb.emit_output(relax.Tuple([rows, planes]))
        bb.emit_func_output(out)
    tgt = target(2)
    with tgt:
        passes = [*legalize_passes(), *cpu_schedule_passes(tgt)]
        scheduled = tvm.transform.Sequential(passes)(bb.get())
    kernels = [f for _, f in scheduled.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(kernels) == 2
    assert all(TRANSPOSE_CALL in f.script() for f in kernels)
    vm = relax.VirtualMachine(tvm.compile(scheduled, target=tgt), tvm.cpu())
    data = rng.standard_normal((1, 480, 14, 14)).astype("float32")
    back = random_input(rng, (196, 3, 40), "bfloat16")
    rows_out, planes_out = vm["main"](tvm.runtime.tensor(data), tvm.runtime.tensor(back))
    expected_rows = data.reshape(480, 196).T.reshape(196, 3, 160).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bits(rows_out.numpy()), bits(expected_rows))
    expected_planes = back.reshape(196, 120).T.reshape(1, 120, 14, 14)
    np.testing.assert_array_equal(bits(planes_out.numpy()), bits(expected_planes))


@pytest.mark.parametrize("kind", ["sapphirerapids", "znver4", "x86-64-v3"])
def test_forced_cpu_kinds(kind, rng):
    """The register transposes on each CPU kind: LLVM IR, so every kind takes them (AVX-512
    kinds, AMX Intel and AMD, shuffle with vpermt2; AVX2 splits the 512-bit rows). Built for
    every kind, bitwise against numpy where the host can run the kind."""
    from tvmamp.targets.cpu_features import cpu_level_features

    target = tvm.target.Target(forced(kind, 2))
    a = te.placeholder((196, 48), "float32", name="a")
    b = te.compute((48, 196), lambda i, j: a[j, i].astype("bfloat16"), name="b")
    sch = CPUElementwise().apply(te.create_prim_func([a, b]), target, False)
    assert TRANSPOSE_CALL in sch.mod.script()
    lib = tvm.compile(sch.mod, target=target)
    avx512 = "avx512f" in cpu_level_features(kind)
    assert ("vpermt2" in lib.mod.inspect_source("asm")) is avx512
    if not runs_here(target):
        pytest.skip(f"built for {kind}; the host CPU cannot run it")
    x = random_input(rng, (196, 48), "float32")
    out = tvm.runtime.tensor(np.zeros((48, 196), ml_dtypes.bfloat16))
    lib(tvm.runtime.tensor(x), out)
    np.testing.assert_array_equal(bits(out.numpy()), bits(to_dtype(x.T, "bfloat16")))
