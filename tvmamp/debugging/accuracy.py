"""Accuracy comparison: each op's output in an AMP build against the fp32 build, in graph order."""

from __future__ import annotations

import csv
import dataclasses
import difflib
import os

import ml_dtypes
import numpy as np

from .dump import OpDump, record_op_outputs

DEFAULT_THRESHOLDS = {"float16": 1e-2, "bfloat16": 5e-2}
_CASTS = ("relax.astype", "relax.wrap_param")


@dataclasses.dataclass
class OpError:
    """The error of one op's output in the AMP build against the fp32 reference.

    ``max_rel_err`` is max |amp - ref| / max |ref| (infinite when the AMP output holds NaN/Inf
    where the reference is finite). ``overflow`` counts finite reference values that become Inf
    in the low dtype; ``underflow`` counts non-zero reference values that become zero in it;
    ``nonfinite`` counts NaN/Inf in the AMP output where the reference is finite.
    """

    index: int
    func: str
    op: str
    var: str
    dtype: str
    numel: int
    ref_max_abs: float
    max_abs_err: float
    max_rel_err: float
    overflow: int
    underflow: int
    nonfinite: int


def range_counts(values: np.ndarray, low_dtype: str) -> tuple[int, int]:
    """(finite values that become Inf in ``low_dtype``, non-zero values that become 0 in it)."""
    with np.errstate(over="ignore"):
        low = values.astype(ml_dtypes.bfloat16 if low_dtype == "bfloat16" else low_dtype)
    low = low.astype(np.float64)
    return int((~np.isfinite(low)).sum()), int(((values != 0) & (low == 0)).sum())


def op_error(index, site, amp, ref, low_dtype) -> OpError:
    """Compare one AMP op output with its fp32 reference (both upcast to float64)."""
    amp = np.asarray(amp, np.float64).ravel()
    ref = np.asarray(ref, np.float64).ravel()
    if amp.shape != ref.shape:
        raise ValueError(
            f"tvmamp.debugging.compare_accuracy: op {site.op} ({site.var}) has {amp.size} values "
            f"in the AMP run but {ref.size} in the reference; the dumps do not match"
        )
    finite = np.isfinite(ref)
    bad = finite & ~np.isfinite(amp)
    scale = float(np.abs(ref[finite]).max()) if finite.any() else 0.0
    diff = np.abs(amp[finite & ~bad] - ref[finite & ~bad])
    max_abs = float("inf") if bad.any() else float(diff.max()) if diff.size else 0.0
    overflow, underflow = range_counts(ref[finite], low_dtype)
    return OpError(
        index=index,
        func=site.func,
        op=site.short_op,
        var=site.var,
        dtype=site.dtype,
        numel=int(ref.size),
        ref_max_abs=scale,
        max_abs_err=max_abs,
        max_rel_err=max_abs / (scale or 1.0),
        overflow=overflow,
        underflow=underflow,
        nonfinite=int(bad.sum()),
    )


@dataclasses.dataclass
class AccuracyReport:
    """Per-op errors of an AMP build, the first op over the threshold, and the files written."""

    rows: list
    threshold: float
    low_dtype: str
    level: str
    csv_path: str | None = None
    png_path: str | None = None

    @property
    def first_bad(self) -> OpError | None:
        """The first op (graph order) whose relative error exceeds the threshold, or None."""
        return next((r for r in self.rows if not r.max_rel_err <= self.threshold), None)

    def write_csv(self, path: str | os.PathLike) -> str:
        """Write one row per op (the :class:`OpError` fields)."""
        fields = [f.name for f in dataclasses.fields(OpError)]
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(dataclasses.asdict(r) for r in self.rows)
        return os.fspath(path)

    def summary(self) -> str:
        """A few lines: ops compared, worst error, the first op over the threshold."""
        worst = max(self.rows, key=lambda r: r.max_rel_err, default=None)
        lines = [f"compared {len(self.rows)} ops, AMP {self.level} ({self.low_dtype}) vs fp32"]
        if worst is not None:
            lines.append(f"worst: {worst.op} ({worst.var}) max rel error {worst.max_rel_err:.3e}")
        bad = self.first_bad
        lines.append(
            f"first op over {self.threshold:g}: {bad.op} ({bad.var} in {bad.func}, #{bad.index}, "
            f"{bad.dtype}, max rel error {bad.max_rel_err:.3e}, overflow {bad.overflow})"
            if bad is not None
            else f"no op exceeds {self.threshold:g}"
        )
        lines += [f"wrote {p}" for p in (self.csv_path, self.png_path) if p]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _keys(dump: OpDump):
    kept = [r for r in dump.records if r.site.op.split(":", 1)[0] not in _CASTS]
    return kept, [(r.site.func, r.site.op, r.site.var.count("[")) for r in kept]


