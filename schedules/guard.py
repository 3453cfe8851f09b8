"""A ScheduleRule wrapper that turns a rule's scheduling failure into "does not apply"."""

from __future__ import annotations

import logging

import tvm
from tvm import s_tir, tirx
from tvm.s_tir import dlight as dl
from tvm.s_tir.schedule import ScheduleError
from tvm.target import Target

logger = logging.getLogger("tvmamp.schedules")


class Guarded(dl.ScheduleRule):
    """Run ``rule``; if a schedule primitive rejects the function, fall through to the next rule.

    TVM's own dlight rules assume shapes they sometimes do not check (``dlight.cpu.Reduction``
    fails on batch_norm's multi-output training kernels, ``dlight.cpu.GEMV`` asserts on a
    batch-1 depthwise conv at 1x1 spatial size), and some primitives raise ValueError (e.g. a
    loop that no longer exists). A failed default schedule
    must not fail the build: the function is left to the next rule, and the fallback is logged
    (at INFO; any other exception, which is a bug in the rule, at WARNING).
    """

    def __init__(self, rule: dl.ScheduleRule):
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        try:
            scheduled = self.rule.apply(func, target, tunable)
            if scheduled is not None and not _well_formed(scheduled):
                raise _IllFormed("the scheduled function is not well-formed TIR")
            return scheduled
        except (ScheduleError, tvm.error.InternalError, AssertionError, ValueError) as err:
            self._fall_through(func, err, logging.INFO, "")
        except Exception as err:  # noqa: BLE001 - a rule's bug must not fail the user's build
            self._fall_through(func, err, logging.WARNING, " (a bug in the rule; please report)")
        return None

    def _fall_through(self, func: tirx.PrimFunc, err: Exception, level: int, note: str) -> None:
        name = func.attrs.get("global_symbol") if func.attrs else None
        buffers = [p for p in func.params if tirx.is_buffer_var(p)]
        if name is None:  # a fused kernel is named later: say what it writes
            name = f"the kernel writing {buffers[-1].name}" if buffers else "?"
        first_line = (str(err).strip().splitlines() or [""])[-1]
        rule = type(self.rule).__name__
        logger.log(
            level,
            "%s did not apply to %s: %s: %s%s",
            rule,
            name,
            type(err).__name__,
            first_line,
            note,
        )

    def is_target_available(self, target: Target) -> bool:
        return self.rule.is_target_available(target)


class _IllFormed(Exception):
    """A rule returned a schedule whose function TVM would reject later, far from the cause."""


def _well_formed(scheduled) -> bool:
    """Return whether every function of a rule's result (a Schedule or a list of them) is
    well-formed TIR: a rule that moved a block before its producer (seen on a conv1d + GELU
    kernel) must fall through here, not fail the build in a later pass."""
    schedules = scheduled if isinstance(scheduled, list) else [scheduled]
    for sch in schedules:
        try:  # the check the next pass's s_tir.Schedule(func) makes (verify_well_formed is
            s_tir.Schedule(sch.mod["main"])  # stricter: it rejects every tensorized kernel)
        except tvm.error.InternalError:
            return False
    return True
