"""bench/bench_amx_blocking.py's loop orders: every whole-GEMM kernel of the AMX tile step is
right on the tile registers' emulation, and the AMX build compiles to the tile instructions.

The AMX build runs only on an AMX host (``--loop-orders``); here its kernels run on the scalar
emulation of the eight tile registers (``-DEMULATE``), from the same kernel source.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
import bench_amx_blocking as bench  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")

# m x k x n: partial column blocks (160 = 128 + 32), partial K blocks (288 = 256 + 32, and
# 128 + 128 + 32), a partial row block (96 = 64 + 32), 17 panel pairs in two n slices (544)
SHAPES = [(96, 288, 160), (64, 160, 544)]


def _expected(m: int, k: int, n: int) -> set[tuple[str, int, int]]:
    variants = {("current", 512, 0), ("b_resident", 0, 0)}
    variants |= {("brgemm", nb, kb) for nb in (64, 128, 256, 512) for kb in (128, 256, 512, 1024)}
    variants = {v for v in variants if v[0] != "brgemm" or (v[1] <= n and v[2] <= k)}
    return variants | {("a_resident", mb, 0) for mb in (32, 64, 128) if mb <= m}


def test_every_loop_order_matches_a_double_reference():
    rows = bench.loop_order_rates(SHAPES, emulate=True)
    for shape in SHAPES:
        got = {(r["kernel"], r["p1"], r["p2"]) for r in rows if r["shape"] == shape}
        assert got == _expected(*shape), shape
    assert any(r["kernel"] == "brgemm" and r["shape"][1] % r["p2"] for r in rows)
    for row in rows:  # fp32 accumulation of bf16 products; an unwritten element reads NaN: inf
        assert row["rel_err"] < bench.LOOP_ORDER_TOLERANCE, row


def test_amx_build_runs_the_tile_step_without_emulation(tmp_path):
    src, asm = tmp_path / "loop_orders.c", tmp_path / "loop_orders.s"
    src.write_text(bench._LOOP_ORDERS_C)
    result = subprocess.run(
        ["gcc", *bench.AMX_FLAGS, "-S", str(src), "-o", str(asm)], capture_output=True, text=True
    )
    if result.returncode and "amx" in result.stderr:
        pytest.skip(f"this gcc cannot build AMX: {result.stderr.strip()[:200]}")
    assert result.returncode == 0, result.stderr
    text = asm.read_text()
    # four kernels, each with one inlined 2 x 2 step: 4 tdpbf16ps, 4 operand loads each
    assert text.count("tdpbf16ps") == 16
    assert text.count("tileloadd") == 16 + 4  # and brgemm's reload of the C block
    assert "t_dp" not in text and "t_load" not in text
