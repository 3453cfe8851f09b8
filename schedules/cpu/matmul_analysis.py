"""Recognise gemm-like blocks and map them onto ``C[S, I, J] += A[S, I, K] * B[S, J, K]``."""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.dlight.gpu.matmul import (
    IterKind,
    IterTrait,
    auto_inline_producers,
    get_reduction_blocks,
    make_iter_fusion_index_map,
)
from tvm.s_tir.schedule import SBlockRV, ScheduleError
from tvm.tirx.analysis import undefined_vars

_S, _I, _J, _K = IterKind.kIter_S, IterKind.kIter_I, IterKind.kIter_J, IterKind.kIter_K
_T = IterKind.kIter_T


def find_matmul_block(sch: s_tir.Schedule, keep_gathers: bool = False) -> SBlockRV | None:
    """Return the single gemm-like reduction block of ``sch``, or ``None``.

    Spatial producers of the block (casts, transposes) are inlined into it first. With
    ``keep_gathers``, a producer whose inlining would leave the block no gemm (a layout chain
    that reads ``qkv[tokens, batch, h * dim + d]``) stays a producer instead, for the rule to
    inline into its operand copy or packing.
    """
    blocks = sch.get_child_blocks(get_root_block(sch))
    reductions = get_reduction_blocks(sch, blocks)
    if reductions is None:
        return None
    main = reductions[0]
    try:
        if keep_gathers:
            _inline_einsum_producers(sch, main)
        else:
            auto_inline_producers(sch, main)
    except ScheduleError:
        return None
    if iter_kinds(sch.get(main)) is None:
        return None
    return main


def _inline_einsum_producers(sch: s_tir.Schedule, main: SBlockRV) -> None:
    """Inline each producer of ``main`` whose inlining keeps ``main`` a gemm, until none."""
    inlined = True
    while inlined:
        inlined = False
        for producer in sch.get_producers(main):
            trial = sch.copy()
            try:
                trial.compute_inline(producer)
            except ScheduleError:
                continue
            if iter_kinds(trial.get(main)) is not None:
                sch.compute_inline(producer)
                inlined = True
                break


def _is_one(expr: tirx.PrimExpr) -> bool:
    return isinstance(expr, tirx.IntImm) and expr.value == 1


def _is_einsum_index(expr: tirx.PrimExpr) -> bool:
    """Return whether ``expr`` is a bare iterator or a constant (not ``y + ky`` as in conv).

    A constant may be an unsimplified expression: a slice from index 1 inlined at index 0
    reads ``x[0 + 1, ...]`` (a decoder's values, ``present[1]``)."""
    return isinstance(expr, (tirx.Var, tirx.IntImm)) or not undefined_vars(expr)


def _region_vars(region) -> set[tirx.Var]:
    return {var for rng in region for var in undefined_vars(rng.min)}


def _classify(spatial: bool, in_a: bool, in_b: bool, in_c: bool) -> IterKind | None:
    """Return the gemm role of an iterator from where it appears, or ``None``."""
    if spatial and in_c:
        roles = {(True, True): _S, (True, False): _I, (False, True): _J}
        return roles.get((in_a, in_b))
    if not spatial and in_a and in_b and not in_c:
        return _K
    return None


def iter_kinds(block: s_tir.SBlock) -> dict[tirx.Var, IterKind] | None:
    """Classify the iterators of a gemm-like block; the ``I`` axis may be absent (GEMV).

    Parameters
    ----------
    block : s_tir.SBlock
        A reduction block that reads two buffers and writes one, each index a bare iterator
        or a constant.

    Returns
    -------
    kinds : dict[tirx.Var, IterKind] | None
        The role of each block iterator, or ``None`` when the block is not gemm-like
        (it must have at least one ``J`` and one ``K`` iterator).
    """
    if len(block.reads) != 2 or len(block.writes) != 1:
        return None
    regions = (block.reads[0].region, block.reads[1].region, block.writes[0].region)
    ranges = [rng for region in regions for rng in region]
    if not all(_is_one(rng.extent) and _is_einsum_index(rng.min) for rng in ranges):
        return None
    a_vars, b_vars, c_vars = (_region_vars(region) for region in regions)
    kinds = {}
    for iv in block.iter_vars:
        var = iv.var
        spatial = iv.iter_type == tirx.IterVar.DataPar
        kind = _classify(spatial, var in a_vars, var in b_vars, var in c_vars)
        kinds[var] = _T if _is_one(iv.dom.extent) else kind
        if kinds[var] is None:
            return None
    if not {_J, _K} <= set(kinds.values()):
        return None
    return kinds


def index_maps(block: s_tir.SBlock) -> tuple[tirx.IndexMap, ...]:
    """Return the block, ``A``, ``B`` and ``C`` index maps onto ``[S, I, J, K]`` coordinates.

    ``block`` must satisfy :func:`iter_kinds`; a missing ``I`` axis becomes a unit axis.
    """
    kinds = iter_kinds(block)
    orders = ([_S, _I, _J, _K], [_S, _I, _K], [_S, _J, _K], [_S, _I, _J])
    used_vars = (set(kinds), *(_region_vars(buf.region) for buf in (*block.reads, *block.writes)))
    maps = []
    for order, used in zip(orders, used_vars, strict=True):
        iters = [iv for iv in block.iter_vars if iv.var in used]
        traits = [IterTrait(kinds[iv.var], iv.dom.extent) for iv in iters]
        maps.append(make_iter_fusion_index_map(traits, order))
    return tuple(maps)


def b_is_k_contiguous(block: s_tir.SBlock) -> bool:
    """Return whether ``B``'s innermost index is a reduction axis (a "dense" weight ``[N, K]``)."""
    kinds = iter_kinds(block)
    innermost = _region_vars(block.reads[1].region[-1:])
    return any(kinds.get(var) == _K for var in innermost)


def normalize(sch: s_tir.Schedule, main: SBlockRV) -> tuple[SBlockRV, SBlockRV]:
    """Rewrite ``main`` in place into ``C[S, I, J] += A[S, I, K] * B[S, J, K]``.

    Returns
    -------
    producers : tuple[SBlockRV, SBlockRV]
        The reindex blocks that write the ``[S, I, K]`` copy of ``A`` and ``[S, J, K]`` of ``B``.
    """
    reindex_a = sch.reindex(main, ("read", 0))
    reindex_b = sch.reindex(main, ("read", 1))
    reindex_c = sch.reindex(main, ("write", 0))
    block_map, a_map, b_map, c_map = index_maps(sch.get(main))
    sch.transform_layout(reindex_a, ("write", 0), a_map)
    sch.transform_layout(reindex_b, ("write", 0), b_map)
    sch.transform_layout(reindex_c, ("read", 0), c_map)
    sch.transform_block_layout(main, block_map)
    return reindex_a, reindex_b