def compare_dumps(reference: OpDump, amp: OpDump, threshold: float | None = None):
    """Pair the ops of two dumps in graph order (AMP casts left out) and measure each error."""
    low_dtype = amp.meta.get("dtype", "float16")
    if threshold is None:
        threshold = DEFAULT_THRESHOLDS.get(low_dtype, 1e-2)
    ref_records, ref_keys = _keys(reference)
    amp_records, amp_keys = _keys(amp)
    matcher = difflib.SequenceMatcher(None, ref_keys, amp_keys, autojunk=False)
    rows = []
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            ref, low = ref_records[block.a + k], amp_records[block.b + k]
            # names from the fp32 model (the user's), compute dtype from the AMP build
            site = dataclasses.replace(ref.site, dtype=low.site.dtype)
            rows.append(op_error(len(rows), site, low.value, ref.value, low_dtype))
    return AccuracyReport(rows, threshold, low_dtype, amp.meta.get("level", "?"))


def _as_dump(value):
    if isinstance(value, OpDump):
        return value
    if isinstance(value, (str, os.PathLike)):
        return OpDump.load(value)
    return None


def compare_accuracy(
    model,
    inputs=None,
    level: str = "O2",
    dtype: str | None = None,
    output_path: str | os.PathLike | None = None,
    params=None,
    target="llvm",
    threshold: float | None = None,
    plot: bool = True,
    **convert_kwargs,
) -> AccuracyReport:
    """Run the fp32 and the AMP build of a model, or take two dumps, and compare op by op.

    Parameters
    ----------
    model : tvm.IRModule, relax.Function, OpDump or path
        The fp32 model; or the reference dump (an :class:`OpDump` or a directory it was saved to).
    inputs : list of np.ndarray, OpDump or path
        Data inputs of ``main``; or, when ``model`` is a dump, the AMP dump.
    level, dtype, params, target, **convert_kwargs
        How to convert the AMP model (see :func:`tvmamp.convert`); the reference is level O0.
    output_path : path, optional
        A directory for ``accuracy.csv`` and ``accuracy.png`` (relative error per op, coloured
        by dtype; needs matplotlib, ``pip install 'tvmamp[plot]'``).
    threshold : float, optional
        Relative error above which an op is flagged (default 1e-2 for float16, 5e-2 for
        bfloat16).
    plot : bool
        Write the PNG too.

    Returns
    -------
    AccuracyReport
    """
    reference, amp = _as_dump(model), _as_dump(inputs)
    if reference is None or amp is None:
        if inputs is None:
            raise TypeError("tvmamp.debugging.compare_accuracy: inputs are required with a model")
        common = dict(target=target, params=params, **convert_kwargs)
        reference = record_op_outputs(model, inputs, level="O0", **common)
        amp = record_op_outputs(model, inputs, level=level, dtype=dtype, **common)
    report = compare_dumps(reference, amp, threshold)
    if output_path is not None:
        os.makedirs(output_path, exist_ok=True)
        report.csv_path = report.write_csv(os.path.join(output_path, "accuracy.csv"))
        if plot:
            from .plots import plot_accuracy

            report.png_path = plot_accuracy(report, os.path.join(output_path, "accuracy.png"))
    return report
