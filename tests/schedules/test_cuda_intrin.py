"""The fp16/bf16 tensor-core intrinsics do what their descriptions say, checked without a GPU.

The descriptions (what tensorize matches) place a 16x16 tile in a warp by ``fragment_layout``;
the implementations issue ``ldmatrix.x4`` at ``_ldmatrix_offset`` and two ``mma.sync.m16n8k16``,
and the store writes values back by ``_fragment_to_tile``. Here ldmatrix and mma are simulated
in numpy from the PTX ISA's fragment tables, so a wrong offset, layout, transpose or half-tile
split fails. fp16 and bf16 share these layouts (both are .b16 in ldmatrix and mma).
"""

import numpy as np
import pytest

from tvmamp.schedules.cuda import mma_intrin as ci

STRIDE = 24  # a shared-memory row padded as storage_align(factor=32, offset=8) pads it


def ldmatrix_x4(flat, offsets, trans):
    """ldmatrix.sync.aligned.m8n8.x4[.trans].b16 from the PTX ISA.

    Lane ``l`` gives the address of row ``l % 8`` of matrix ``l // 8``; thread ``t`` receives in
    register ``j`` the two elements ``(t // 4, 2 * (t % 4) + e)`` of matrix ``j``, or
    ``(2 * (t % 4) + e, t // 4)`` with ``.trans``.
    """
    rows = [flat[offsets[lane] : offsets[lane] + 8] for lane in range(32)]
    mats = [np.stack(rows[8 * j : 8 * j + 8]) for j in range(4)]
    frag = np.zeros((32, 8))
    for t in range(32):
        for j in range(4):
            for e in range(2):
                r, c = t // 4, 2 * (t % 4) + e
                frag[t, 2 * j + e] = mats[j][c, r] if trans else mats[j][r, c]
    return frag


def mma_m16n8k16(a, b, c):
    """mma.sync.aligned.m16n8k16.row.col for 16-bit inputs, fragments per the PTX ISA."""
    A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
    for t in range(32):
        g, q = t // 4, t % 4
        for i in range(8):
            A[g + 8 * ((i // 2) % 2), 2 * q + i % 2 + 8 * (i // 4)] = a[t, i]
        for i in range(4):
            B[2 * q + i % 2 + 8 * (i // 2), g] = b[t, i]
            C[g + 8 * (i // 2), 2 * q + i % 2] = c[t, i]
    D = A @ B + C
    out = np.zeros((32, 4))
    for t in range(32):
        for i in range(4):
            out[t, i] = D[t // 4 + 8 * (i // 2), 2 * (t % 4) + i % 2]
    return out


def run_mma_impl(a, b, c):
    """The implementation: two m16n8k16 ops, on B and C values 0-3 then 4-7 of each thread."""
    c = c.copy()
    for half in range(2):
        cols = slice(4 * half, 4 * half + 4)
        c[:, cols] = mma_m16n8k16(a, b[:, cols], c[:, cols])
    return c


def to_warp(tile):
    """What a description says a warp holds for a 16x16 tile."""
    warp = np.zeros((32, 8))
    for i in range(16):
        for j in range(16):
            warp[ci.fragment_layout(i, j)] = tile[i, j]
    return warp


def load(tile, operand):
    flat = np.zeros(16 * STRIDE)
    for i in range(16):
        flat[i * STRIDE : i * STRIDE + 16] = tile[i]
    offsets = [ci._ldmatrix_offset(operand)(lane, STRIDE) for lane in range(32)]
    return ldmatrix_x4(flat, offsets, trans=operand == "b")


def test_fragment_layout_is_a_bijection_with_its_inverse():
    seen = {ci.fragment_layout(i, j) for i in range(16) for j in range(16)}
    assert seen == {(t, v) for t in range(32) for v in range(8)}
    for i in range(16):
        for j in range(16):
            assert ci._fragment_to_tile(*ci.fragment_layout(i, j)) == (i, j)


def test_ldmatrix_loads_a_in_the_description_layout(rng):
    tile = rng.standard_normal((16, 16))
    np.testing.assert_array_equal(load(tile, "a"), to_warp(tile))


@pytest.mark.parametrize("operand", ["b_trans", "b"])
def test_ldmatrix_loads_b_in_the_mma_register_order(operand, rng):
    # Only ldmatrix writes and only mma reads a B fragment, so it is held in the order the two
    # m16n8k16 ops read it (values 0-3: columns 0-7 of the tile, 4-7: columns 8-15), not in
    # the description's layout; TVM's fp16 intrinsics do the same.
    tile = rng.standard_normal((16, 16))
    kn = tile.T if operand == "b_trans" else tile  # [k, n]
    frag = load(tile, operand)
    for t in range(32):
        g, q = t // 4, t % 4
        for half in range(2):
            n = 8 * half + g
            want = [kn[2 * q + i % 2 + 8 * (i // 2), n] for i in range(4)]
            np.testing.assert_array_equal(frag[t, 4 * half : 4 * half + 4], want)


@pytest.mark.parametrize("b_trans", [True, False])
def test_load_mma_store_is_a_16x16x16_multiply_accumulate(b_trans, rng):
    a_tile, b_tile, c_tile = (rng.standard_normal((16, 16)) for _ in range(3))
    b_frag = load(b_tile, "b_trans" if b_trans else "b")
    acc = run_mma_impl(load(a_tile, "a"), b_frag, to_warp(c_tile))
    out = np.zeros((16, 16))
    for t in range(32):
        for v in range(8):
            out[ci._fragment_to_tile(t, v)] = acc[t, v]
    want = c_tile + a_tile @ (b_tile.T if b_trans else b_tile)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_intrin_group_registers_both_layouts(dtype):
    from tvm.s_tir import TensorIntrin

    short = ci.DTYPES[dtype]
    for b_trans in (True, False):
        group = ci.intrin_group(dtype, b_trans=b_trans)
        for name in group.values():
            assert TensorIntrin.get(name, allow_missing=True) is not None, name
        assert short in group["compute"] and group["compute"].endswith("_trans_b") == b_trans


def test_intrin_group_rejects_other_dtypes():
    with pytest.raises(ValueError, match="dtype 'float32' is not one of float16, bfloat16"):
        ci.intrin_group("float32", b_trans=True)
