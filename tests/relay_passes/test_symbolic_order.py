"""OrderShapeDefinitions: a call that uses a size defined by a ``match_cast`` mid-function
comes after it (TVM's FuseOps hoisted such calls, and the VM failed to build Qwen2-MoE)."""

from __future__ import annotations

import tvm
from tvm import relax, tirx

from tvmamp.relay_passes.symbolic_order import OrderShapeDefinitions


def _module(hoisted: bool):
    """``zeros([e, 4])`` and ``x[:e]`` with ``e`` read from a tensor at run time; ``hoisted``
    puts both above the ``match_cast`` that defines ``e`` (as FuseOps left them)."""
    e = tirx.Var("e", "int64")
    x = relax.Var("x", relax.TensorType([16, 4], "float32"))
    ends = relax.Var("ends", relax.TensorType([1], "int64"))
    shape = relax.Var("shape", relax.ShapeType([e]))
    first = relax.DataflowVar("first", relax.TensorType([e, 4], "float32"))
    pad = relax.DataflowVar("pad", relax.TensorType([e, 4], "float32"))
    out = relax.Var("out", relax.TensorType([e, 4], "float32"))
    cast = relax.MatchCast(shape, relax.op.tensor_to_shape(ends), relax.ShapeType([e]))
    uses = [
        relax.VarBinding(first, relax.op.strided_slice(x, [0], [0], [e], assume_inbound=True)),
        relax.VarBinding(pad, relax.op.zeros(relax.ShapeExpr([e, 4]), "float32")),
    ]
    total = relax.VarBinding(out, relax.op.add(first, pad))
    bindings = [*uses, cast, total] if hoisted else [cast, *uses, total]
    body = relax.SeqExpr([relax.DataflowBlock(bindings)], out)
    func = relax.Function([x, ends], body, relax.TensorType([e, 4], "float32"))
    return tvm.IRModule({"main": func})


def test_moves_calls_below_the_match_cast_of_their_sizes():
    after = OrderShapeDefinitions()(_module(hoisted=True))
    tvm.ir.assert_structural_equal(after, _module(hoisted=False), map_free_vars=True)


def test_leaves_a_valid_order():
    before = _module(hoisted=False)
    tvm.ir.assert_structural_equal(OrderShapeDefinitions()(before), before)
