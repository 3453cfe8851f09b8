"""Elementwise closeness for numeric tests: ``assert_close`` and per-dtype tolerances.

Every element must satisfy ``|out - ref| <= atol + rtol * |ref|``. Unlike
``tvmamp.benchmark.max_rel_error`` (``max|out - ref| / max|ref|``), a small element is held to
its own size: a softmax probability of 0.01 that is off by 0.005 fails here, where the
normwise error of the whole output would hardly move.

Imported by name (``from tolerances import assert_close``): pytest puts ``tests/`` on
``sys.path`` when it loads ``tests/conftest.py``.
"""

from __future__ import annotations

import numpy as np

# (rtol, atol) for model outputs of order 1, chosen from measured errors on random inputs:
# fp16 (11-bit significand) and bf16 (8-bit) after a few matmul/conv layers with fp32
# accumulation. The MLP, conv net and transformer layer of tests/test_build.py use at most half
# of these at O1/O2/O3/OD/auto. Outputs much smaller than 1 need a smaller atol: scale it.
TOLERANCES = {
    "float16": (5e-3, 5e-3),
    "bfloat16": (2e-2, 2e-2),
    "float32": (1e-5, 1e-6),
}


def tolerance(dtype: str, scale: float = 1.0) -> dict:
    """``dict(rtol=..., atol=...)`` for ``dtype``, with atol scaled to outputs of size ``scale``."""
    rtol, atol = TOLERANCES[str(dtype)]
    return {"rtol": rtol, "atol": atol * scale}


def assert_close(out, ref, rtol: float, atol: float, what: str = "output") -> None:
    """Assert ``|out - ref| <= atol + rtol * |ref|`` elementwise, in float64.

    ``out`` and ``ref`` may be arrays (any float dtype, bf16 included) or tuples of arrays,
    compared field by field. A NaN or inf in ``out`` where ``ref`` is finite fails. The message
    names the worst element: its index, both values and how far past the tolerance it is.
    """
    if isinstance(ref, (tuple, list)):
        assert len(out) == len(ref), f"{what}: {len(out)} outputs, expected {len(ref)}"
        for i, (o, r) in enumerate(zip(out, ref)):
            assert_close(o, r, rtol, atol, f"{what}[{i}]")
        return
    out = np.asarray(out).astype(np.float64)
    ref = np.asarray(ref).astype(np.float64)
    assert out.shape == ref.shape, f"{what}: shape {out.shape}, expected {ref.shape}"
    diff = np.abs(out - ref)
    with np.errstate(divide="ignore", invalid="ignore"):
        excess = np.where(diff == 0, 0.0, diff / (atol + rtol * np.abs(ref)))
    excess = np.where(np.isnan(excess), np.inf, excess)  # a NaN in out (or in ref) fails
    worst = np.unravel_index(int(np.argmax(excess)), excess.shape) if excess.size else ()
    if excess.size and not excess[worst] <= 1.0:
        bad = int(np.sum(~(excess <= 1.0)))
        raise AssertionError(
            f"{what}: {bad} of {excess.size} elements differ by more than atol={atol:g} + "
            f"rtol={rtol:g} * |ref|; worst at {tuple(int(i) for i in worst)}: "
            f"{float(out[worst])!r} vs {float(ref[worst])!r} ({excess[worst]:.3g}x the tolerance)"
        )
