"""Converters for ATen ops TVM's importer lacks: scatter reductions, ``embedding_bag``,
``prod`` over a dim, ``kthvalue``, ``hypot``, ``var_mean``, stable ``sort``,
``searchsorted``, ``triu``/``tril_indices``, ``masked_scatter``, ``cdist``, ``Tensor.unfold``,
``exp2`` and ``fmax``/``fmin``.

Some it converts wrongly are converted here too:

- ``scatter.src``: TVM's importer passed ``src`` whole where torch reads only the part of it
  that ``index`` covers;
- ``matmul``, ``mm``, ``bmm`` and ``addmm``: TVM's importer gave every product a float32
  result, so an int64 ``a @ b`` returned float32 (exact only below 2**24) and a float64 model
  silently became float32. The product keeps its operands' dtype, as in torch.
"""

from __future__ import annotations

from tvmamp.tensors import static_shape

from .common import UnsupportedOperatorError, node_arg, reads_beyond_first

# torch.scatter_reduce's reductions -> relax.op.scatter_elements's
_SCATTER_REDUCTIONS = {"sum": "add", "prod": "mul", "amax": "max", "amin": "min"}


def _refuse(node, why: str):
    raise UnsupportedOperatorError(f"tvmamp.from_torch: {node.target} {why}", [str(node.target)])


def _covered(bb, src, index):
    """``src`` cut to ``index``'s shape (torch reads ``src[i]`` only where ``index[i]`` is)."""
    import tvm_ffi
    from tvm import relax

    if tvm_ffi.structural_equal(src.ty.shape, index.ty.shape):
        return src
    want = list(index.ty.shape)
    axes = list(range(len(want)))
    return bb.emit(relax.op.strided_slice(src, axes, [0] * len(want), want, assume_inbound=True))


def _scatter_elements(node, importer, reduction: str):
    """``scatter_elements`` of ``node``'s ``(x, dim, index, src, ...)`` with ``reduction``."""
    from tvm import relax

    bb = importer.block_builder
    x, index, src = (importer.env[node.args[i]] for i in (0, 2, 3))
    src = _covered(bb, src, index)
    return bb.emit(relax.op.scatter_elements(x, index, src, int(node.args[1]), reduction))


def scatter(reduction: str | None):
    """``scatter.src(x, dim, index, src)`` (``reduction`` None) and ``scatter_add``."""

    def convert(node, importer):
        return _scatter_elements(node, importer, reduction or "update")

    return convert


def scatter_reduce(node, importer):
    """``scatter_reduce.two(x, dim, index, src, reduce, include_self=True)``."""
    reduce = node_arg(node, 4, "reduce")
    if reduce not in _SCATTER_REDUCTIONS:
        _refuse(node, f"with reduce={reduce!r}; supported: {sorted(_SCATTER_REDUCTIONS)}")
    if not node_arg(node, 5, "include_self", True):
        _refuse(node, "with include_self=False")
    return _scatter_elements(node, importer, _SCATTER_REDUCTIONS[reduce])


def prod_dim(node, importer):
    """``prod.dim_int(x, dim, keepdim=False, dtype=None)``."""
    from tvm import relax

    x = importer.env[node.args[0]]
    keep = bool(node_arg(node, 2, "keepdim", False))
    return importer.block_builder.emit(relax.op.prod(x, int(node.args[1]), keepdims=keep))


def hypot(node, importer):
    """``hypot(a, b)``: ``sqrt(a * a + b * b)``."""
    from tvm import relax

    a, b = (importer.env[n] for n in node.args[:2])
    bb = importer.block_builder
    return bb.emit(relax.op.sqrt(relax.op.add(relax.op.multiply(a, a), relax.op.multiply(b, b))))


def kthvalue(node, importer):
    """``kthvalue(x, k, dim=-1, keepdim=False)``: the k-th smallest and its index."""
    from tvm import relax

    bb = importer.block_builder
    x = importer.env[node.args[0]]
    k, dim = int(node.args[1]), int(node_arg(node, 2, "dim", -1))
    keep = bool(node_arg(node, 3, "keepdim", False))
    dim = dim % len(x.ty.shape)
    smallest = bb.emit(relax.op.topk(x, k, dim, "both", False, "int64"))
    picked = []
    for field in range(2):
        part = relax.TupleGetItem(smallest, field)
        part = relax.op.strided_slice(part, [dim], [k - 1], [k], assume_inbound=True)
        picked.append(bb.emit(part if keep else relax.op.squeeze(part, [dim])))
    return bb.emit(relax.Tuple(picked))


_BAG_MODES = {0: "sum", 1: "mean", 2: "max"}


