"""``If`` branches as functions of their own: at O2 an ONNX ``If`` segfaulted the VM, because
TVM's memory planner reused in one branch a storage that only the other allocates."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

import tvmamp
from tvmamp.relay_passes.branches import OutlineBranches


def test_each_branch_becomes_a_call_of_a_private_function():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n", 4), "float32"), c: R.Tensor((), "bool")):
            n = T.int64()
            if c:
                a = R.nn.relu(x)
                r: R.Tensor((n, 4), "float32") = R.exp(a)
            else:
                r: R.Tensor((n, 4), "float32") = R.negative(x)
            return r

    @I.ir_module
    class Expected:
        @R.function(private=True)
        def main_then_branch(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            a = R.nn.relu(x)
            r = R.exp(a)
            return r

        @R.function(private=True)
        def main_else_branch(x: R.Tensor(("n", 4), "float32")) -> R.Tensor(("n", 4), "float32"):
            r = R.negative(x)
            return r

        @R.function
        def main(x: R.Tensor(("n", 4), "float32"), c: R.Tensor((), "bool")):
            n = T.int64()
            cls = Expected
            if c:
                r: R.Tensor((n, 4), "float32") = cls.main_then_branch(x)
            else:
                r: R.Tensor((n, 4), "float32") = cls.main_else_branch(x)
            return r

    tvm.ir.assert_structural_equal(OutlineBranches()(Before), Expected)


def test_a_size_the_branch_computes_with_is_passed_to_it():
    """The branch reads ``y`` alone, but makes a tensor of ``x``'s size ``n``."""
    n = tirx.Var("n", "int64")
    x = relax.Var("x", relax.TensorType([n], "float32"))
    y = relax.Var("y", relax.TensorType([], "float32"))
    c = relax.Var("c", relax.TensorType([], "bool"))
    z, r = (relax.Var(name, relax.TensorType([n], "float32")) for name in "zr")
    bindings = [
        relax.VarBinding(z, relax.op.zeros(relax.ShapeExpr([n]), "float32")),
        relax.VarBinding(r, relax.op.add(z, y)),
    ]
    then = relax.SeqExpr([relax.BindingBlock(bindings)], r)
    bb = relax.BlockBuilder()
    with bb.function("main", [x, y, c]):
        bb.emit_func_output(bb.emit(relax.If(c, then, relax.SeqExpr([], x))))
    mod = bb.get()

    after = OutlineBranches()(mod)
    params = after["main_then_branch"].params
    assert [p.name for p in params] == ["y", "sizes"]
    (size,) = params[1].ty.values  # the callee's own n, defined by its parameter's type
    assert isinstance(size, tirx.Var) and size.name == "n" and not size.same_as(n)
    exe = tvmamp.build(mod, level="O0", target="llvm")
    x, y = np.arange(1, 6, dtype="float32"), np.array(2.5, dtype="float32")
    np.testing.assert_array_equal(exe(x, y, np.array(True)), np.full(5, 2.5, "float32"))
    np.testing.assert_array_equal(exe(x, y, np.array(False)), x)


def _if_model():
    """``If(c, relu(x), -x)`` on ``x[batch, 5]``: at O2 each branch casts to bf16, runs its op
    and casts back, two temporaries the planner placed."""
    from onnx import TensorProto, helper
    from onnx_graphs import onnx_model

    def branch(name, op, out):
        node = helper.make_node(op, ["x"], [out])
        return helper.make_graph([node], name, [], [helper.make_tensor_value_info(out, 1, None)])

    then, other = branch("then", "Relu", "t"), branch("else", "Neg", "e")
    node = helper.make_node("If", ["c"], ["r"], then_branch=then, else_branch=other)
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 5]),
        helper.make_tensor_value_info("c", TensorProto.BOOL, []),
    ]
    out = helper.make_tensor_value_info("r", TensorProto.FLOAT, ["batch", 5])
    return onnx_model([node], inputs, [out])


@pytest.mark.parametrize("level", ["O0", "O2", "O3"])
def test_onnx_if_runs_both_branches_at_every_level(level):
    pytest.importorskip("onnx")
    mod, params = tvmamp.from_onnx(_if_model())
    exe = tvmamp.build(mod, params=params, level=level, target="llvm")
    x = np.random.default_rng(0).standard_normal((3, 5)).astype("float32")
    tol = 1e-6 if level == "O0" else 2e-2  # bf16 at O2/O3: 8 bits of mantissa
    # the else branch first: a storage the then branch left in a register hid the crash
    for cond, ref in ((False, -x), (True, np.maximum(x, 0))):
        np.testing.assert_allclose(exe(x, np.array(cond)), ref, rtol=tol, atol=tol)
