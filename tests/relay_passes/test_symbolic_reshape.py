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


def test_a_transpose_the_reshape_analysis_cannot_read_builds(rng):
    """onnxruntime's GPT-2 decoder transposes its keys over ``past + seq`` with a symbolic past
    and a static seq. TVM's ``has_reshape_pattern`` raised on that transpose (``CanProveDivisible``)
    inside ``RewriteDataflowReshape``, and the build stopped. The kernel is passed over; the
    reshape beside it still becomes a view."""
    past = tvm.tirx.Var("past", "int64")
    bb = relax.BlockBuilder()
    cache = relax.Var("cache", relax.TensorType((2, past, 4, 16), "float32"))
    new = relax.Var("new", relax.TensorType((2, 4, 4, 16), "float32"))
    with bb.function("main", [cache, new]):
        with bb.dataflow():
            keys = bb.emit(relax.op.concat([cache, new], axis=1))
            transposed = bb.emit(relax.op.permute_dims(keys, [0, 2, 3, 1]))
            flat = bb.emit(relax.op.reshape(keys, [2, past + 4, 64]))
            out = bb.emit_output(relax.Tuple([transposed, flat]))
        bb.emit_func_output(out)
    exe = tvmamp.build(bb.get(), "O0", "llvm -num-cores=1")
    assert "vm.builtin.reshape" in exe.vm_exec.as_text()
    for n in (5, 0):
        a = rng.standard_normal((2, n, 4, 16)).astype("float32")
        b = rng.standard_normal((2, 4, 4, 16)).astype("float32")
        transposed, flat = exe(a, b)
        keys = np.concatenate([a, b], 1)
        np.testing.assert_array_equal(np.asarray(transposed), keys.transpose(0, 2, 3, 1))
        np.testing.assert_array_equal(np.asarray(flat), keys.reshape(2, n + 4, 64))


def test_a_reshape_to_its_own_shape_is_its_input():
    """``present = Reshape(concat(past, new))`` to the shape it has: TVM made it a copy kernel
    (the result leaves the dataflow block, so ``RewriteDataflowReshape`` leaves it), which
    copied a decoder's whole cache on every step. Now the input itself is the result; a
    reshape to the same sizes written otherwise (``p + s`` against ``s + p``) stays a reshape
    (FuseTIR mapped one size to the other in a fused kernel behind such an input)."""
    p = tvm.tirx.Var("p", "int64")
    bb = relax.BlockBuilder()
    past = relax.Var("past", relax.TensorType((2, 1, p, 8), "float32"))
    new = relax.Var("new", relax.TensorType((2, 1, 1, 8), "float32"))
    with bb.function("main", [past, new]):
        with bb.dataflow():
            cache = bb.emit(relax.op.concat([past, new], axis=2))
            present = bb.emit_output(relax.op.reshape(cache, (2, 1, p + 1, 8)))
        bb.emit_func_output(present)
    ours = relax.transform.LegalizeOps(LEGALIZE_MAP)(bb.get())
    kernels = [gvar.name_hint for gvar, f in ours.functions_items() if "reshape" in gvar.name_hint]
    assert not kernels, kernels
    s = tvm.tirx.Var("s", "int64")
    mod = _reshape_module((2, p + s), (2, s + p))
    (binding,) = relax.transform.LegalizeOps(LEGALIZE_MAP)(mod)["main"].body.blocks[0].bindings
    assert isinstance(binding.value, relax.Call)
    exe = tvmamp.build(bb.get(), "O0", "llvm")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 1, 5, 8)).astype("float32")
    y = rng.standard_normal((2, 1, 1, 8)).astype("float32")
    np.testing.assert_array_equal(exe(x, y), np.concatenate([x, y], axis=2))
