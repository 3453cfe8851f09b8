"""``Tile`` by run-time repeats, rewritten into ops TVM's importer takes with symbolic shapes.

``x.repeat(batch, 1, 1)`` exports as ``Tile(x, Concat(batch, 1, 1))`` with ``batch`` read off
a shape at run time (WavLM's relative position bias, SEW-D's attention). TVM's importer
refuses a shape expression as any input of an op outside a short list, ``Tile`` among them
("cannot handle ShapeExpr inputs"), so such models imported only with a static
``shape_dict``. Each axis ``i`` whose repeat ``r`` is not the constant 1 becomes::

    s = Shape(x)
    x = Unsqueeze(x, [i])                                   # [.., 1, d_i, ..]
    x = Expand(x, Concat(s[:i], r, s[i:]))                  # [.., r, d_i, ..]
    x = Reshape(x, Concat(s[:i], [-1], s[i + 1:]))          # [.., r * d_i, ..]

which is ``Tile`` along that axis (each repeat an outer block of ``d_i`` values), from
``Shape``, ``Slice`` (constant bounds: the rank is that of the repeats), ``Concat``,
``Expand`` and ``Reshape``: ops that TVM's importer keeps symbolic. :func:`tile_as_expand`
applies where the repeats are a ``Concat`` of one-element parts; other ``Tile`` nodes are left
to TVM.
"""

from __future__ import annotations

import numpy as np


def tile_as_expand(onnx, node, parts, constant, opset: int) -> list | None:
    """The nodes replacing the ``Tile`` ``node`` whose repeats are ``Concat(*parts)``, or None.

    ``constant(name)`` gives the value of a constant input, or None; ``parts`` must each be a
    one-element int64 (a constant, or a value that shape inference gives as ``[1]``: the
    caller checks that). Repeats that are all constant are left to TVM.
    """
    values = [constant(part) for part in parts]
    if all(v is not None for v in values):
        return None
    base = node.name or node.output[0]
    nodes = []

    def const(suffix, array):
        name = f"{base}/tile_{suffix}"
        tensor = onnx.numpy_helper.from_array(np.asarray(array, dtype=np.int64), name)
        nodes.append(onnx.helper.make_node("Constant", [], [name], value=tensor))
        return name

    def op(kind, inputs, suffix, **attrs):
        name = f"{base}/tile_{suffix}"
        nodes.append(onnx.helper.make_node(kind, inputs, [name], **attrs))
        return name

    def dims(shape, start, end, suffix):
        """``shape[start:end]`` (a Slice of the shape), or None when it is empty."""
        if start >= end:
            return None
        begin, stop = const(f"{suffix}_start", [start]), const(f"{suffix}_end", [end])
        return op("Slice", [shape, begin, stop], suffix)

    current = node.input[0]
    rank = len(parts)
    for axis, (part, value) in enumerate(zip(parts, values, strict=True)):
        if value is not None and int(np.asarray(value).reshape(-1)[0]) == 1:
            continue
        shape = op("Shape", [current], f"{axis}_shape")
        before = dims(shape, 0, axis, f"{axis}_before")
        at = dims(shape, axis, rank, f"{axis}_at")
        after = dims(shape, axis + 1, rank, f"{axis}_after")
        if opset >= 13:
            axes = const(f"{axis}_axes", [axis])
            unsqueezed = op("Unsqueeze", [current, axes], f"{axis}_unsqueeze")
        else:
            unsqueezed = op("Unsqueeze", [current], f"{axis}_unsqueeze", axes=[axis])
        target = [d for d in (before, part, at) if d is not None]
        expanded = op(
            "Expand", [unsqueezed, op("Concat", target, f"{axis}_target", axis=0)], f"{axis}_expand"
        )
        merged = [d for d in (before, const(f"{axis}_merged", [-1]), after) if d is not None]
        current = op(
            "Reshape",
            [expanded, op("Concat", merged, f"{axis}_merged_shape", axis=0)],
            f"{axis}_reshape",
        )
    nodes.append(onnx.helper.make_node("Identity", [current], [node.output[0]]))
    return nodes


__all__ = ["tile_as_expand"]