def embedding_bag(node, importer):
    """``_embedding_bag(weight, indices, offsets, scale_grad_by_freq, mode, sparse,
    per_sample_weights, include_last_offset, padding_idx)``: the bags' sums, means or
    maxima (its first result; the other three are bookkeeping for the backward pass).

    Bag ``b`` holds ``indices[offsets[b]:offsets[b + 1]]``. Each index's row is taken, scaled
    by its per-sample weight, and added (or maxed) into its bag's row by a scatter; entries
    equal to ``padding_idx`` are left out of the bag, and an empty bag is zeros, as in torch.
    """
    from tvm import relax

    if reads_beyond_first(node):
        _refuse(node, "with its offset2bag, bag_size or max_indices results read")
    bb = importer.block_builder
    weight, indices, offsets = (importer.env[n] for n in node.args[:3])
    mode = _BAG_MODES.get(int(node_arg(node, 4, "mode", 0)))
    if mode is None:
        _refuse(node, f"with mode={node_arg(node, 4, 'mode')}")
    per_sample = node_arg(node, 6, "per_sample_weights")
    last_offset = bool(node_arg(node, 7, "include_last_offset", False))
    padding = node_arg(node, 8, "padding_idx", -1)
    padding = -1 if padding is None else int(padding)
    if len(indices.ty.shape) != 1:
        _refuse(node, "with indices of more than one dim")
    count, dim = indices.ty.shape[0], weight.ty.shape[1]
    bags = offsets.ty.shape[0] - 1 if last_offset else offsets.ty.shape[0]
    dtype = str(weight.ty.dtype)

    # bag of each index: how many bag starts after the first are at or before its position
    starts = relax.op.strided_slice(offsets, [0], [1], [bags], assume_inbound=True)
    positions = relax.op.arange(relax.prim_value(0), relax.prim_value(count), 1, "int64")
    bag_of = bb.emit(relax.op.bucketize(positions, starts, right=True))
    rows = bb.emit(relax.op.take(weight, indices, axis=0))
    if per_sample is not None:
        scale = relax.op.expand_dims(importer.env[per_sample], 1)
        rows = bb.emit(relax.op.multiply(rows, scale))
    kept = None
    if padding >= 0:
        kept = bb.emit(relax.op.not_equal(indices, relax.const(padding, str(indices.ty.dtype))))
        fill = relax.const(float("-inf") if mode == "max" else 0.0, dtype)
        rows = bb.emit(relax.op.where(relax.op.expand_dims(kept, 1), rows, fill))
    target = relax.op.broadcast_to(relax.op.expand_dims(bag_of, 1), relax.ShapeExpr([count, dim]))
    start = relax.const(float("-inf") if mode == "max" else 0.0, dtype)
    start = relax.op.broadcast_to(start, relax.ShapeExpr([bags, dim]))
    reduction = "max" if mode == "max" else "add"
    out = bb.emit(relax.op.scatter_elements(start, target, rows, 0, reduction))
    if mode == "sum":
        return bb.emit(relax.Tuple([out]))  # the FX graph reads result 0 only
    ones = relax.op.ones(relax.ShapeExpr([count]), dtype)
    if kept is not None:
        ones = relax.op.astype(kept, dtype)
    sizes = relax.op.scatter_elements(
        relax.op.zeros(relax.ShapeExpr([bags]), dtype), bag_of, ones, 0, "add"
    )
    sizes = bb.emit(relax.op.expand_dims(sizes, 1))
    if mode == "mean":
        out = relax.op.divide(out, relax.op.maximum(sizes, relax.const(1.0, dtype)))
    else:
        out = relax.op.where(
            relax.op.equal(sizes, relax.const(0.0, dtype)), relax.const(0.0, dtype), out
        )
    return bb.emit(relax.Tuple([bb.emit(out)]))


def matmul(node, importer):
    """``matmul``/``mm``/``bmm(a, b)`` in the operands' dtype."""
    from tvm import relax

    a, b = (importer.env[n] for n in node.args[:2])
    return importer.block_builder.emit(relax.op.matmul(a, b, out_dtype=str(a.ty.dtype)))


def addmm(node, importer):
    """``addmm(bias, a, b, beta=1, alpha=1)``: ``beta * bias + alpha * (a @ b)``."""
    from tvm import relax

    bb = importer.block_builder
    bias, a, b = (importer.env[n] for n in node.args[:3])
    beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    dtype = str(a.ty.dtype)
    product = bb.emit(relax.op.matmul(a, b, out_dtype=dtype))
    if alpha != 1:
        product = bb.emit(relax.op.multiply(product, relax.const(alpha, dtype)))
    if beta == 0:
        return product
    if beta != 1:
        bias = bb.emit(relax.op.multiply(bias, relax.const(beta, str(bias.ty.dtype))))
    return bb.emit(relax.op.add(bias, product))


