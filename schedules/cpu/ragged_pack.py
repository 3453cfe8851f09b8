"""The pair-interleaving weight pack for a ``B[K, J]`` whose ``K`` is odd or ``J`` not whole tiles.

:func:`.bf16_passes.tensorize_packs` tensorizes the :data:`.bf16_common.PACK_PAIRS` block of a
split-out packing function with a helper that interleaves two rows of 32 columns. A padded
weight (attention's ``V`` over 197 tokens, a run-time ``W`` of 50257 columns) reads behind a
guard (``if_then_else(k < K, B[k, j], 0)``) that the intrinsic cannot match, and the block was
left to a vectorised gather: 13 % of the memory peak for ViT's ``V``, and a 128 x 384 x 50257
GEMM with ``W`` at run time at 0.47x torch.

:func:`ragged_pack` writes the function anew: the helper on every whole 2 x 32 tile, then the
ragged rows and columns, and the zeros of the padding, by scalar loops. The guard is the only
difference, so it gives the same values.
"""

from __future__ import annotations

from tvm import DataType, s_tir, tirx
from tvm.ir import TensorLoad
from tvm.ir.expr import Call
from tvm.script import tirx as T

from .bf16_common import pack_pairs_intrin, pack_pairs_name
from .common import param_buffers, static_extent

_PAIR, _TILE = 2, 32


def ragged_pack(sch: s_tir.Schedule, block: s_tir.schedule.SBlockRV, native: bool):
    """The packing function of ``sch`` (one :data:`PACK_PAIRS` block, ``block``) with whole
    tiles through the helper, or None when it is not ``D = guard(B[s, k, j])`` from a compact
    ``B[S, K, J]`` or ``B[K, J]`` of bf16 or fp32."""
    stmt = sch.get(block)
    params = param_buffers(sch)
    if len(params) != 2 or len(stmt.reads) != 1 or len(stmt.writes) != 1:
        return None
    src, dst = stmt.reads[0].source, stmt.writes[0].source
    if not (src.same_as(params[0]) and dst.same_as(params[1])):
        return None
    shape = _plain_shape(stmt, src)
    if shape is None:
        return None
    if len(shape) == 2:
        shape = [1, *shape]
    batch, rows, cols = shape
    d_shape = [int(e) for e in dst.shape]
    if len(d_shape) != 5 or d_shape[0] != batch or d_shape[3:] != [16, _PAIR]:
        return None
    src_dtype = str(src.dtype)
    if src_dtype not in ("bfloat16", "float32") or str(dst.dtype) != "bfloat16":
        return None
    padded_cols, padded_rows = d_shape[1] * 16, d_shape[2] * _PAIR
    if padded_cols % _TILE or padded_cols < cols or padded_rows < rows:
        return None
    loops = sch.get_loops(block)
    parallel = bool(loops) and sch.get(loops[0]).kind == tirx.ForKind.PARALLEL
    return _build(
        src, dst, batch, rows, cols, padded_rows, padded_cols, src_dtype, native, parallel
    )


def _plain_shape(stmt, src) -> list[int] | None:
    """The shape ``[S, K, J]`` or ``[K, J]`` of ``src`` when the block stores
    ``guard(src[s, k, j])`` (or ``src[k, j]``, maybe cast) at its iterators ``(s, j, k)``;
    leading unit axes read at 0 (attention's ``V`` of ``[1, heads, tokens, dim]``) are dropped.
    None otherwise."""
    iters = [iv.var for iv in stmt.iter_vars]
    store = stmt.body
    if len(iters) != 3 or not isinstance(store, tirx.BufferStore):
        return None
    value = store.value
    if isinstance(value, Call) and getattr(value.op, "name", "") == "prim.if_then_else":
        value = value.args[1]
    if isinstance(value, tirx.Cast):
        value = value.value
    if not isinstance(value, TensorLoad) or not value.source.same_as(src):
        return None
    indices, shape = list(value.indices), [int(e) for e in src.shape]
    while len(indices) > 2 and shape[0] == 1 and static_extent(indices[0]) == 0:
        indices, shape = indices[1:], shape[1:]
    s, j, k = iters
    wanted = [s, k, j] if len(indices) == 3 else [k, j]
    plain = len(indices) == len(wanted) and all(
        isinstance(i, tirx.Var) and i.same_as(w) for i, w in zip(indices, wanted)
    )
    return shape if plain else None


def _build(src, dst, batch, rows, cols, padded_rows, padded_cols, src_dtype, native, parallel):
    """The new packing function; see the module docstring."""
    _, llvm_ir = pack_pairs_intrin(src_dtype, native)
    function = pack_pairs_name(src_dtype == "float32", native)
    whole_pairs, whole_tiles = rows // _PAIR, cols // _TILE
    ldd = padded_rows // _PAIR * 16 * _PAIR * 2  # bytes between 16-column panels of D
    lds = cols * (DataType(src_dtype).bits // 8)  # bytes between rows of B
    pairs = padded_rows // _PAIR
    outer = T.parallel if parallel and batch * whole_tiles > 1 else T.serial
    rounds = src_dtype != "bfloat16"
    tile_cols = whole_tiles * _TILE
    per = max(whole_tiles, 1)  # whole tiles per batch (the loop runs 0 times when there are 0)

    @T.prim_func(private=True, s_tir=True)
    def pack(b: T.handle, d: T.handle):
        T.func_attr({"tirx.noalias": True, "tirx.is_scheduled": True})
        B_in = T.match_buffer(b, src.shape, src_dtype)
        D = T.match_buffer(d, dst.shape, "bfloat16")
        with T.sblock("root"):
            B = T.decl_buffer((batch, rows, cols), src_dtype, data=B_in.data)
            # every whole 2 x 32 tile through the helper
            for st in outer(batch * whole_tiles, annotations={"pragma_import_llvm": llvm_ir}):
                for pair in range(whole_pairs):
                    T.evaluate(
                        T.call_extern(
                            "void",
                            function,
                            T.address_of(D[st // per, st % per * 2, pair, 0, 0]),
                            T.int64(ldd),
                            T.address_of(B[st // per, pair * _PAIR, st % per * _TILE]),
                            T.int64(lds),
                        )
                    )
            # the last pair of rows (K odd, or padded further) across every column
            for s, c, p in T.grid(batch, padded_cols, pairs - whole_pairs):
                for h in range(_PAIR):
                    D[s, c // 16, whole_pairs + p, c % 16, h] = T.if_then_else(
                        T.And(c < cols, (whole_pairs + p) * _PAIR + h < rows),
                        _load(B, s, (whole_pairs + p) * _PAIR + h, c, rounds),
                        T.bfloat16(0),
                    )
            # the columns after the last whole tile, in the whole pairs of rows
            for s, c, p in T.grid(batch, padded_cols - tile_cols, whole_pairs):
                for h in range(_PAIR):
                    D[s, (tile_cols + c) // 16, p, (tile_cols + c) % 16, h] = T.if_then_else(
                        tile_cols + c < cols,
                        _load(B, s, p * _PAIR + h, tile_cols + c, rounds),
                        T.bfloat16(0),
                    )

    return pack


def _load(buffer, s, k, j, rounds: bool):
    """``buffer[s, k, j]`` as bf16."""
    value = buffer[s, k, j]
    return T.Cast("bfloat16", value) if rounds else value


__all__ = ["ragged_pack"]
