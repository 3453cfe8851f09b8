"""SizeParamsAsShapes: a fused function's scalar size parameters become ``R.Shape`` ones.

TVM's FuseTIR (through RemoveUnusedParameters) defined such a size twice and failed with
"VarRemapGet(source) == nullptr": BigBird, SqueezeBERT and I-BERT exported to ONNX with a
symbolic batch and sequence could not be built.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvmamp
from tvmamp.relay_passes.size_params import SizeParamsAsShapes


@I.ir_module
class Before:
    @R.function(private=True)
    def fused(s: T.int64, tir_vars: R.Shape(["b"])) -> R.Tensor(("b",), "int64"):
        R.func_attr({"Primitive": True})
        b = T.int64()
        with R.dataflow():
            y = R.broadcast_to(R.shape_to_tensor(R.shape([s])), R.shape([b]))
            R.output(y)
        return y

    @R.function
    def main(x: R.Tensor(("b", "s"), "float32")) -> R.Tensor(("b",), "int64"):
        b, s = T.int64(), T.int64()
        cls = Before
        with R.dataflow():
            y = cls.fused(s, R.shape([b]))
            R.output(y)
        return y


@I.ir_module
class Expected:
    @R.function(private=True)
    def fused(size_s: R.Shape(["s"]), tir_vars: R.Shape(["b"])) -> R.Tensor(("b",), "int64"):
        R.func_attr({"Primitive": True})
        b, s = T.int64(), T.int64()
        with R.dataflow():
            y = R.broadcast_to(R.shape_to_tensor(R.shape([s])), R.shape([b]))
            R.output(y)
        return y

    @R.function
    def main(x: R.Tensor(("b", "s"), "float32")) -> R.Tensor(("b",), "int64"):
        b, s = T.int64(), T.int64()
        cls = Expected
        with R.dataflow():
            y = cls.fused(R.shape([s]), R.shape([b]))
            R.output(y)
        return y


def test_scalar_size_parameter_becomes_a_shape():
    tvm.ir.assert_structural_equal(SizeParamsAsShapes()(Before), Expected)


def test_module_without_scalar_parameters_is_unchanged():
    tvm.ir.assert_structural_equal(SizeParamsAsShapes()(Expected), Expected)


@I.ir_module
class Positions:
    """One kernel group with no tensor input reads both sizes: ``arange(b) + b * s``. FuseOps
    passes ``s`` as a scalar parameter and ``b`` in a shape, and FuseTIR failed on it."""

    @R.function
    def main(x: R.Tensor(("b", "s"), "float32")) -> R.Tensor(("b",), "int64"):
        b, s = T.int64(), T.int64()
        with R.dataflow():
            n = R.shape_to_tensor(R.shape([b * s, 1]))
            first = R.squeeze(R.strided_slice(n, axes=[0], begin=[0], end=[1]), axis=[0])
            rows = R.arange(R.prim_value(0), R.prim_value(b), R.prim_value(1), dtype="int64")
            y = R.add(rows, first)
            R.output(y)
        return y


def test_kernel_reading_sizes_as_values_builds_and_runs(rng):
    exe = tvmamp.build(Positions, "O0", "llvm -num-cores=1")
    for rows, cols in ((3, 5), (7, 2)):
        x = rng.standard_normal((rows, cols)).astype("float32")
        np.testing.assert_array_equal(exe(x), np.arange(rows) + rows * cols)


def test_caller_passing_an_expression_keeps_the_scalar_parameter():
    """FuseTIR takes only bare variables in a shape argument; an expression stays a scalar."""
    call = Before["main"].body.blocks[0].bindings[0].value
    b = Before["main"].params[0].ty.shape[0]
    with_expr = relax.Call(call.op, [b * 2, call.args[1]], call.attrs, call.ty_args)
    main = Before["main"]
    binding = main.body.blocks[0].bindings[0]
    block = relax.DataflowBlock([relax.VarBinding(binding.var, with_expr)])
    body = relax.SeqExpr([block], main.body.body)
    mod = tvm.IRModule(dict(Before.functions_items()))
    mod["main"] = relax.Function(main.params, body, main.ret_ty, main.is_pure, main.attrs)
    tvm.ir.assert_structural_equal(SizeParamsAsShapes()(mod), mod)
