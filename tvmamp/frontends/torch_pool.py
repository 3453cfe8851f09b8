"""Converters for max pooling with indices: ``max_pool{2,3}d_with_indices`` and
``adaptive_max_pool{2,3}d``.

``torch.export`` turns every ``max_pool`` into ``max_pool2d_with_indices`` (values, indices).
TVM's importer computes the values and returns zeros for the indices, so a model that reads
them (``return_indices=True`` feeding ``max_unpool2d``, SegNet-style decoders, or the indices
as an output) was silently wrong. TVM has no adaptive max pool at all.

Here the values stay TVM's pooling op when only they are read; when the indices are read they
are computed by one TE argmax over each window: the flat position in the input plane of the
first maximum in window order, as ATen does (a NaN is a maximum; of several, the last wins).
"""

from __future__ import annotations

from tvmamp.tensors import static_shape

from .common import UnsupportedOperatorError, node_arg, reads_beyond_first

_BIG = (1 << 62) - 1  # the index an empty slot of a window carries: no real one loses to it


def _dims(value, rank: int, name: str) -> list[int]:
    values = [value] if isinstance(value, int) else list(value)
    if len(values) == 1:
        values *= rank
    if len(values) != rank:
        raise UnsupportedOperatorError(
            f"tvmamp.from_torch: max pooling over {rank} dims with {name}={list(value)}",
            ["max_pool_with_indices"],
        )
    return [int(v) for v in values]


def _window_argmax(data, out_shape, lengths: list[int], window):
    """TE: ``(indices, values)`` of the maximum of each window of ``data``'s last
    ``len(lengths)`` axes. Along spatial axis ``d`` a window has ``lengths[d]`` slots, and
    ``window(d, o)`` gives ``(start, step, end)`` for output position ``o``: slot ``r`` reads
    ``start + r * step`` where that lies in ``[0, end)``."""
    from tvm import te, tirx

    rank = len(lengths)
    lead = len(data.shape) - rank
    sizes = list(data.shape[lead:])
    dtype = data.dtype
    axes = [te.reduce_axis((0, length), f"r{d}") for d, length in enumerate(lengths)]

    def wins(x, y):  # whether (index, value) x precedes y as ATen's scan keeps it
        nan_x, nan_y = tirx.isnan(x[1]), tirx.isnan(y[1])
        first = tirx.all(x[1] == y[1], x[0] < y[0])
        plain = tirx.all(tirx.Not(nan_x), tirx.Not(nan_y), tirx.any(x[1] > y[1], first))
        both_nan = tirx.all(nan_x, nan_y, x[0] > y[0])
        return tirx.any(tirx.all(nan_x, tirx.Not(nan_y)), both_nan, plain)

    def combine(x, y):
        take = wins(x, y)
        return tirx.Select(take, x[0], y[0]), tirx.Select(take, x[1], y[1])

    def identity(index_dtype, value_dtype):
        return tirx.const(_BIG, index_dtype), tirx.const(float("-inf"), value_dtype)

    argmax = te.comm_reducer(combine, identity, name="window_argmax")

    def compute(*out):
        positions, inside = [], []
        for d in range(rank):
            start, step, end = window(d, out[lead + d])
            pos = start + axes[d] * step
            positions.append(pos)
            inside.append(tirx.all(pos >= 0, pos < end))
        valid = tirx.all(*inside)
        flat = positions[0]
        for d in range(1, rank):
            flat = flat * sizes[d] + positions[d]
        index = tirx.Select(valid, flat.astype("int64"), tirx.const(_BIG, "int64"))
        safe = [tirx.Select(valid, p, tirx.const(0, str(p.ty.dtype))) for p in positions]
        value = tirx.if_then_else(
            valid, data[tuple(out[:lead]) + tuple(safe)], tirx.const(float("-inf"), dtype)
        )
        return argmax((index, value), axis=axes)

    indices, values = te.compute(out_shape, compute, name="window_argmax")
    return indices, values


def max_pool_with_indices(rank: int):
    """A converter of ``aten.max_pool{rank}d_with_indices(x, kernel_size, stride=[],
    padding=0, dilation=1, ceil_mode=False)``."""

    def convert(node, importer):
        from tvm import relax

        bb = importer.block_builder
        x = importer.env[node.args[0]]
        kernel = _dims(node_arg(node, 1, "kernel_size"), rank, "kernel_size")
        stride = _dims(node_arg(node, 2, "stride", None) or kernel, rank, "stride")
        padding = _dims(node_arg(node, 3, "padding", 0), rank, "padding")
        dilation = _dims(node_arg(node, 4, "dilation", 1), rank, "dilation")
        ceil_mode = bool(node_arg(node, 5, "ceil_mode", False))
        pool = getattr(importer, f"_max_pool{rank}d_impl")
        values = bb.normalize(pool(x, kernel, stride, padding, dilation, ceil_mode))
        if not reads_beyond_first(node):  # the unread indices: a placeholder that DCE removes
            return bb.emit(relax.Tuple([values, relax.op.zeros_like(values, "int64")]))
        sizes = list(x.ty.shape)[-rank:]

        def window(d, o):
            return o * stride[d] - padding[d], dilation[d], sizes[d]

        shape = list(values.ty.shape)
        indices = bb.emit_te(
            lambda data: _window_argmax(data, shape, kernel, window)[0],
            x,
            primfunc_name_hint=f"max_pool{rank}d_indices",
        )
        return bb.emit(relax.Tuple([values, indices]))

    return convert


def adaptive_max_pool(rank: int):
    """A converter of ``aten.adaptive_max_pool{rank}d(x, output_size)``: values and indices.

    Output position ``o`` of an axis of size ``n`` pools ``[floor(o*n/m), ceil((o+1)*n/m))``,
    as ATen does, for ``m`` outputs.
    """

    def convert(node, importer):
        from tvm import relax, tirx

        bb = importer.block_builder
        x = importer.env[node.args[0]]
        outputs = _dims(node_arg(node, 1, "output_size"), rank, "output_size")
        sizes = static_shape(x.ty)
        if sizes is None:
            raise UnsupportedOperatorError(
                f"tvmamp.from_torch: adaptive max pooling of a tensor of symbolic shape "
                f"{list(x.ty.shape)}; its windows need the input's size",
                [str(node.target)],
            )
        sizes = sizes[-rank:]
        lengths = [  # the longest window along each axis
            max(-(-((i + 1) * n) // m) - (i * n) // m for i in range(m))
            for n, m in zip(sizes, outputs, strict=True)
        ]

        def window(d, o):
            n, m = sizes[d], outputs[d]
            return tirx.floordiv(o * n, m), 1, tirx.floordiv((o + 1) * n + m - 1, m)

        shape = list(x.ty.shape)[:-rank] + outputs
        pair = bb.emit_te(
            lambda data: list(_window_argmax(data, shape, lengths, window)),
            x,
            primfunc_name_hint=f"adaptive_max_pool{rank}d",
        )
        indices, values = (bb.emit(relax.TupleGetItem(pair, i)) for i in range(2))
        return bb.emit(relax.Tuple([values, indices]))

    return convert