def var_mean(node, importer):
    """``var_mean.correction(x, dim=None, correction=1, keepdim=False)``: ``(var, mean)``,
    the variance with ``n - correction`` in its denominator, as ``torch.var``."""
    import math

    from tvm import relax

    bb = importer.block_builder
    x = importer.env[node.args[0]]
    rank = len(x.ty.shape)
    dims = node_arg(node, 1, "dim")
    dims = list(range(rank)) if dims is None else [int(d) % rank for d in dims]
    correction = node.kwargs.get("correction", 1)
    correction = 1 if correction is None else float(correction)
    keep = bool(node.kwargs.get("keepdim", False))
    shape = static_shape(x.ty)
    if shape is None:
        _refuse(node, f"of a tensor of symbolic shape {list(x.ty.shape)}")
    count = math.prod(shape[d] for d in dims)
    dtype = str(x.ty.dtype)
    mean = bb.emit(relax.op.mean(x, dims, keepdims=True))
    centred = relax.op.subtract(x, mean)
    total = relax.op.sum(relax.op.multiply(centred, centred), dims, keepdims=keep)
    divisor = relax.const(max(count - correction, 0.0), dtype)
    variance = bb.emit(relax.op.divide(total, divisor))
    if not keep:
        mean = bb.emit(relax.op.squeeze(mean, dims))
    return bb.emit(relax.Tuple([variance, mean]))


def stable_sort(node, importer):
    """``sort.stable(x, *, stable, dim=-1, descending=False)``: values and int64 indices,
    equal elements in their input order (TVM's argsort is a stable sort)."""
    from tvm import relax

    bb = importer.block_builder
    x = importer.env[node.args[0]]
    dim = int(node.kwargs.get("dim", -1)) % len(x.ty.shape)
    descending = bool(node.kwargs.get("descending", False))
    order = bb.emit(relax.op.argsort(x, axis=dim, descending=descending, dtype="int64"))
    values = bb.emit(relax.op.gather_elements(x, order, axis=dim))
    return bb.emit(relax.Tuple([values, order]))


def searchsorted(node, importer):
    """``searchsorted.Tensor(sorted, x, out_int32=False, right=False, side=None,
    sorter=None)`` over a 1-D sorted sequence: ``bucketize`` of ``x``."""
    from tvm import relax

    boundaries, x = (importer.env[n] for n in node.args[:2])
    if len(boundaries.ty.shape) != 1 or node.kwargs.get("sorter") is not None:
        _refuse(node, "with a sorted sequence of more than one dim, or a sorter")
    right = bool(node.kwargs.get("right", False)) or node.kwargs.get("side") == "right"
    out_int32 = bool(node.kwargs.get("out_int32", False))
    return importer.block_builder.emit(relax.op.bucketize(x, boundaries, out_int32, right))


def triangle_indices(upper: bool):
    """``triu_indices``/``tril_indices(row, col, offset=0)``: a constant [2, n] int64."""

    def convert(node, importer):
        import numpy as np
        from tvm import relax

        row, col = int(node.args[0]), int(node.args[1])
        offset = int(node_arg(node, 2, "offset", 0))
        pick = np.triu_indices if upper else np.tril_indices
        return relax.const(np.stack(pick(row, offset, col)).astype("int64"))

    return convert


def masked_scatter(node, importer):
    """``masked_scatter(x, mask, source)``: the positions where ``mask`` (broadcast to ``x``)
    holds take ``source``'s elements in order (a multimodal model's image features written
    into the text embeddings); the others keep ``x``."""
    from tvm import relax

    bb = importer.block_builder
    x, mask, source = (importer.env[n] for n in node.args[:3])
    shape = relax.ShapeExpr(list(x.ty.shape))
    mask = bb.emit(relax.op.broadcast_to(mask, shape))
    flat = relax.op.astype(relax.op.reshape(mask, [-1]), "int64")
    order = relax.op.subtract(relax.op.cumsum(flat, 0), relax.const(1, "int64"))
    order = relax.op.maximum(order, relax.const(0, "int64"))  # unmasked leading positions
    taken = relax.op.take(relax.op.reshape(source, [-1]), order, axis=0)
    return bb.emit(relax.op.where(mask, relax.op.reshape(taken, shape), x))


