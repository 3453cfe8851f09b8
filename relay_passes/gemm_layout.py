"""Layout kernels merged into the kernels that read them: attention's head split and ``K^T``.

A torch attention block splits its fused ``qkv`` projection into heads with ``reshape``,
``permute_dims``, ``strided_slice`` and ``squeeze``. ``FuseOps`` makes each chain a kernel of
its own that only moves data: a ``[3, tokens, batch, features]`` copy that three slice kernels
read, and ``K^T`` as a transposing copy. Each writes and reads back the whole tensor.

:class:`FuseLayoutIntoGemm` runs between ``FuseOps`` and ``FuseTIR`` (after
:class:`.gemm_softmax.FuseGemmSoftmax`) and merges such a layout kernel into every kernel that
reads its result, when each of them is

- another layout kernel (two copies become one), or
- a bf16 GEMM kernel that reads it as its right operand ``B``, and the target's schedule takes
  the merged kernel: the GEMM's packing of ``B`` then reads the source through the layout ops
  (``schedules/cpu/bf16_matmul.py``), so ``K^T`` and the head split of ``V`` are never written.

It repeats until no layout kernel is left that all its readers can absorb. A layout kernel is a
primitive function of one parameter whose PrimFuncs are injective and only copy elements.
Merging is all or nothing per layout kernel, so the merge never leaves the copy and adds reads.
"""

from __future__ import annotations

from collections.abc import Callable

import tvm
from tvm import relax, s_tir, te, tirx
from tvm.ir import TensorLoad
from tvm.s_tir.dlight.gpu.matmul import auto_inline_producers
from tvm.sym.analyzer import Analyzer

from tvmamp.tensors import static_shape

from .bindings import use_counts
from .fused_functions import (
    INJECTIVE,
    bf16_gemm_calls,
    fused_kernel,
    merged_function,
    op_pattern,
    prim_func,
    primitive_calls,
)


def _is_copy(func: tirx.PrimFunc) -> bool:
    """Whether every block of ``func`` stores an element loaded from a buffer (no arithmetic)."""
    sch = s_tir.Schedule(func)
    blocks = [sch.get(b) for b in sch.get_child_blocks(sch.get_sblock("root"))]
    return bool(blocks) and all(
        isinstance(b.body, tirx.BufferStore) and isinstance(b.body.value, TensorLoad)
        for b in blocks
    )


def _is_layout(mod: tvm.IRModule, func: relax.Function) -> bool:
    """One parameter, one static tensor result, and only injective copies."""
    calls = primitive_calls(func)
    if not calls or len(func.params) != 1 or static_shape(func.body.body.ty) is None:
        return False
    prims = [prim_func(mod, c) for c in calls]
    return all(p is not None and (op_pattern(p) or 0) <= INJECTIVE and _is_copy(p) for p in prims)


def _composed(mod: tvm.IRModule, func: relax.Function, name: str) -> tirx.PrimFunc | None:
    """The layout function ``func`` as one copy block with simplified indices, or None.

    Inlined into one another, ``reshape``'s flattening and ``strided_slice``'s offsets leave
    nested ``//`` and ``%`` in the indices (``((b * 8 + h) * 64 + d) // 512``) that a packing
    intrinsic cannot match and a vector loop cannot stride; under the block's iterator ranges
    they simplify to the affine map they are (``qkv[s, b, h * 64 + d + 512]``).
    """
    sch = s_tir.Schedule(fused_kernel(mod, func, name))
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    auto_inline_producers(sch, blocks[-1])
    if len(sch.get_child_blocks(sch.get_sblock("root"))) != 1:
        return None
    block = sch.get(blocks[-1])
    load, out = block.body.value, block.body.buffer
    if len(block.iter_vars) != len(out.shape):
        return None  # a reshape to a scalar keeps an iterator of extent 1 for its store
    if not all(i.same_as(iv.var) for i, iv in zip(block.body.indices, block.iter_vars)):
        return None
    ranges = Analyzer()
    for iv in block.iter_vars:
        ranges.bind(iv.var, iv.dom)
    indices = [ranges.simplify(i) for i in load.indices]
    src = te.placeholder(load.source.shape, load.source.dtype, load.source.name)

    def element(*axes):
        substitute = Analyzer()
        for iv, axis in zip(block.iter_vars, axes, strict=True):
            substitute.bind(iv.var, axis)
        return src[tuple(substitute.simplify(i) for i in indices)]

    result = te.compute(out.shape, element, name=out.name)
    kernel = te.create_prim_func([src, result]).with_attr("op_pattern", INJECTIVE)
    return kernel.without_attr("global_symbol")  # private: dead once FuseTIR inlines it


def _b_param(mod: tvm.IRModule, func: relax.Function) -> relax.Var | None:
    """The parameter that ``func``'s bf16 GEMM reads as ``B``, if ``func`` computes one."""
    calls = primitive_calls(func)
    if not calls:
        return None
    gemms = bf16_gemm_calls(mod, calls)
    if len(gemms) != 1:
        return None
    b = gemms[0].args[1].fields[1]
    return b if any(b.same_as(p) for p in func.params) else None


