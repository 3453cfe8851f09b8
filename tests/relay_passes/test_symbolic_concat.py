"""symbolic_concat.LEGALIZE_MAP: a concatenation over symbolic sizes stays fusable."""

import ml_dtypes
import numpy as np
import tvm
from tvm import relax

import tvmamp
from tvmamp.pipeline import legalize_passes
from tvmamp.relay_passes.fused_functions import INJECTIVE
from tvmamp.relay_passes.symbolic_concat import LEGALIZE_MAP


def _cache_module(past_len, new_len):
    """A key-value cache at O2: ``concat([past.astype(bf16), new], axis=2)``."""
    bb = relax.BlockBuilder()
    past = relax.Var("past", relax.TensorType((2, 4, past_len, 8), "float32"))
    new = relax.Var("new", relax.TensorType((2, 4, new_len, 8), "bfloat16"))
    with bb.function("main", [past, new]):
        with bb.dataflow():
            low = bb.emit(relax.op.astype(past, "bfloat16"))
            out = bb.emit_output(relax.op.concat([low, new], axis=2))
        bb.emit_func_output(out)
    return bb.get()


def _calls(mod) -> list:
    return [
        b.value
        for block in mod["main"].body.blocks
        for b in block.bindings
        if isinstance(b.value, relax.Call)
    ]


def _patterns(mod) -> list:
    legalized = relax.transform.LegalizeOps(LEGALIZE_MAP)(mod)
    funcs = [f for _, f in legalized.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    concat = [f for f in funcs if "T_concat" in f.script()]
    return [f.attrs.get("op_pattern") for f in concat]


def test_a_symbolic_concatenation_is_injective():
    """Over a symbolic cache length the kernel is marked injective (``AnnotateTIROpPattern``
    called it opaque); a static one keeps TVM's own annotation."""
    past = tvm.tirx.Var("past", "int64")
    assert _patterns(_cache_module(past, 1)) == [INJECTIVE]
    assert _patterns(_cache_module(5, 1)) == [None]  # for AnnotateTIROpPattern


def test_the_rounding_of_the_cache_fuses_into_the_concatenation(rng):
    """One kernel rounds the cached values and concatenates (a decoder step ran the rounding
    as a kernel of its own over the whole cache); exact against numpy at several lengths."""
    past, new = tvm.tirx.Var("past", "int64"), tvm.tirx.Var("new", "int64")
    mod = _cache_module(past, new)
    fused = tvm.transform.Sequential(legalize_passes())(mod)
    assert len(_calls(fused)) == 1
    exe = tvmamp.build(mod, level="O0", target="llvm")
    for past_len, new_len in [(0, 1), (3, 1), (17, 2)]:
        a = rng.standard_normal((2, 4, past_len, 8)).astype("float32")
        b = rng.standard_normal((2, 4, new_len, 8)).astype(ml_dtypes.bfloat16)
        out = np.asarray(exe(a, b))
        expected = np.concatenate([a.astype(ml_dtypes.bfloat16), b], axis=2)
        np.testing.assert_array_equal(out.view("uint16"), expected.view("uint16"))
