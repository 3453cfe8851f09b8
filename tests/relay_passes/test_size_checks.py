"""Input-size checks: an input too small for a conv or pool over symbolic sizes raises a
ValueError naming the smallest size, where it returned garbage or NaN (Inception-v3 on a
113 x 67 image gave all-NaN logits; torch and onnxruntime refuse such input)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

import tvmamp
from tvmamp.relay_passes.size_checks import ATTR, CollectSizeChecks

torch = pytest.importorskip("torch")


def _conv_pool(h, w, batch=1):
    """``max_pool2d(relu(conv2d(x, k, stride 2)), 3, stride 2)`` on ``x`` of ``(batch, 3, h,
    w)``: both output sizes are ``((s - 3) // 2 - 2) // 2 + 1``, at least 1 from ``s = 7``."""
    x = relax.Var("x", relax.TensorType([batch, 3, h, w], "float32"))
    k = relax.Var("k", relax.TensorType([8, 3, 3, 3], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, k]):
        with bb.dataflow():
            y = bb.emit(relax.op.nn.relu(relax.op.nn.conv2d(x, k, strides=2)))
            out = bb.emit_output(relax.op.nn.max_pool2d(y, 3, strides=2))
        bb.emit_func_output(out)
    return bb.get()


def _reference(x, k):
    y = torch.relu(torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(k), stride=2))
    return torch.nn.functional.max_pool2d(y, 3, stride=2).numpy()


def _random(*shape):
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype("float32")


def test_one_bound_for_each_size_at_its_smallest_value():
    h, w = tirx.Var("h", "int64"), tirx.Var("w", "int64")
    after = CollectSizeChecks()(_conv_pool(h, w, batch=tirx.Var("n", "int64")))
    (condition, message), *rest = after["main"].attrs[ATTR]
    assert not rest
    tvm.ir.assert_structural_equal(condition, tirx.And(h >= 7, w >= 7))
    assert "x.shape[2] (height) at least 7 and x.shape[3] (width) at least 7" in str(message)
    assert "max_pool2d (window 3x3, strides 2x2)" in str(message)


