"""schedules/guard.py: a rule that fails, or returns ill-formed TIR, falls through to the next."""

import logging

import tvm
from tvm import relax, s_tir
from tvm.script import relax as R
from tvm.script import tirx as T

from tvmamp.relay_passes.fast_math import FastMath
from tvmamp.schedules.cpu.reduction import CPURowReduction
from tvmamp.schedules.guard import Guarded

TARGET = tvm.target.Target({"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"]})


def _fused(mod, name_part):
    with TARGET:
        passes = [FastMath(), relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern()]
        passes += [relax.transform.FuseOps(), relax.transform.FuseTIR()]
        mod = tvm.transform.Sequential(passes)(mod)
    (func,) = [f for gv, f in mod.functions_items() if name_part in gv.name_hint]
    return func


@T.prim_func(private=True, s_tir=True)
def _isnan_where(a: T.Buffer((4, 16), "float32"), o: T.Buffer((4, 16), "float32")):
    p = T.sblock_alloc_buffer((4, 16))
    n = T.sblock_alloc_buffer((4, 16), "bool")
    for i, j in T.grid(4, 16):
        with T.sblock("p"):
            vi, vj = T.axis.remap("SS", [i, j])
            p[vi, vj] = a[vi, vj] * T.float32(2)
    for i, j in T.grid(4, 16):
        with T.sblock("n"):
            vi, vj = T.axis.remap("SS", [i, j])
            n[vi, vj] = T.isnan(p[vi, vj])
    for i, j in T.grid(4, 16):
        with T.sblock("w"):
            vi, vj = T.axis.remap("SS", [i, j])
            o[vi, vj] = T.Select(n[vi, vj], T.float32(0), p[vi, vj])


class _DropsAValue(CPURowReduction):
    """TVM's reverse_compute_inline of ``isnan(p)`` into the block writing ``p`` drops ``p``,
    which the ``where`` still reads (CPURowReduction did so on GPT-2's softmax)."""

    def apply(self, func, target, tunable):
        sch = s_tir.Schedule(func)
        sch.reverse_compute_inline(sch.get_sblock("n"))
        return sch


def test_an_ill_formed_schedule_falls_through_with_a_warning(caplog):
    """The guard must drop a schedule TVM would reject later, far from the rule; the message
    names the kernel by what it writes (it is not named yet)."""
    with caplog.at_level(logging.INFO, logger="tvmamp.schedules"):
        assert Guarded(_DropsAValue()).apply(_isnan_where, TARGET, False) is None
    assert "not well-formed TIR" in caplog.text and "please report" in caplog.text
    assert "_DropsAValue did not apply to the kernel writing o" in caplog.text


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
