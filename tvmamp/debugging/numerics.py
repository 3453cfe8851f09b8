"""Numeric statistics of one tensor, Paddle's report line, and check_numerics."""

from __future__ import annotations

import dataclasses
import enum
import functools
import sys

import ml_dtypes
import numpy as np
import tvm

FP16_MAX = float(np.finfo(np.float16).max)
_SHORT_DTYPES = {"float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64"}


class DebugMode(enum.Enum):
    """What the tensor checker reports (Paddle's ``paddle.amp.debugging.DebugMode``).

    CHECK_NAN_INF_AND_ABORT
        Report the first tensor holding NaN or Inf and raise RuntimeError naming its op.
    CHECK_NAN_INF
        Report every tensor holding NaN or Inf and carry on.
    CHECK_ALL_FOR_OVERFLOW
        Also report finite values beyond the float16 range (|x| > 65504).
    CHECK_ALL
        Report every checked tensor.
    """

    CHECK_NAN_INF_AND_ABORT = 0
    CHECK_NAN_INF = 1
    CHECK_ALL_FOR_OVERFLOW = 2
    CHECK_ALL = 3


@dataclasses.dataclass
class Finding:
    """The statistics of one checked tensor; ``line()`` is Paddle's report line."""

    op: str
    var: str
    dtype: str
    numel: int
    num_nan: int
    num_inf: int
    num_zero: int
    max: float
    min: float
    mean: float
    num_overflow: int = 0
    func: str = ""
    device: str = "cpu"

    @property
    def has_nan_inf(self) -> bool:
        """Whether the tensor holds NaN or Inf."""
        return self.num_nan > 0 or self.num_inf > 0

    def level(self) -> str:
        """ERROR for NaN/Inf, WARNING for values beyond the float16 range, else INFO."""
        if self.has_nan_inf:
            return "ERROR"
        return "WARNING" if self.num_overflow else "INFO"

    def line(self) -> str:
        """``[PRECISION] [ERROR] in [device=cpu, op=exp, tensor=lv, dtype=fp16], numel=...``."""
        dtype = _SHORT_DTYPES.get(self.dtype, self.dtype)
        return (
            f"[PRECISION] [{self.level()}] in [device={self.device}, op={self.op}, "
            f"tensor={self.var}, dtype={dtype}], numel={self.numel}, num_nan={self.num_nan}, "
            f"num_inf={self.num_inf}, num_zero={self.num_zero}, max={self.max:e}, "
            f"min={self.min:e}, mean={self.mean:e}"
        )


def to_numpy(tensor) -> np.ndarray:
    """A numpy view of a numpy array, TVM tensor, torch tensor or Python sequence."""
    if isinstance(tensor, tvm.runtime.Tensor):
        return tensor.numpy()
    if hasattr(tensor, "detach") and hasattr(tensor, "numpy"):
        return tensor.detach().cpu().numpy()
    return np.asarray(tensor)


def tensor_stats(array: np.ndarray, op: str = "", var: str = "", **where) -> Finding:
    """Count NaN/Inf/zero values and take max/min/mean as Paddle's kernel does.

    max and min skip NaN (Inf counts); mean is over all elements, so it is NaN when any value is.
    With no non-NaN value, max and min stay at float32's lowest and highest, as in Paddle.
    """
    values = np.asarray(array)
    dtype = "bfloat16" if values.dtype == ml_dtypes.bfloat16 else str(values.dtype)
    wide = values.astype(np.float64).ravel()
    nan = np.isnan(wide)
    finite = wide[~nan]
    lowest, highest = float(np.finfo(np.float32).min), float(np.finfo(np.float32).max)
    bounded = wide[np.isfinite(wide)]
    with np.errstate(invalid="ignore", over="ignore"):
        mean = float(np.float32(wide.sum() / wide.size)) if wide.size else 0.0
    return Finding(
        op=op,
        var=var,
        dtype=dtype,
        numel=int(wide.size),
        num_nan=int(nan.sum()),
        num_inf=int(np.isinf(wide).sum()),
        num_zero=int((wide == 0).sum()),
        max=float(np.float32(finite.max())) if finite.size else lowest,
        min=float(np.float32(finite.min())) if finite.size else highest,
        mean=mean,
        num_overflow=int((np.abs(bounded) > FP16_MAX).sum()),
        **where,
    )


