"""slice_axes.LEGALIZE_MAP: a slice along a negative axis of a tensor with a symbolic dim."""

import numpy as np
import tvm
from tvm import relax

import tvmamp
from tvmamp.relay_passes.slice_axes import LEGALIZE_MAP, SlicesIntoReductions


def _sliced(axis: int):
    """``x[:, 1:]`` of ``x: (n, 12)``, the axis written as ``axis``; then ``* 2``."""
    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 12), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.strided_slice(x, [axis], [1], [12]))
            out = bb.emit_output(relax.op.multiply(y, relax.const(2.0, "float32")))
        bb.emit_func_output(out)
    return bb.get()


def test_a_negative_axis_is_legalized_as_its_positive_one():
    """TVM's legalizer sent axis -1 to topi's dynamic_strided_slice_with_axes, which failed
    ("axis < src_tensor_dim (-1 vs. 2)"): torch.export writes ``x[..., 1:]`` and
    ``torch.diff(x, dim=-1)`` so, and decoders imported with a dynamic batch did not build."""
    ours = relax.transform.LegalizeOps(LEGALIZE_MAP)(_sliced(-1))
    tvm.ir.assert_structural_equal(ours, relax.transform.LegalizeOps()(_sliced(1)))


def _summed_slice(begin: int):
    """``x[begin] .sum(-1)`` of ``x: (2, n, 64)``: a decoder's keys or values from its cache."""
    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, n, 64), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.strided_slice(x, [0], [begin], [begin + 1]))
            out = bb.emit_output(relax.op.sum(y, axis=[2]))
        bb.emit_func_output(out)
    return bb.get()


def test_a_slice_from_any_index_fuses_into_the_reduction_that_reads_it(rng):
    """TVM calls a slice from index 0 a broadcast and one from index 1 injective, and fuses only
    the first into a reduction: a decoder's values (``present[1]``) were copied by a kernel of
    their own before the kernel that reads them. Both now fuse, and match numpy. (A slice read
    otherwise keeps its pattern: ``test_slices_to_split.py``'s GRU.)"""
    for begin in (0, 1):
        with tvm.target.Target("llvm"):
            passes = [relax.transform.LegalizeOps(LEGALIZE_MAP)]
            passes += [relax.transform.AnnotateTIROpPattern(), SlicesIntoReductions()]
            passes += [relax.transform.FuseOps()]
            fused = tvm.transform.Sequential(passes)(_summed_slice(begin))
        calls = [b.value for b in fused["main"].body.blocks[0].bindings]
        assert len(calls) == 1, fused["main"]  # one call: the fused slice and sum
        exe = tvmamp.build(_summed_slice(begin), "O0", "llvm -num-cores=1")
        x = rng.standard_normal((2, 37, 64)).astype("float32")
        np.testing.assert_allclose(exe(x), x[begin : begin + 1].sum(-1), rtol=1e-5, atol=1e-5)


def test_built_at_two_batch_sizes(rng):
    exe = tvmamp.build(_sliced(-1), "O0", "llvm -num-cores=1")
    for batch in (2, 5):
        x = rng.standard_normal((batch, 12)).astype("float32")
        np.testing.assert_array_equal(exe(x), x[:, 1:] * 2)


def test_a_slice_scatter_over_a_whole_symbolic_axis_builds(rng):
    """torch.export writes ``y[:, :, 1:] = x[:, :, :-1]`` as a slice_scatter along axis 2 inside
    one across the whole batch (0 to ``n`` by 1), which topi could not build ("Expect value to
    be constant int"): that one is its source."""
    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 4, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            zeros = bb.emit(relax.op.zeros_like(x))
            shifted = bb.emit(relax.op.strided_slice(x, [2], [0], [7]))
            inner = bb.emit(relax.op.slice_scatter(zeros, shifted, 1, 8, 1, axis=2))
            out = bb.emit_output(relax.op.slice_scatter(zeros, inner, 0, n, 1, axis=0))
        bb.emit_func_output(out)
    exe = tvmamp.build(bb.get(), "O0", "llvm -num-cores=1")
    for batch in (2, 3):
        x = rng.standard_normal((batch, 4, 8)).astype("float32")
        want = np.zeros_like(x)
        want[:, :, 1:] = x[:, :, :-1]
        np.testing.assert_array_equal(exe(x), want)
