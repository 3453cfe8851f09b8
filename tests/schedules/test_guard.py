"""schedules/guard.py: a rule that fails, or returns ill-formed TIR, falls through to the next."""

import logging

import tvm
from tvm import relax
from tvm.script import relax as R

from tvmamp.relay_passes.fast_math import FastMath
from tvmamp.schedules.cpu.reduction import CPURowReduction
from tvmamp.schedules.guard import Guarded

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "znver4"})


def _fused(mod, name_part):
    with TARGET:
        passes = [FastMath(), relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern()]
        passes += [relax.transform.FuseOps(), relax.transform.FuseTIR()]
        mod = tvm.transform.Sequential(passes)(mod)
    (func,) = [f for gv, f in mod.functions_items() if name_part in gv.name_hint]
    return func


def test_an_ill_formed_schedule_falls_through_with_a_warning(caplog):
    """CPURowReduction takes a conv1d + GELU kernel for a row reduction (10 taps per output)
    and moves a block before its producer; the guard must drop that schedule."""

    @tvm.script.ir_module
    class Conv1dGelu:
        @R.function
        def main(
            x: R.Tensor((1, 1, 400), "float32"),
            w: R.Tensor((8, 1, 10), "float32"),
            b: R.Tensor((1, 8, 1), "float32"),
        ):
            with R.dataflow():
                z = R.nn.gelu(R.add(R.nn.conv1d(x, w, strides=[5]), b))
                R.output(z)
            return z

    func = _fused(Conv1dGelu, "conv1d")
    assert CPURowReduction().apply(func, TARGET, False) is not None  # the rule does apply
    with caplog.at_level(logging.INFO, logger="tvmamp.schedules"):
        assert Guarded(CPURowReduction()).apply(func, TARGET, False) is None
    assert "not well-formed TIR" in caplog.text and "please report" in caplog.text


class _Raises(CPURowReduction):
    def apply(self, func, target, tunable):
        raise IndexError("list index out of range")


def test_any_exception_of_a_rule_falls_through(caplog):
    @tvm.script.ir_module
    class Add:
        @R.function
        def main(x: R.Tensor((4, 16), "float32")):
            with R.dataflow():
                y = R.add(x, x)
                R.output(y)
            return y

    with caplog.at_level(logging.WARNING, logger="tvmamp.schedules"):
        assert Guarded(_Raises()).apply(_fused(Add, "add"), TARGET, False) is None
    assert "_Raises did not apply" in caplog.text and "IndexError" in caplog.text
