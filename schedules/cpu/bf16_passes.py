"""Passes that move the bf16 rules' packing out of the kernels (weights: to compile time)."""

from __future__ import annotations

import tvm
from tvm import relax, s_tir, tirx
from tvm.ir.expr import Constant

from .bf16_common import (
    PACK_PAIRS,
    PACK_PAIRS_T,
    PREPROC,
    PREPROC_ACTIVATION,
    pack_pairs_intrin,
    pack_pairs_t_intrin,
    root_blocks,
)
from .ragged_pack import ragged_pack


@tvm.transform.module_pass(opt_level=0, name="tvmamp.SplitPreproc")
class SplitPreproc:
    """Split the blocks marked by the bf16 rules into their own functions; fold the weight ones.

    Round one splits the weight packing (:data:`PREPROC`) and folds it with ``FoldConstant``
    where the weight is a constant, so the pair-interleaved weight is computed once, at compile
    time; before folding, :func:`tensorize_packs` tensorizes the packing loops. Round two
    splits the activation copies (:data:`PREPROC_ACTIVATION`: padded, transposed or
    tile-packed left operands), which run on every call. Run it after the schedule rules.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Split, fold, then split the activation pre-processing."""
        mod = _split_marked(mod)
        mod = tensorize_packs(mod)
        mod = relax.transform.FoldConstant()(mod)
        mod = _promote_activation_marks(mod)
        mod = _split_marked(mod)
        return relax.transform.DeadCodeElimination()(mod)


def _split_marked(mod: tvm.IRModule) -> tvm.IRModule:
    """``SplitLayoutRewritePreproc`` on the PrimFuncs with a :data:`PREPROC` block only.

    TVM's pass visits every PrimFunc and aborts on one whose root holds no block at all (the
    generic ``cumsum`` kernel is bare loops), so the others are set aside while it runs; it
    rewrites only the Relax calls of the functions it splits.
    """
    aside = {
        gvar: func
        for gvar, func in mod.functions_items()
        if isinstance(func, tirx.PrimFunc) and not _has_preproc(func)
    }
    if len(aside) == sum(isinstance(f, tirx.PrimFunc) for _, f in mod.functions_items()):
        return mod
    kept = {gvar: func for gvar, func in mod.functions_items() if gvar not in aside}
    split = relax.transform.SplitLayoutRewritePreproc()(tvm.IRModule(kept, attrs=mod.attrs))
    functions = dict(split.functions_items())
    functions.update(aside)
    return tvm.IRModule(functions, attrs=split.attrs, global_infos=split.global_infos)


def _has_preproc(func: tirx.PrimFunc) -> bool:
    sch = s_tir.Schedule(func)
    return any(PREPROC in sch.get(block).annotations for block in root_blocks(sch))


def tensorize_packs(mod: tvm.IRModule) -> tvm.IRModule:
    """Tensorize the :data:`PACK_PAIRS` blocks of every function (vectorise where it fails).

    The intrinsic does not match a padded weight (its reads are guarded): a ``[K, J]`` weight
    alone in its function is then packed by :func:`.ragged_pack.ragged_pack` (the intrinsic on
    the whole tiles), any other block gets the vectorised gather.
    """
    updates = {}
    folded = _folded_functions(mod)
    for gvar, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            sch = s_tir.Schedule(func)
            marked = _marked_packs(sch)
            native = gvar not in folded
            for block, mark in marked:
                if _tensorize_pack(sch, block, mark, native):
                    continue
                # a padded weight: its guard keeps the intrinsic off every tile
                alone = mark == PACK_PAIRS and len(marked) == 1
                ragged = ragged_pack(sch, block, native) if alone else None
                if ragged is not None:
                    sch = s_tir.Schedule(ragged.with_attrs(func.attrs))
                    break
                _vectorize_pack(sch, block, mark)
            if marked:
                updates[gvar] = sch.mod["main"]
    return _with_functions(mod, updates)


def _marked_packs(sch: s_tir.Schedule) -> list:
    """``(block, mark)`` of each root block of ``sch`` marked :data:`PACK_PAIRS` or
    :data:`PACK_PAIRS_T`."""
    return [
        (block, mark)
        for block in root_blocks(sch)
        for mark in (PACK_PAIRS, PACK_PAIRS_T)
        if mark in sch.get(block).annotations
    ]


def packs_take_intrinsics(func: tirx.PrimFunc) -> bool:
    """Whether the scheduled ``func`` packs ``B`` in marked blocks and each takes its packing
    intrinsic (no vector gather per pair row; an unmarked pack of ragged panels is one)."""
    sch = s_tir.Schedule(func)
    marked = _marked_packs(sch)
    return bool(marked) and all(_tensorize_pack(sch, block, mark) for block, mark in marked)