def test_the_op_size_counts_not_a_cast_of_it():
    """The importer unifies a skip connection's sizes with a ``match_cast`` of the pool (DLA):
    the pool's own size ``h // 2`` needs ``h >= 2``, the cast's ``(h - 1) // 2 + 1`` nothing;
    the cast itself needs even sizes."""
    h, w = tirx.Var("h", "int64"), tirx.Var("w", "int64")
    x = relax.Var("x", relax.TensorType([1, 3, h, w], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            pooled = relax.op.nn.max_pool2d(x, 2, strides=2)
            cast = relax.TensorType([1, 3, (h - 1) // 2 + 1, (w - 1) // 2 + 1], "float32")
            out = bb.emit_output(bb.match_cast(pooled, cast))
        bb.emit_func_output(out)
    (condition, _), (_, agreement) = CollectSizeChecks()(bb.get())["main"].attrs[ATTR]
    tvm.ir.assert_structural_equal(condition, tirx.And(h >= 2, w >= 2))
    assert "x.shape[2] (height) must be a multiple of 2 and x.shape[3]" in str(agreement)


def test_static_sizes_need_no_check():
    before = _conv_pool(32, 32)
    tvm.ir.assert_structural_equal(CollectSizeChecks()(before), before)


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_too_small_an_input_raises_and_a_large_enough_one_runs(level):
    exe = tvmamp.build(_conv_pool(tirx.Var("h", "int64"), tirx.Var("w", "int64")), level=level)
    k = _random(8, 3, 3, 3)
    for shape in [(1, 3, 7, 7), (1, 3, 7, 16), (1, 3, 40, 23)]:
        x = _random(*shape)
        np.testing.assert_allclose(exe(x, k), _reference(x, k), rtol=3e-2, atol=3e-2)
    for shape in [(1, 3, 6, 7), (1, 3, 7, 6), (1, 3, 4, 4)]:
        with pytest.raises(ValueError, match=r"x.shape\[2\] \(height\) at least 7 and"):
            exe(_random(*shape), k)


def test_a_size_of_two_inputs_keeps_its_own_condition():
    """A conv over the concatenation of two inputs' heights: ``h + w - 2`` is not one input's
    size, so its condition stays as it is."""
    h, w = tirx.Var("h", "int64"), tirx.Var("w", "int64")
    x = relax.Var("x", relax.TensorType([1, 2, h, 4], "float32"))
    y = relax.Var("y", relax.TensorType([1, 2, w, 4], "float32"))
    k = relax.Var("k", relax.TensorType([4, 2, 3, 3], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y, k]):
        with bb.dataflow():
            both = bb.emit(relax.op.concat([x, y], axis=2))
            out = bb.emit_output(relax.op.nn.conv2d(both, k))
        bb.emit_func_output(out)
    exe = tvmamp.build(bb.get(), level="O0")
    kernel = _random(4, 2, 3, 3)
    a, b = _random(1, 2, 2, 4), _random(1, 2, 1, 4)
    ref = torch.nn.functional.conv2d(
        torch.cat([torch.from_numpy(a), torch.from_numpy(b)], 2), torch.from_numpy(kernel)
    ).numpy()
    np.testing.assert_allclose(exe(a, b, kernel), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="conv2d .* its output size .* must be >= 1"):
        exe(_random(1, 2, 1, 4), b, kernel)


def test_an_exported_library_checks_its_input_too(tmp_path):
    exe = tvmamp.build(_conv_pool(tirx.Var("h", "int64"), tirx.Var("w", "int64")), level="O2")
    lib = tvm.runtime.load_module(exe.export_library(str(tmp_path / "model.so")))
    vm = relax.VirtualMachine(lib, tvm.cpu())
    k = tvm.runtime.tensor(_random(8, 3, 3, 3))
    x = _random(1, 3, 9, 7)
    np.testing.assert_allclose(
        vm["main"](tvm.runtime.tensor(x), k).numpy(), _reference(x, k.numpy()), rtol=3e-2, atol=3e-2
    )
    with pytest.raises(ValueError, match="too small for this model"):
        vm["main"](tvm.runtime.tensor(_random(1, 3, 9, 6)), k)


def test_the_sizes_that_fit_are_named_by_their_residues():
    # DLA-34 joins branches of (h - 1) // 32 + 1 and h // 32 rows (and the like): only heights
    # of 0 or 31 modulo 32 fit.
    from tvmamp.relay_passes.size_checks import _fitting

    h = tirx.Var("h", "int64")
    assert _fitting(tirx.Or(h % 32 == 0, h % 32 == 31), h) == (32, [0, 31])
    assert _fitting((h - 1) // 2 + 1 == h // 2, h) == (2, [0])
    assert _fitting(h * h == 144, h) is None  # one size fits: named as the equality


def test_the_axes_are_named_by_the_layout_of_the_op():
    """An NHWC input: the height is ``x.shape[1]``, which the message names as such (a name
    from the input's rank alone called ``x.shape[2]`` the height)."""
    h, w = tirx.Var("h", "int64"), tirx.Var("w", "int64")
    x = relax.Var("x", relax.TensorType([1, h, w, 3], "float32"))
    k = relax.Var("k", relax.TensorType([5, 3, 3, 8], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x, k]):
        with bb.dataflow():
            conv = relax.op.nn.conv2d(x, k, strides=2, data_layout="NHWC", kernel_layout="HWIO")
            out = bb.emit_output(conv)
        bb.emit_func_output(out)
    ((condition, message),) = CollectSizeChecks()(bb.get())["main"].attrs[ATTR]
    tvm.ir.assert_structural_equal(condition, tirx.And(h >= 5, w >= 3))
    assert "x.shape[1] (height) at least 5 and x.shape[2] (width) at least 3" in str(message)
    assert "conv2d (kernel 5x3, strides 2x2)" in str(message)


def test_a_reshape_into_sizes_an_export_fixed_names_both_shapes():
    """MobileViT's unfolding into patches, exported at 224 px: a reshape of ``(1, 4, h // 2,
    w // 2)`` into ``(1, 4, 3, 2, 3, 2)`` fits one size only. TVM's view check said
    "relative_byte_offset + view_size <= curr_size" at another."""
    h, w = tirx.Var("h", "int64"), tirx.Var("w", "int64")
    x = relax.Var("x", relax.TensorType([1, 4, h, w], "float32"))
    bb = relax.BlockBuilder()
    with bb.function("main", [x]):
        with bb.dataflow():
            pooled = bb.emit(relax.op.nn.max_pool2d(x, 2, strides=2))
            out = bb.emit_output(relax.op.reshape(pooled, [1, 4, 3, 2, 3, 2]))
        bb.emit_func_output(out)
    exe = tvmamp.build(bb.get(), level="O0")
    x = _random(1, 4, 12, 13)
    expected = _reference_pool(x).reshape(1, 4, 3, 2, 3, 2)
    np.testing.assert_allclose(exe(x), expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match=r"a reshape of \(1, 4, h // 2, w // 2\) into"):
        exe(_random(1, 4, 14, 12))


def _reference_pool(x):
    return torch.nn.functional.max_pool2d(torch.from_numpy(x), 2, stride=2).numpy()