def clearly_clean(array: np.ndarray, mode: DebugMode) -> bool:
    """A cheap test that ``mode`` will not report ``array`` (skips the full statistics)."""
    if mode is DebugMode.CHECK_ALL or not np.isfinite(array).all():
        return False
    if mode is DebugMode.CHECK_ALL_FOR_OVERFLOW and array.size:
        return float(np.abs(array).max()) <= FP16_MAX
    return True


def should_report(finding: Finding, mode: DebugMode) -> bool:
    """Whether ``mode`` reports this tensor."""
    if mode is DebugMode.CHECK_ALL:
        return True
    if mode is DebugMode.CHECK_ALL_FOR_OVERFLOW:
        return finding.has_nan_inf or finding.num_overflow > 0
    return finding.has_nan_inf


def abort_message(finding: Finding) -> str:
    """The RuntimeError message of ABORT mode: names the offending op first."""
    where = f" in {finding.func}" if finding.func else ""
    return (
        f"tvmamp tensor checker: op {finding.op} (tensor {finding.var}{where}) produced "
        f"{finding.num_nan} NaN and {finding.num_inf} Inf values in {finding.dtype}; "
        f"{finding.line()}"
    )


def check_mode(mode, component: str) -> DebugMode:
    """Return ``mode`` if it is a DebugMode (or its name), else raise."""
    if isinstance(mode, str) and mode in DebugMode.__members__:
        return DebugMode[mode]
    if not isinstance(mode, DebugMode):
        choices = ", ".join(DebugMode.__members__)
        raise ValueError(f"{component}: debug_mode {mode!r} is not one of {choices}")
    return mode


def check_numerics(
    tensor, op_type: str, var_name: str, debug_mode=DebugMode.CHECK_NAN_INF_AND_ABORT
):
    """Check one tensor, as ``paddle.amp.debugging.check_numerics`` does.

    Parameters
    ----------
    tensor : array-like
        numpy array, TVM tensor, torch tensor or sequence.
    op_type, var_name : str
        Names used in the report line.
    debug_mode : DebugMode
        ABORT raises RuntimeError on NaN/Inf; the other modes print the line (to stderr) when
        the mode reports the tensor.

    Returns
    -------
    stats : np.ndarray
        int64 ``[num_nan, num_inf, num_zero]``.
    values : np.ndarray
        float32 ``[max, min, mean]``.
    """
    mode = check_mode(debug_mode, "tvmamp.debugging.check_numerics")
    finding = tensor_stats(to_numpy(tensor), op_type, var_name)
    if should_report(finding, mode):
        print(finding.line(), file=sys.stderr)
        if mode is DebugMode.CHECK_NAN_INF_AND_ABORT:
            raise RuntimeError(abort_message(finding))
    stats = np.array([finding.num_nan, finding.num_inf, finding.num_zero], dtype=np.int64)
    values = np.array([finding.max, finding.min, finding.mean], dtype=np.float32)
    return stats, values


def _check_all(values, op_type, prefix, mode):
    items = values if isinstance(values, (tuple, list)) else [values]
    for i, value in enumerate(items):
        array = to_numpy(value)
        if array.dtype.kind == "f" or array.dtype == ml_dtypes.bfloat16:
            check_numerics(array, op_type, f"{prefix}{i}", mode)


def check_layer_numerics(layer=None, *, debug_mode=DebugMode.CHECK_NAN_INF_AND_ABORT, name=None):
    """Wrap a callable (a function, an Executable, a sub-model) to check its inputs and outputs.

    Use as ``check_layer_numerics(exe)(x)`` or as a decorator ``@check_layer_numerics`` (with or
    without keyword arguments). Every float input is checked as ``input<i>`` and every float
    output as ``output<i>`` with :func:`check_numerics`, under the op name ``name`` (by default
    the callable's name).
    """
    mode = check_mode(debug_mode, "tvmamp.debugging.check_layer_numerics")
    if layer is None:
        return functools.partial(check_layer_numerics, debug_mode=mode, name=name)
    if not callable(layer):
        raise TypeError(
            f"tvmamp.debugging.check_layer_numerics: expected a callable (a function or a "
            f"tvmamp Executable), got {type(layer).__name__}"
        )
    op_type = name or getattr(layer, "__name__", type(layer).__name__)

    def checked(*inputs, **kwargs):
        _check_all(list(inputs), op_type, "input", mode)
        outputs = layer(*inputs, **kwargs)
        _check_all(outputs, op_type, "output", mode)
        return outputs

    checked.__name__ = checked.__qualname__ = f"checked_{op_type}"
    checked.__wrapped__ = layer
    return checked
