"""Converters for the ops a mixture-of-experts layer exports: ``histc`` and grouped matmul.

Hugging Face's MoE layers (Mixtral, Qwen2-MoE, DeepSeek, OLMoE, ...) sort the (token, expert)
pairs by expert, count the rows of each expert with ``torch.histc``, and run each expert's
weights over its rows with one grouped matmul (``transformers::grouped_mm_fallback``, or
``aten._grouped_mm`` where torch has a kernel). TVM's importer has neither op.

The grouped matmul's row groups depend on the routing, so their sizes are only known at run
time. Here they become symbolic shapes (``tensor_to_shape``): each expert is one ``matmul`` of
a run-time slice of the rows, so the compiler's ordinary GEMM kernels (bf16 under AMP) do the
work, with no more FLOPs than the experts need.
"""

from __future__ import annotations

from .common import UnsupportedOperatorError, node_arg


def histc(node, importer):
    """``aten.histc(x, bins=100, min=0, max=0)``: counts of ``x`` in ``bins`` equal bins.

    As in torch, a value equal to ``max`` falls in the last bin and values outside
    ``[min, max]`` (and NaN) are not counted; ``min == max`` takes the data's own range.
    The bin of ``v`` is ``floor((v - min) * bins / (max - min))``, computed in ``x``'s dtype
    in that order, as ATen does.
    """
    from tvm import relax

    bb = importer.block_builder
    x = importer.env[node.args[0]]
    bins = int(node_arg(node, 1, "bins", 100))
    low, high = float(node_arg(node, 2, "min", 0)), float(node_arg(node, 3, "max", 0))
    dtype = str(x.ty.dtype)
    if "float" not in dtype:
        raise UnsupportedOperatorError(
            f"tvmamp.from_torch: aten.histc of a {dtype} tensor; torch accepts only floating "
            "point input on the CPU",
            [str(node.target)],
        )
    if bins < 1:
        raise ValueError(f"tvmamp.from_torch: aten.histc needs bins >= 1, got {bins}")
    flat = bb.emit(relax.op.reshape(x, [-1]))
    if low == high:
        lo = bb.emit(relax.op.min(flat))
        hi = bb.emit(relax.op.max(flat))
        same = bb.emit(relax.op.equal(lo, hi))
        one = relax.const(1, dtype)
        lo = bb.emit(relax.op.where(same, relax.op.subtract(lo, one), lo))
        hi = bb.emit(relax.op.where(same, relax.op.add(hi, one), hi))
    elif low > high:
        raise ValueError(f"tvmamp.from_torch: aten.histc needs min <= max, got {low} > {high}")
    else:
        lo, hi = relax.const(low, dtype), relax.const(high, dtype)
    position = relax.op.divide(
        relax.op.multiply(relax.op.subtract(flat, lo), relax.const(bins, dtype)),
        relax.op.subtract(hi, lo),
    )
    index = bb.emit(relax.op.astype(relax.op.floor(position), "int64"))
    last = relax.const(bins - 1, "int64")
    index = bb.emit(relax.op.where(relax.op.equal(flat, hi), last, index))
    inside = relax.op.logical_and(relax.op.greater_equal(flat, lo), relax.op.less_equal(flat, hi))
    edges = relax.op.arange(0, bins, 1, "int64")
    hits = relax.op.logical_and(
        relax.op.equal(relax.op.expand_dims(index, 1), edges), relax.op.expand_dims(inside, 1)
    )
    return bb.emit(relax.op.sum(relax.op.astype(hits, dtype), axis=[0]))


def grouped_mm(node, importer):
    """``grouped_mm(x [S, K], w [E, K, N], offs [E])``: rows ``offs[e-1]:offs[e]`` of ``x``
    times ``w[e]``; rows from ``offs[-1]`` on are zero (``transformers::grouped_mm_fallback``
    and the 2-D by 3-D form of ``aten._grouped_mm``).

    The offsets become symbolic row counts at run time. Before that they are made a valid
    partition of the ``S`` rows (non-decreasing, within ``[0, S]``), so a malformed ``offs``
    cannot slice out of bounds; for the offsets a MoE layer computes this changes nothing.
    """
    import tvm
    from tvm import relax

    bb = importer.block_builder
    x, w = importer.env[node.args[0]], importer.env[node.args[1]]
    offs = node_arg(node, 2, "offs")
    name = str(node.target)
    extra = [a for a in node.args[3:] if a is not None] + [
        k for k, v in node.kwargs.items() if k not in ("offs", "out_dtype") and v is not None
    ]
    if offs is None or x.ty.ndim != 2 or w.ty.ndim != 3 or extra:
        raise UnsupportedOperatorError(
            f"tvmamp.from_torch: {name} is supported as (input [S, K], weight [E, K, N], offs "
            f"[E]) with no bias; got input rank {x.ty.ndim}, weight rank {w.ty.ndim}"
            + (", no offs" if offs is None else "")
            + (f", extra arguments {extra}" if extra else ""),
            [name],
        )
    offs = importer.env[offs]
    experts = int(w.ty.shape[0])
    rows, width = x.ty.shape[0], w.ty.shape[2]
    if str(x.ty.dtype) != str(w.ty.dtype):
        x = bb.emit(relax.op.astype(x, str(w.ty.dtype)))
    ends = _partition_ends(bb, offs, rows)
    sizes = [tvm.tirx.Var(f"expert{e}_end", "int64") for e in range(experts)]
    bb.match_cast(relax.op.tensor_to_shape(ends), relax.ShapeType(sizes))
    pieces, start = [], 0
    for e, end in enumerate(sizes):
        part = bb.emit(relax.op.strided_slice(x, [0], [start], [end], assume_inbound=True))
        weight = bb.emit(relax.op.take(w, relax.const(e, "int64"), axis=0))
        pieces.append(bb.emit(relax.op.matmul(part, weight)))
        start = end
    tail = relax.op.zeros(relax.ShapeExpr([rows - sizes[-1], width]), str(w.ty.dtype))
    pieces.append(bb.emit(tail))
    out = bb.emit(relax.op.concat(pieces, axis=0))
    return bb.match_cast(out, relax.TensorType([rows, width], str(w.ty.dtype)))


def _partition_ends(bb, offs, rows):
    """``offs`` as int64 group ends that never decrease and lie in ``[0, rows]``."""
    from tvm import relax

    ends = bb.emit(relax.op.astype(offs, "int64"))
    zero = relax.const(0, "int64")
    before = relax.op.concat([relax.op.zeros([1], "int64"), ends], axis=0)
    before = relax.op.strided_slice(before, [0], [0], [int(offs.ty.shape[0])])
    counts = relax.op.maximum(relax.op.subtract(ends, before), zero)
    ends = relax.op.cumsum(counts, axis=0, dtype="int64")
    size = relax.op.shape_to_tensor(relax.ShapeExpr([rows]))
    return bb.emit(relax.op.minimum(ends, size))
