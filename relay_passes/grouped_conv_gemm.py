"""Grouped conv2d on NHWC rows as one batched GEMM over the groups, and the channel shuffle.

A grouped conv with ``G`` groups of ``Cg`` input and ``Fg`` output channels is ``G``
independent convs; on rows ``[n*H*W, C]`` group ``s`` reads the channels ``s*Cg ...`` of each
tap. The kernel computes ``out[p, s, f] = sum_k A[s, p, k] * W[s, k, f]``: a batched matmul
whose batch axis is the group, which the bf16 GEMM rule (``tvmamp.schedules.cpu.bf16_matmul``)
schedules as it schedules any batch matmul, with ``W`` packed at compile time. ``A`` is the
rows themselves for a pointwise conv (viewed as ``[n*H*W, G, Cg]``, no copy), else the im2col
gather of the group's channels, inlined into the GEMM's copy of its left operand. The result
``[n*OH*OW, G, Fg]`` flattens (row-major) to the conv's output rows, so it stays in that shape:
the epilogue ops that follow broadcast their per-channel vectors as ``[G, Fg]``.

ShuffleNet's channel shuffle between grouped convs (reshape to ``[n, G, C/G, h, w]``, swap the
two channel axes, flatten) is, on rows, a transpose of each pixel's channels
(:func:`emit_channel_permute`).
"""

from __future__ import annotations

from tvm import relax, te

from .conv2d_im2col import (
    GATHER_ATTR,
    GEMM_PATTERN,
    IM2COL_ATTR,
    OPAQUE_PATTERN,
    Geometry,
    gather_tap,
    permute_dims,
    reshape,
)

# The block (and kernel) name of the groups' GEMM operands over a symbolic batch, which
# tvmamp.schedules.cpu.bf16_conv.schedule_im2col schedules as an im2col gather per group.
GROUP_COLUMNS = "group_columns"
# Block annotation of a permutation of the channel axes of rows (a channel shuffle);
# tvmamp.schedules.cpu.grouped_conv schedules it.
PERMUTE_ATTR = "tvmamp.channel_permute"


def grouped_weight(weight: relax.Expr, g: Geometry, filters: int) -> relax.Expr:
    """The OIHW ``weight`` as the groups' matrices ``[G, KH*KW*Cg, Fg]``, rows ``(ky, kx, c)``.

    Computed here for a constant weight, else as Relax ops.
    """
    fg, cg = filters // g.groups, g.group_channels
    split = reshape(weight, (g.groups, fg, cg, g.kh, g.kw))
    ordered = permute_dims(split, (0, 3, 4, 2, 1))
    return reshape(ordered, (g.groups, g.kh * g.kw * cg, fg))


def emit_grouped_gemm(
    bb: relax.BlockBuilder, rows: relax.Expr, weight: relax.Expr, g: Geometry, out_dtype: str
) -> relax.Var:
    """Emit the grouped conv ``g`` of ``rows`` by ``weight`` (from :func:`grouped_weight`).

    ``rows`` is ``[n*H*W, G, Cg]`` for a pointwise conv (1x1, stride 1, no padding), else
    ``[n*H*W, C]``. Returns the ``[n*OH*OW, G, Fg]`` result, accumulated in ``out_dtype``.
    """
    if g.symbolic:  # A read in place: its groups gathered (or transposed) by a kernel of its own
        rows = _emit_group_columns(bb, rows, g)
        loader = lambda x: lambda s, p, k: x[s, p, k]  # noqa: E731
    elif g.pointwise:
        loader = lambda x: lambda s, p, k: x[p, s, k]  # noqa: E731
    else:

        def loader(x):
            col = te.compute(
                (g.groups, g.out_rows, g.kh * g.kw * g.group_channels),
                lambda s, r, q: gather_tap(x, g, r, q, s * g.group_channels),
                name="im2col",
                attrs={GATHER_ATTR: g.group_channels},
            )
            return lambda s, p, k: col[s, p, k]

    def gemm(x: te.Tensor, w: te.Tensor) -> te.Tensor:
        load = loader(x)
        groups, depth, fg = (int(d) for d in w.shape)
        k = te.reduce_axis((0, depth), name="k")
        return te.compute(
            (g.out_rows, groups, fg),
            lambda p, s, f: te.sum(
                load(s, p, k).astype(out_dtype) * w[s, k, f].astype(out_dtype), axis=k
            ),
            name="matmul",
        )

    call = bb.call_te(
        gemm,
        rows,
        weight,
        primfunc_name_hint="grouped_conv_gemm",
        primfunc_attrs={"op_pattern": GEMM_PATTERN},
    )
    return bb.emit(call)


def _emit_group_columns(bb: relax.BlockBuilder, rows: relax.Expr, g: Geometry) -> relax.Var:
    """The groups' GEMM operands ``[G, rows, KH*KW*Cg]`` as a kernel of their own, for rows
    over a symbolic batch: inside the GEMM kernel a gathered or transposed copy of ``A`` would
    be a bf16 buffer of a symbolic size, which TVM promotes to fp32 (docs/CPU_BF16.md)."""
    depth = g.kh * g.kw * g.group_channels

    def columns(x: te.Tensor) -> te.Tensor:
        if g.pointwise:  # x is [rows, G, Cg]
            value = lambda s, r, q: x[r, s, q]  # noqa: E731
        else:
            value = lambda s, r, q: gather_tap(x, g, r, q, s * g.group_channels)  # noqa: E731
        return te.compute((g.groups, g.out_rows, depth), value, name=GROUP_COLUMNS)

    call = bb.call_te(
        columns,
        rows,
        primfunc_name_hint=GROUP_COLUMNS,
        primfunc_attrs={"op_pattern": OPAQUE_PATTERN, IM2COL_ATTR: g.group_channels},
    )
    return bb.emit(call)


def emit_channel_permute(bb: relax.BlockBuilder, rows: relax.Expr, perm: list[int]) -> relax.Var:
    """Emit ``rows[P, *dims]`` with its channel axes permuted: axis ``i`` of the result is
    axis ``perm[i]`` of ``rows``'s channel dims.

    A kernel of its own (``FuseOps`` leaves it alone), whose block is annotated
    :data:`PERMUTE_ATTR`: its channel loops are unrolled, so that each pixel's few channels move
    in registers, not as a transpose of tiles.
    """

    def permute(x: te.Tensor) -> te.Tensor:
        shape = [x.shape[0], *(int(x.shape[1 + a]) for a in perm)]

        def move(p, *index):
            source = [None] * len(perm)
            for axis, i in zip(perm, index, strict=True):
                source[axis] = i
            return x[(p, *source)]

        return te.compute(shape, move, name="channel_permute", attrs={PERMUTE_ATTR: len(perm)})

    call = bb.call_te(
        permute,
        rows,
        primfunc_name_hint="channel_permute",
        primfunc_attrs={"op_pattern": OPAQUE_PATTERN},
    )
    return bb.emit(call)
