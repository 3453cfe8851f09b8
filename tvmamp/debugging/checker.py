"""The tensor checker: an instrumented build that checks every selected op's output for NaN/Inf.

While the checker is enabled, an instrumentation hook of the pipeline
(``tvmamp.pipeline.add_instrumentation_hook``) rewrites each converted module so that a check
runs after every selected op inside the compiled graph (see :mod:`tvmamp.debugging.instrument`).
It works on any Relax function, so the train steps that a Trainer compiles through
``tvmamp.pipeline.compile_converted`` are checked too. Executables built while the checker is
off are exactly the uninstrumented ones; instrumented executables check only while a checker is
enabled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Sequence

import tvm

from tvmamp.pipeline import add_instrumentation_hook, remove_instrumentation_hook
from tvmamp.policy import resolve_op_names

from .instrument import Site, instrument_module, packed_call, tensor_fields
from .numerics import (
    DebugMode,
    Finding,
    abort_message,
    check_mode,
    clearly_clean,
    should_report,
    tensor_stats,
)

CHECK_FUNC = "tvmamp.debugging.check_tensor"
ENTRY_FUNC = "tvmamp.debugging.begin_step"
LOG_NAME = "tensor_checker.log"


@dataclasses.dataclass
class TensorCheckerConfig:
    """What to check, as ``paddle.amp.debugging.TensorCheckerConfig``.

    Parameters
    ----------
    enable : bool
        Whether :func:`enable_tensor_checker` turns the checker on with this config.
    debug_mode : DebugMode
        See :class:`DebugMode`.
    output_dir : str, optional
        Append report lines to ``<output_dir>/tensor_checker.log`` instead of stderr.
    checked_op_list, skipped_op_list : list of str, optional
        Ops to check (default: all) and ops never to check; Relax names (``exp``,
        ``relax.nn.softmax``) or Paddle/MindSpore/PyTorch aliases.
    debug_step : (int, int), optional
        Check only calls ``start <= n < end`` of each compiled public function (0-based), as
        Paddle checks only those training steps.

    Attributes
    ----------
    findings : list of Finding
        Every reported tensor, in the order found.
    """

    enable: bool
    debug_mode: DebugMode = DebugMode.CHECK_NAN_INF_AND_ABORT
    output_dir: str | os.PathLike | None = None
    checked_op_list: Sequence[str] | None = None
    skipped_op_list: Sequence[str] | None = None
    debug_step: Sequence[int] | None = None
    findings: list = dataclasses.field(default_factory=list, init=False, repr=False)

    def __post_init__(self):
        component = "tvmamp.debugging.TensorCheckerConfig"
        self.debug_mode = check_mode(self.debug_mode, component)
        self._checked = (
            resolve_op_names(self.checked_op_list, component) if self.checked_op_list else None
        )
        self._skipped = resolve_op_names(self.skipped_op_list or (), component)
        if self.debug_step is not None:
            step = tuple(self.debug_step)
            if (
                len(step) != 2
                or not all(isinstance(s, int) for s in step)
                or not 0 <= step[0] < step[1]
            ):
                raise ValueError(
                    f"{component}: debug_step {self.debug_step!r} must be (start, end) with "
                    "0 <= start < end"
                )
            self.debug_step = step
        self._calls: dict[str, int] = {}
        self._step = 0

    def selects(self, site: Site) -> bool:
        """Whether the op of ``site`` is checked."""
        op = site.op.split(":", 1)[0]
        return (self._checked is None or op in self._checked) and op not in self._skipped

    def begin_call(self, func: str) -> None:
        """Count one call of the compiled public function ``func``."""
        self._calls[func] = self._calls.get(func, 0) + 1
        self._step = self._calls[func] - 1

    def in_steps(self, func: str) -> bool:
        """Whether the current call of ``func`` is within ``debug_step``.

        A private function (never entered from outside) runs in the step of the public call
        that is running.
        """
        if self.debug_step is None:
            return True
        step = self._calls[func] - 1 if func in self._calls else self._step
        return self.debug_step[0] <= step < self.debug_step[1]

    def record(self, finding: Finding) -> None:
        """Keep a finding and write its line (to the log file, or stderr)."""
        self.findings.append(finding)
        if self.output_dir is None:
            print(finding.line(), file=sys.stderr, flush=True)
            return
        os.makedirs(self.output_dir, exist_ok=True)
        with open(os.path.join(self.output_dir, LOG_NAME), "a", encoding="utf-8") as log:
            log.write(finding.line() + "\n")


_ACTIVE: list[TensorCheckerConfig] = []


def enable_tensor_checker(config: TensorCheckerConfig) -> None:
    """Turn the checker on: models built from now on are instrumented, and checks run.

    A config with ``enable=False`` leaves the checker off.
    """
    if not isinstance(config, TensorCheckerConfig):
        raise TypeError(
            "tvmamp.debugging.enable_tensor_checker: expected a TensorCheckerConfig, "
            f"got {type(config).__name__}"
        )
    disable_tensor_checker()
    if config.enable:
        _ACTIVE.append(config)
        add_instrumentation_hook(checker_hook)


def disable_tensor_checker() -> None:
    """Turn the checker off: later builds are not instrumented, instrumented ones stop checking."""
    _ACTIVE.clear()
    remove_instrumentation_hook(checker_hook)


@contextlib.contextmanager
def tensor_checker(config: TensorCheckerConfig):
    """``with tensor_checker(config):`` enables the checker for the block."""
    enable_tensor_checker(config)
    try:
        yield config
    finally:
        disable_tensor_checker()


def checker_hook(converted) -> tvm.IRModule:
    """Instrumentation hook: insert a check after every selected op of every Relax function."""
    if not _ACTIVE:
        return converted.mod
    config = _ACTIVE[0]

    def emit(site, value):
        return [
            packed_call(CHECK_FUNC, tensor, site.func, site.short_op, site.var)
            for site, tensor in tensor_fields(site, value)
            if config.selects(site)
        ]

    return instrument_module(converted.mod, emit, on_entry=ENTRY_FUNC)


@tvm.register_global_func(ENTRY_FUNC, override=True)
def _begin_step(func):
    if _ACTIVE:
        _ACTIVE[0].begin_call(str(func))


@tvm.register_global_func(CHECK_FUNC, override=True)
def _check_tensor(tensor, func, op, var):
    if not _ACTIVE or not _ACTIVE[0].in_steps(str(func)):
        return
    config = _ACTIVE[0]
    array = tensor.numpy()
    if clearly_clean(array, config.debug_mode):
        return
    where = dict(func=str(func), device=str(tensor.device))
    finding = tensor_stats(array, str(op), str(var), **where)
    if should_report(finding, config.debug_mode):
        config.record(finding)
        if config.debug_mode is DebugMode.CHECK_NAN_INF_AND_ABORT and finding.has_nan_inf:
            raise RuntimeError(abort_message(finding))
