"""Passes that move the bf16 rules' packing out of the kernels (weights: to compile time)."""

from __future__ import annotations

import tvm
from tvm import relax, s_tir, tirx

from .cpu_bf16_common import PREPROC, PREPROC_ACTIVATION, root_blocks


@tvm.transform.module_pass(opt_level=0, name="tvmamp.SplitPreproc")
class SplitPreproc:
    """Split the blocks marked by the bf16 rules into their own functions; fold the weight ones.

    Round one splits the weight packing (:data:`PREPROC`) and folds it with ``FoldConstant``
    where the weight is a constant, so the pair-interleaved weight is computed once, at compile
    time. Round two splits the activation copies (:data:`PREPROC_ACTIVATION`: padded or
    transposed left operands), which run on every call. Run it after the schedule rules.
    """

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Split, fold, then split the activation pre-processing."""
        mod = relax.transform.SplitLayoutRewritePreproc()(mod)
        mod = relax.transform.FoldConstant()(mod)
        mod = _promote_activation_marks(mod)
        mod = relax.transform.SplitLayoutRewritePreproc()(mod)
        return relax.transform.DeadCodeElimination()(mod)


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
    if not updates:
        return mod
    mod = mod.shallow_copy() if hasattr(mod, "shallow_copy") else tvm.IRModule(mod.functions)
    for gvar, func in updates.items():
        mod[gvar] = func
    return mod