def _folded_functions(mod: tvm.IRModule) -> set:
    """The PrimFuncs that ``FoldConstant`` will evaluate: those with a call (``call_tir``)
    whose arguments are constants, or the results of such calls (it folds them in order)."""
    folded, known = set(), set()
    for _, func in mod.functions_items():
        if not isinstance(func, relax.Function) or not isinstance(func.body, relax.SeqExpr):
            continue
        for binding in (b for block in func.body.blocks for b in block.bindings):
            value = binding.value
            if isinstance(value, relax.Var) and value in known:
                known.add(binding.var)
            if not (isinstance(value, relax.Call) and value.op == _CALL_TIR):
                continue
            args = value.args[1].fields if isinstance(value.args[1], relax.Tuple) else []
            if all(isinstance(a, Constant) or a in known for a in args):
                folded.add(value.args[0])
                known.add(binding.var)
    return folded


_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


def _tensorize_pack(sch: s_tir.Schedule, block, mark: str, native: bool = True) -> bool:
    """Tensorize one marked packing block at its two innermost loops; return whether it took.

    :data:`PACK_PAIRS` blocks have ``(32, 2)`` inner loops, :data:`PACK_PAIRS_T` blocks
    ``(16, 32)``; each has a variant that reads a bf16 ``B`` and one that reads fp32 and rounds
    (a run-time fp32 weight whose cast the GEMM kernel absorbed): with ``vcvtneps2bf16`` when
    ``native``, else with integer arithmetic, for a function that ``FoldConstant`` evaluates
    (it builds for a plain "llvm" target, which has no such instruction).
    """
    loops = sch.get_loops(block)
    make = pack_pairs_intrin if mark == PACK_PAIRS else pack_pairs_t_intrin
    rows = 2 if mark == PACK_PAIRS else 16  # the tile's rows in B's source
    for src in ("bfloat16", "float32"):
        try:
            trial = sch.copy()  # a failed tensorize must leave no trace in ``sch``
            tile = trial.blockize(trial.get_loops(block)[-2])
            intrin, llvm_ir = make(src, native, _tile_region(trial.get(tile), rows))
            trial.tensorize(tile, intrin)
        except s_tir.schedule.ScheduleError:
            continue
        sch.unannotate(block, mark)
        sch.tensorize(sch.blockize(loops[-2]), intrin)
        sch.annotate(loops[0], "pragma_import_llvm", llvm_ir)
        return True
    return False


def _tile_region(tile: s_tir.SBlock, rows: int) -> tuple[int, ...]:
    """The shape of the source tile a blockized packing step reads, where its source has more
    than two axes (a weight read through layout ops: ``qkv[tokens, batch, features]``) and the
    tile is ``rows`` x 32 between unit axes, else ``()``: the intrinsics' two-axis tile."""
    extents = [r.extent for r in tile.reads[0].region] if len(tile.reads) == 1 else []
    if len(extents) <= 2 or not all(isinstance(e, tirx.IntImm) for e in extents):
        return ()
    shape = tuple(int(e) for e in extents)
    return shape if [e for e in shape if e != 1] == [rows, 32] else ()


def _vectorize_pack(sch: s_tir.Schedule, block, mark: str) -> None:
    """Vectorise the two innermost loops of a packing block the intrinsic did not take."""
    sch.unannotate(block, mark)
    loops = sch.get_loops(block)
    if mark == PACK_PAIRS:
        sch.vectorize(sch.fuse(*loops[-2:]))
    else:
        sch.vectorize(loops[-1])


def _promote_activation_marks(mod: tvm.IRModule) -> tvm.IRModule:
    """Turn the :data:`PREPROC_ACTIVATION` marks into :data:`PREPROC` marks."""
    updates = {}
    for gvar, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        sch = s_tir.Schedule(func)
        marked = [b for b in root_blocks(sch) if PREPROC_ACTIVATION in sch.get(b).annotations]
        for block in marked:
            sch.unannotate(block, PREPROC_ACTIVATION)
            sch.annotate(block, PREPROC, True)
        if marked:
            updates[gvar] = sch.mod["main"]
    return _with_functions(mod, updates)


def _with_functions(mod: tvm.IRModule, updates: dict) -> tvm.IRModule:
    """Return ``mod`` with the functions in ``updates`` replaced."""
    if not updates:
        return mod
    mod = mod.shallow_copy() if hasattr(mod, "shallow_copy") else tvm.IRModule(mod.functions)
    for gvar, func in updates.items():
        mod[gvar] = func
    return mod
