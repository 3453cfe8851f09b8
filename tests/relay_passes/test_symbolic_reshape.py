"""symbolic_reshape.LEGALIZE_MAP: a symbolic reshape TVM cannot prove a view stays one."""

import numpy as np
import tvm
from tvm import relax

import tvmamp
from tvmamp.pipeline import legalize_passes
from tvmamp.relay_passes.symbolic_reshape import LEGALIZE_MAP


def _reshape_module(in_shape, out_shape, slice_first=False):
    """``reshape(x, out_shape)``; with ``slice_first``, of ``x[:, :, 1:]`` (XLNet's relative
    shift: the slice makes the reshape's input a tensor of the function, not a parameter)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(in_shape, "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = x
            if slice_first:
                y = bb.emit(relax.op.strided_slice(x, [2], [1], [in_shape[2]]))
            out = bb.emit_output(relax.op.reshape(y, out_shape))
        bb.emit_func_output(out)
    return bb.get()


def legalized(mod):
    return tvm.transform.Sequential(legalize_passes())(mod)


def test_relative_shift_reshape_stays_a_view():
    """``(b, 4, 2s - 1, s)`` to ``(b, 4, s, 2s - 1)``: TVM's ``has_reshape_pattern`` cannot
    simplify the flattened indices, and its kernel ran as a copy at 4 ns an element (XLNet
    exported with dynamic axes spent a third of its time there). The reshape is left as it
    is, and lowered to a view."""
    b, s = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("s", "int64")
    mod = _reshape_module((b, 4, 2 * s - 1, s), (b, 4, s, 2 * s - 1))
    tvm.ir.assert_structural_equal(relax.transform.LegalizeOps(LEGALIZE_MAP)(mod), mod)


def test_other_reshapes_are_legalized_as_tvm_does():
    """A static reshape, and a symbolic one whose kernel TVM recognises, become TVM's
    kernels: they may fuse with their neighbours."""
    b = tvm.tirx.Var("b", "int64")
    for in_shape, out_shape in [((2, 6, 8), (2, 48)), ((b, 6, 64), (b, 6, 4, 16))]:
        mod = _reshape_module(in_shape, out_shape)
        ours = relax.transform.LegalizeOps(LEGALIZE_MAP)(mod)
        tvm.ir.assert_structural_equal(ours, relax.transform.LegalizeOps()(mod))
        assert any(isinstance(f, tvm.tirx.PrimFunc) for _, f in ours.functions_items())


def test_built_relative_shift_matches_numpy():
    """Built, with the slice before it (XLNet's pattern), at two sizes: the view holds the
    sliced values, and no reshape kernel is left."""
    b, s = tvm.tirx.Var("b", "int64"), tvm.tirx.Var("s", "int64")
    mod = _reshape_module((b, 4, 2 * s, s), (b, 4, s, 2 * s - 1), slice_first=True)
    kernels = [gvar.name_hint for gvar, _ in legalized(mod).functions_items()]
    assert not [name for name in kernels if "reshape" in name], kernels
    exe = tvmamp.build(mod, "O0", "llvm")
    rng = np.random.default_rng(0)
    for batch, seq in ((2, 5), (1, 16)):
        x = rng.standard_normal((batch, 4, 2 * seq, seq)).astype("float32")
        ref = x[:, :, 1:].reshape(batch, 4, seq, 2 * seq - 1)
        np.testing.assert_array_equal(exe(x), ref)
