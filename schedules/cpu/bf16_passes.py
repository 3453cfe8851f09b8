"""Passes that move the bf16 rules' packing out of the kernels (weights: to compile time)."""

from __future__ import annotations

import tvm
from tvm import relax, s_tir, tirx

from .bf16_common import (
    PACK_PAIRS,
    PACK_PAIRS_LLVM_IR,
    PACK_PAIRS_T,
    PREPROC,
    PREPROC_ACTIVATION,
    pack_pairs_intrin,
    pack_pairs_t_intrin,
    root_blocks,
)


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

    The intrinsic does not match a padded weight (its reads are guarded) or a ``[J, K]``
    weight; those blocks get the vectorised gather instead.
    """
    updates = {}
    for gvar, func in mod.functions_items():
        if isinstance(func, tirx.PrimFunc):
            sch = s_tir.Schedule(func)
            marked = [b for b in root_blocks(sch) if PACK_PAIRS in sch.get(b).annotations]
            for block in marked:
                _tensorize_pack(sch, block)
            transposed = [b for b in root_blocks(sch) if PACK_PAIRS_T in sch.get(b).annotations]
            for block in transposed:
                _tensorize_pack_t(sch, block)
            marked += transposed
            if marked:
                updates[gvar] = sch.mod["main"]
    return _with_functions(mod, updates)


def _tensorize_pack(sch: s_tir.Schedule, block) -> None:
    """Tensorize one marked packing block at its ``(32, 2)`` loops, else vectorise them."""
    sch.unannotate(block, PACK_PAIRS)
    loops = sch.get_loops(block)
    try:
        trial = sch.copy()  # a failed tensorize must leave no trace in ``sch``
        trial.tensorize(trial.blockize(loops[-2]), pack_pairs_intrin())
    except s_tir.schedule.ScheduleError:
        sch.vectorize(sch.fuse(*loops[-2:]))
        return
    sch.tensorize(sch.blockize(loops[-2]), pack_pairs_intrin())
    sch.annotate(loops[0], "pragma_import_llvm", PACK_PAIRS_LLVM_IR)


def _tensorize_pack_t(sch: s_tir.Schedule, block) -> None:
    """Tensorize one :data:`PACK_PAIRS_T` block at its ``(16, 32)`` loops, else vectorise."""
    sch.unannotate(block, PACK_PAIRS_T)
    loops = sch.get_loops(block)
    intrin, llvm_ir = pack_pairs_t_intrin()
    try:
        trial = sch.copy()  # a failed tensorize must leave no trace in ``sch``
        trial.tensorize(trial.blockize(loops[-2]), intrin)
    except s_tir.schedule.ScheduleError:
        sch.vectorize(loops[-1])
        return
    sch.tensorize(sch.blockize(loops[-2]), intrin)
    sch.annotate(loops[0], "pragma_import_llvm", llvm_ir)


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