@tvm.transform.module_pass(opt_level=0, name="tvmamp.FuseLayoutIntoGemm")
class FuseLayoutIntoGemm:
    """Merge each layout kernel into all the kernels that read it, where each can take it.

    Parameters
    ----------
    schedules : callable
        ``schedules(kernel) -> bool`` for a GEMM kernel with a layout merged into its ``B``
        (the PrimFunc ``FuseTIR`` makes of it): whether the target's bf16 GEMM schedule takes
        it. Layout kernels merged into layout kernels need no schedule check.
    """

    def __init__(self, schedules: Callable[[tirx.PrimFunc], bool]):
        self.schedules = schedules
        self._verdicts: dict = {}  # (layout, reader, index) -> (merged function, name) or None
        self._composed: set = set()  # the functions _compose_all has looked at

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Merge until no layout kernel of a non-primitive function can be merged."""
        self._verdicts, self._composed = {}, set()
        before = mod
        while True:
            mod = self._compose_all(mod)
            step = self._merge_one(mod)
            if step is None:
                break
            mod = step
        return mod if mod.same_as(before) else relax.transform.DeadCodeElimination()(mod)

    def _compose_all(self, mod: tvm.IRModule) -> tvm.IRModule:
        """``mod`` with each layout function not yet seen calling one composed copy kernel."""
        builder, changed = relax.BlockBuilder(mod), False
        for gvar, func in mod.functions_items():
            if gvar in self._composed or not isinstance(func, relax.Function):
                continue
            self._composed.add(gvar)
            if not (func.attrs and func.attrs.get("Primitive")) or not _is_layout(mod, func):
                continue
            kernel = _composed(mod, func, gvar.name_hint)
            if kernel is None:
                continue
            call = relax.call_tir(
                builder.add_func(kernel, gvar.name_hint + "_copy"),
                [func.params[0]],
                func.body.body.ty,
            )
            single = relax.BlockBuilder()
            with single.function(gvar.name_hint, list(func.params), dict(func.attrs), True):
                with single.dataflow():
                    out = single.emit_output(call)
                single.emit_func_output(out)
            builder.update_func(gvar, single.get()[gvar.name_hint])
            changed = True
        return builder.get() if changed else mod

    def _merge_one(self, mod: tvm.IRModule) -> tvm.IRModule | None:
        """``mod`` with one layout kernel merged into its readers, or None when none can be."""
        for gvar, func in mod.functions_items():
            if not isinstance(func, relax.Function) or (func.attrs and func.attrs.get("Primitive")):
                continue
            if len(func.body.blocks) != 1:
                continue
            bindings = list(func.body.blocks[0].bindings)
            uses = use_counts(func)
            for binding in bindings:
                readers = self._readers(mod, binding, bindings, uses)
                if readers is not None:
                    return self._rewrite(mod, gvar, func, binding, readers)
        return None

    def _readers(self, mod, binding, bindings, uses) -> dict | None:
        """For a layout kernel's binding whose every reader can take it: reader binding ->
        (merged function, name), else None."""
        call = binding.value
        if not isinstance(call, relax.Call) or not isinstance(call.op, tvm.ir.GlobalVar):
            return None
        layout = mod[call.op]
        if not isinstance(layout, relax.Function) or not _is_layout(mod, layout):
            return None
        readers, seen = {}, 0
        for other in bindings:
            value = other.value
            positions = [
                i for i, a in enumerate(getattr(value, "args", [])) if a.same_as(binding.var)
            ]
            if not positions:
                continue
            if len(positions) != 1 or not isinstance(value.op, tvm.ir.GlobalVar):
                return None
            merged = self._verdict(mod, call.op, value.op, positions[0])
            if merged is None:
                return None
            readers[other.var] = merged
            seen += 1
        return readers if readers and seen == uses.get(binding.var) else None

    def _verdict(self, mod, layout_gvar, reader_gvar, index: int):
        """The merged function of ``layout`` into parameter ``index`` of ``reader`` and its
        name, or None when the reader cannot take it."""
        key = (layout_gvar, reader_gvar, index)
        if key not in self._verdicts:
            layout, reader = mod[layout_gvar], mod[reader_gvar]
            verdict = None
            if isinstance(reader, relax.Function) and primitive_calls(reader):
                layout_reader = _is_layout(mod, reader)  # one copy; else B's packing gathers
                name = reader_gvar.name_hint + ("" if layout_reader else "_gather_b")
                func = merged_function(name, layout, reader, index)
                if layout_reader:
                    verdict = (func, name)
                elif reader.params[index].same_as(_b_param(mod, reader)):
                    if self.schedules(fused_kernel(mod, func, name)):
                        verdict = (func, name)
            self._verdicts[key] = verdict
        return self._verdicts[key]

    def _rewrite(self, mod, gvar, func, binding, readers) -> tvm.IRModule:
        """``mod`` with ``binding`` dropped from ``func`` and each reader calling its merge."""
        builder = relax.BlockBuilder(mod)
        source = binding.value.args[0]
        new_bindings = []
        for other in func.body.blocks[0].bindings:
            if other.var.same_as(binding.var):
                continue
            if other.var in readers:
                merged, name = readers[other.var]
                target = builder.add_func(merged, name)
                value = other.value
                args = [source if a.same_as(binding.var) else a for a in value.args]
                other = relax.VarBinding(other.var, relax.Call(target, args))
            new_bindings.append(other)
        block = relax.DataflowBlock(new_bindings)
        body = relax.SeqExpr([block], func.body.body)
        new = relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)
        builder.update_func(gvar, new)
        return builder.get()


__all__ = ["FuseLayoutIntoGemm"]
