"""Software prefetch of a GEMM's next weight strip, placed when the kernel is lowered.

The bf16 and fp16 GEMMs (:mod:`.bf16_matmul`, :mod:`.fp16_matmul`) walk one strip of the
packed weight (``K`` x the register tile's columns) once per row tile. The first walk reads the
strip from L3 or memory and the others from L2, so the first row tile of every strip waits on
memory. In a model whose weights do not all stay in cache between calls that wait is about 6 %
of the bf16 GEMM (SimpleNet's nine 1024 x 1024 layers: 1.17 ms a layer against 1.10 ms when
one weight is reused); the fp16 kernel, bound by the fp32 FMA rate, gains about 2 %. A software
prefetch of the *next* strip, spread over the row tiles of the current one, hides it.

No schedule primitive places a prefetch, and an annotation whose value holds loop variables
would go stale when meta_schedule replays a trace on a fresh schedule. So :func:`mark` tags the
tensorized update block with plain integers, and :data:`inject_prefetch`, a TIR pass at the
start of the CPU lowering pipeline (:mod:`tvmamp.targets.llvm_lowering`), derives the rest
from the block's read region and the loops around it:

* the *step* along the strip is the binding of the block's reduction iterator, and the strip
  loops are the loops it reads (the fp16 kernel splits its reduction in two);
* the *pass* loop is the innermost loop outside the strip loops, of more than one iteration,
  that does not appear in the read index: each of its iterations walks the same strip again.
  Its ``P`` iterations share the prefetch: iteration ``r`` fetches the lines of the steps ``k``
  with ``k % P == r``, so the fetches are spread evenly over the whole strip. A symbolic ``P``
  (the row tiles of a dynamic batch) would put a division in the innermost loop, so there
  iteration ``r`` fetches the steps with ``r * K <= k * P < (r + 1) * K`` (``K`` steps in all):
  the ``r``-th of ``P`` consecutive runs of the strip;
* loops inside the outer strip loop that do not appear in the read index (the rows of the
  register tile) fetch only in their first iteration.

A block with no such pass loop (a GEMV walks each strip once, and the hardware prefetcher
follows a single walk) gets no prefetch. The index is clamped to the buffer, so the last strip
fetches its own last panel instead of reading past the end.
"""

from __future__ import annotations

import tvm_ffi
from tvm import s_tir, tirx
from tvm.s_tir.schedule import SBlockRV
from tvm.tirx.analysis import undefined_vars

from .common import static_extent

# The block annotation: [read index, axis, panels ahead] (plain integers, trace-safe).
KEY = "tvmamp.prefetch_next_strip"
# llvm.prefetch arguments: a read (0), locality 2 (prefetcht1: into L2), data cache (1).
_READ, _L2, _DATA = 0, 2, 1


def mark(sch: s_tir.Schedule, block: SBlockRV, buffer: tirx.Buffer, axis: int, ahead: int):
    """Ask for a prefetch of ``buffer``, a read of ``block``, ``ahead`` steps further on ``axis``
    (for the GEMM: the packed weight, ``ahead`` panels on the panel axis, one strip on)."""
    reads = sch.get(block).reads
    index = next(i for i, read in enumerate(reads) if read.source.same_as(buffer))
    sch.annotate(block, KEY, [index, axis, ahead])


@tirx.transform.prim_func_pass(opt_level=0, name="tvmamp.InjectStripPrefetch")
def inject_prefetch(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
    """Put the prefetch :func:`mark` asked for in front of each marked block."""
    loops: list[tirx.For] = []

    def on_for(loop, mutator):
        loops.append(loop)
        try:
            return mutator.default_mutate(loop)
        finally:
            loops.pop()

    def on_realize(realize, mutator):
        info = realize.block.annotations.get(KEY)
        if info is None:
            return mutator.default_mutate(realize)
        fetch = _prefetch(realize, loops, *(int(v) for v in info))
        return realize if fetch is None else tirx.SeqStmt([fetch, realize])

    body = tvm_ffi.structural_mutate(
        func.body, [(tirx.For, on_for), (s_tir.SBlockRealize, on_realize)]
    )
    return func if body.same_as(func.body) else func.with_body(body)


def _prefetch(
    realize: s_tir.SBlockRealize, loops: list[tirx.For], read: int, axis: int, ahead: int
) -> tirx.Stmt | None:
    """The guarded prefetch for one marked block inside ``loops``, or None (no pass loop)."""
    block = realize.block
    bindings = dict(zip((iv.var for iv in block.iter_vars), realize.iter_values, strict=True))
    region = block.reads[read]
    index = [_substitute(r.min, bindings) for r in region.region]
    used = set().union(*(undefined_vars(e) for e in index))
    steps = [  # the step along the strip: the binding of the reduction iterator
        value
        for iv, value in zip(block.iter_vars, realize.iter_values, strict=True)
        if iv.iter_type == tirx.IterVar.CommReduce
    ]
    reduced = set().union(*(undefined_vars(step) for step in steps))
    strip = next((p for p, loop in enumerate(loops) if loop.loop_var in reduced), None)
    if strip is None or len(steps) != 1:
        return None
    passes = [loop for loop in loops[:strip] if loop.loop_var not in used and _more_than_once(loop)]
    if not passes:
        return None
    walk = passes[-1]
    step, count, total = steps[0], _count(walk), _reduce_extent(block)
    if static_extent(walk.extent) is not None:
        conditions = [tirx.floormod(step, walk.extent) == count]
    else:  # no division per step: pass r takes the r-th of P runs of the strip
        at = step * walk.extent
        conditions = [count * total <= at, at < (count + 1) * total]
    conditions += [_count(loop) == 0 for loop in loops[strip + 1 :] if loop.loop_var not in used]
    last = region.source.shape[axis] - 1
    index[axis] = tirx.min(index[axis] + ahead, last)
    address = tirx.address_of(tirx.BufferLoad(region.source, index))
    fetch = tirx.call_llvm_intrin("void", "llvm.prefetch.p0", address, _READ, _L2, _DATA)
    return tirx.IfThenElse(tirx.all(*conditions), tirx.Evaluate(fetch), None)


def _more_than_once(loop: tirx.For) -> bool:
    """Whether ``loop`` may run more than one iteration (a symbolic extent may)."""
    extent = static_extent(loop.extent)
    return extent is None or extent > 1


def _reduce_extent(block: s_tir.SBlock) -> tirx.PrimExpr:
    """The number of steps along the strip: the extent of the block's reduction iterator."""
    (extent,) = [iv.dom.extent for iv in block.iter_vars if iv.iter_type == tirx.IterVar.CommReduce]
    return extent


def _count(loop: tirx.For) -> tirx.PrimExpr:
    """The iteration number of ``loop``: its variable less its start."""
    return loop.loop_var if static_extent(loop.min) == 0 else loop.loop_var - loop.min


def _substitute(expr: tirx.PrimExpr, bindings: dict) -> tirx.PrimExpr:
    return tvm_ffi.structural_map(expr, [(tirx.Var, lambda v: bindings.get(v, v))])