def cdist(node, importer):
    """``_cdist_forward(x1, x2, p, compute_mode)``: the p-norm distance of every pair of rows,
    computed directly (torch exports its matmul form for p = 2 past 25 rows itself)."""
    from tvm import relax

    bb = importer.block_builder
    a, b = (importer.env[n] for n in node.args[:2])
    p = float(node.args[2])
    dtype = str(a.ty.dtype)
    diff = relax.op.subtract(relax.op.expand_dims(a, -2), relax.op.expand_dims(b, -3))
    size = relax.op.abs(diff)
    if p == 2.0:
        out = relax.op.sqrt(relax.op.sum(relax.op.multiply(diff, diff), -1))
    elif p == 1.0:
        out = relax.op.sum(size, -1)
    elif p == float("inf"):
        out = relax.op.max(size, -1)
    elif p == 0.0:
        out = relax.op.sum(
            relax.op.astype(relax.op.not_equal(diff, relax.const(0.0, dtype)), dtype), -1
        )
    else:
        total = relax.op.sum(relax.op.power(size, relax.const(p, dtype)), -1)
        out = relax.op.power(total, relax.const(1.0 / p, dtype))
    return bb.emit(out)


def unfold(node, importer):
    """``Tensor.unfold(dim, size, step)``: the windows of ``size`` elements every ``step``
    along ``dim`` (audio framing), as a gather of constant indices with the window last."""
    import numpy as np
    from tvm import relax

    x = importer.env[node.args[0]]
    shape = static_shape(x.ty)
    if shape is None:
        _refuse(node, f"of a tensor of symbolic shape {list(x.ty.shape)}")
    dim, size, step = (int(v) for v in node.args[1:4])
    dim %= max(len(shape), 1)
    count = (shape[dim] - size) // step + 1
    index = np.arange(count)[:, None] * step + np.arange(size)[None, :]
    bb = importer.block_builder
    windows = bb.emit(relax.op.take(x, relax.const(index.astype("int64")), axis=dim))
    axes = list(range(len(shape) + 1))  # [..., count, size, ...]: move the window's axis last
    axes = axes[: dim + 1] + axes[dim + 2 :] + [dim + 1]
    return bb.emit(relax.op.permute_dims(windows, axes))


def exp2(node, importer):
    """``exp2(x)``: ``exp(x * ln 2)``."""
    import math

    from tvm import relax

    x = importer.env[node.args[0]]
    scaled = relax.op.multiply(x, relax.const(math.log(2.0), str(x.ty.dtype)))
    return importer.block_builder.emit(relax.op.exp(scaled))


def nan_ignoring(extremum):
    """``fmax``/``fmin(a, b)``: ``extremum``, with a NaN operand giving the other one."""

    def convert(node, importer):
        from tvm import relax

        a, b = (importer.env[n] for n in node.args[:2])
        both = getattr(relax.op, extremum)(a, b)
        out = relax.op.where(relax.op.isnan(a), b, relax.op.where(relax.op.isnan(b), a, both))
        return importer.block_builder.emit(out)

    return convert


def empty(node, importer):
    """``empty``/``empty_permuted(size)``: zeros (uninitialised in torch) of sizes that may be
    symbolic. TVM's converter passed the fx nodes of symbolic sizes to ``relax.op.zeros``, and
    transformers' MoE experts (``torch.empty_like(perm)`` of a dynamic batch's tokens) failed to
    import."""
    import torch
    from tvm import relax

    args = importer.retrieve_args(node)
    dtype = importer._convert_data_type(  # pylint: disable=protected-access
        node.kwargs.get("dtype") or torch.get_default_dtype(), importer.env
    )
    return importer.block_builder.emit(relax.op.zeros(relax.ShapeExpr(list(args[0])), dtype))


def repeat(node, importer):
    """``repeat(x, *repeats)`` where a repeat count may be symbolic (DETR's
    ``query.unsqueeze(0).repeat(batch, 1, 1)`` over a dynamic batch), which ``relax.op.tile``
    (TVM's converter) refuses: ``x`` with a unit axis before each of its axes, broadcast to the
    counts there, then the pairs merged."""
    from tvm import relax

    args = importer.retrieve_args(node)
    x = args[0]
    counts = list(args[1]) if isinstance(args[1], list | tuple) else list(args[1:])
    if all(isinstance(c, int) for c in counts):
        return importer.block_builder.emit(relax.op.tile(x, counts))
    dims = list(x.ty.shape.values)
    dims = [1] * (len(counts) - len(dims)) + dims
    pairs = [v for d in dims for v in (1, d)]
    spread = [v for c, d in zip(counts, dims, strict=True) for v in (c, d)]
    bb = importer.block_builder
    y = relax.op.broadcast_to(relax.op.reshape(x, relax.ShapeExpr(pairs)), relax.ShapeExpr(spread))
    merged = [c * d for c, d in zip(counts, dims, strict=True)]
    return bb.emit(relax.op.reshape(y, relax.ShapeExpr(merged)))
