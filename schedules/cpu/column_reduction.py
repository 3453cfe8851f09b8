"""Column reductions on the CPU: ``O[j] = sum_r A[r, j]`` (bias gradients, ``collapse_sum``).

A reduction over the *leading* axes of its input reads the innermost axis, which the output
keeps. TVM's ``dlight.cpu.Reduction`` walks each output element down its column (a strided
scalar loop: 2.5 ns per element for a training step's bias gradient). Here the reduction loop
is outside and the kept axis inside, split into SIMD vectors: every input row is read once,
contiguously, and added to a vector of the output, which stays in cache.
"""

from __future__ import annotations

from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.target import Target
from tvm.tirx.analysis import undefined_vars

from .common import (
    CPURule,
    is_reduction,
    largest_divisor,
    nominal,
    static_but_batch,
    try_inline_all,
    use_parallel,
    vector_lanes,
)


class CPUColumnReduction(CPURule):
    """One reduction block whose kept (spatial) iterators index the innermost input axes.

    Injective producers (casts) are inlined into it and injective consumers into its output
    (an epilogue that cannot be, such as the division of a mean, stays a loop of its own); the
    leading axis may be symbolic (a dynamic batch). The innermost kept loop is split by a
    divisor of its extent that fits the SIMD width and unrolled inside the reduction loops
    (LLVM makes it one vector add), and the outer kept loops run in parallel when the target
    has several cores and the work is large enough.
    """

    def takes_shapes(self, sch: s_tir.Schedule) -> bool:
        """Static shapes, or a symbolic leading axis (a dynamic batch): the kept innermost
        axis and the reduction must be static."""
        return static_but_batch(sch)

    def apply(  # pylint: disable=missing-function-docstring
        self, func: tirx.PrimFunc, target: Target, _: bool
    ) -> s_tir.Schedule | None:
        return self.schedule_whole(func, target, _schedule)


def _column_reduction(sch: s_tir.Schedule) -> s_tir.schedule.SBlockRV | None:
    """The single reduction block of ``sch`` after inlining its injective neighbours."""
    blocks = sch.get_child_blocks(get_root_block(sch))
    reductions = [b for b in blocks if is_reduction(sch.get(b))]
    if len(reductions) != 1:
        return None
    (main,) = reductions
    rest = try_inline_all(sch, [b for b in blocks if not sch.get(b).same_as(sch.get(main))])
    # a reduction's result cannot be inlined into its consumer: an epilogue of the kept values
    # (the division of a mean) stays a loop of its own over the small output
    output = sch.get(main).writes[0].source
    if any(not _reads_only(sch.get(b), output) for b in rest):
        return None
    stmt = sch.get(main)
    if len(stmt.reads) != 1 or len(stmt.writes) != 1:
        return None
    spatial = [iv.var for iv in stmt.iter_vars if iv.iter_type == tirx.IterVar.DataPar]
    region = stmt.reads[0].region
    if not spatial or not region:
        return None
    inner = undefined_vars(region[-1].min)
    # the innermost input index is exactly the innermost kept iterator: a column reduction
    return main if len(inner) == 1 and inner[0].same_as(spatial[-1]) else None


def _reads_only(block: s_tir.SBlock, buffer: tirx.Buffer) -> bool:
    """Whether ``block`` is an epilogue of ``buffer``: it reads that buffer and nothing it has
    to wait on but it, writing each element from the same element (no reduction)."""
    return (
        not is_reduction(block)
        and any(read.source.same_as(buffer) for read in block.reads)
        and len(block.writes) == 1
    )


def _schedule(sch: s_tir.Schedule, target: Target) -> bool:
    main = _column_reduction(sch)
    if main is None:
        return False
    stmt = sch.get(main)
    kinds = [iv.iter_type == tirx.IterVar.DataPar for iv in stmt.iter_vars]
    loops = sch.get_loops(main)
    if len(loops) != len(kinds):
        return False
    spatial = [loop for loop, s in zip(loops, kinds, strict=True) if s]
    reduce = [loop for loop, s in zip(loops, kinds, strict=True) if not s]
    extent = int(sch.get(spatial[-1]).extent)
    dtype = str(stmt.writes[0].source.dtype)
    lanes = vector_lanes(target, "float32" if dtype == "bfloat16" else dtype)
    width = largest_divisor(extent, lanes)
    if width < 4:
        return False
    outer_j, vec = sch.split(spatial[-1], [None, width])
    sch.reorder(*spatial[:-1], outer_j, *reduce, vec)
    outer = sch.fuse(*spatial[:-1], outer_j)
    work = 1
    for iv in stmt.iter_vars:
        work *= nominal(iv.dom.extent)  # a dynamic batch counts as NOMINAL_EXTENT
    if use_parallel(target, work):
        sch.parallel(outer)
    init = sch.decompose_reduction(main, reduce[0])
    # TVM cannot vectorise a loop inside a reduction loop (no compact dataflow); unrolled, the
    # ``width`` contiguous adds become one vector add in LLVM's SLP vectoriser.
    sch.unroll(vec)
    # TVM 0.27 cannot store a bf16 vector constant (the zero init): unrolled, LLVM vectorises it
    init_loop = sch.get_loops(init)[-1]
    (sch.unroll if dtype == "bfloat16" else sch.vectorize)(init_loop)
    return True
