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
    must not fail the build: the function is left to the next rule, and the fallback is logged.
    """

    def __init__(self, rule: dl.ScheduleRule):
        self.rule = rule

    def apply(self, func: tirx.PrimFunc, target: Target, tunable: bool) -> s_tir.Schedule | None:
        try:
            return self.rule.apply(func, target, tunable)
        except (ScheduleError, tvm.error.InternalError, AssertionError, ValueError) as err:
            name = func.attrs.get("global_symbol", "?") if func.attrs else "?"
            first_line = str(err).strip().splitlines()[-1]
            logger.info("%s did not apply to %s: %s", type(self.rule).__name__, name, first_line)
            return None

    def is_target_available(self, target: Target) -> bool:
        return self.rule.is_target_available(target)
