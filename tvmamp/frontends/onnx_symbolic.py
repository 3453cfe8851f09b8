"""Converters that keep symbolic dimensions through TVM's ONNX importer.

Models exported with a symbolic batch or sequence axis compute shapes at run time, and a few
of TVM's converters lose or mishandle such shapes (the models named below fail to import, or
import with a wrong shape). :func:`symbolic_converters` installs overrides of those converters
for the duration of one import. Each override handles one pattern and defers to TVM's
converter (returns ``None``) whenever its preconditions do not hold:

* ``Range`` over a symbolic start or limit with a constant integer delta (XLNet, ConvBERT);
* ``Slice`` "to the end" (``INT64_MAX``) or with negative constant bounds on a symbolic axis
  (MPT, WavLM), or from minus a size (T5's ``bias[:, :, -seq:]``, :func:`_negative`);
* ``Gather`` of a shape: a shape held in a variable, or a constant index picking static dims
  (DeBERTa v1's ``chunk``), or permuting all of them (onnxruntime's transpose optimiser
  writes ``Shape(Transpose(x))`` so; its ``Split`` of a shape becomes ``Slice`` nodes before
  the import, :func:`split_shapes_as_slices`);
* ``Expand`` of a tensor with symbolic dims to a constant shape (WavLM);
* ``Conv`` with ``auto_pad`` "SAME" over static spatial sizes, given explicit pads (TVM pads
  its input with a kernel of its own);
* ``Pad`` in constant mode with pads computed at run time (SEW-D), and with constant pads as
  ``relax.nn.pad`` rather than TVM's TE call, so that a pad before a convolution (an export of
  ``padding="same"``) can be folded into it (:mod:`tvmamp.relay_passes.pad_into_conv`).
* ``Reshape`` of a symbolic scalar to one element, as a shape (:func:`_reshape`), and of a
  tensor over symbolic dims to a shape with a ``-1``, that dim given as the input's dims the
  others do not cancel (:func:`_reshape_inferred`; TVM's quotient defeats codegen);
* ``Cast`` of a shape to int64 (a no-op: ONNX shapes are int64), which TVM makes a tensor, so
  that a ``Concat`` of it with a shape fails (torchvision's LRASPP and timm's CoaT-Lite
  resize to ``input.shape[-2:]``);
* ``Resize`` of a 4-D tensor over symbolic spatial sizes, to sizes given as a shape (TVM
  reads them as ints) or by constant scales (TVM computes ``int64(float(in) * scale)`` and
  maps coordinates with ``in / out``). A scale ``p / q`` gives ``in // q * p``, exact as ONNX
  has it where ``q`` divides ``in``, which a ``match_cast`` checks at run time;
* ``Clip`` by constant bounds as one ``relax.op.clip`` (TVM emits two TE calls);
* ``MaxPool`` and ``AveragePool`` (not counting its padding) with ``ceil_mode`` over symbolic
  sizes, as floor mode with more end padding where that is the same (:func:`_pool`);
* ``Concat`` of tensors whose other dims TVM cannot prove equal (a U-Net's upsampled
  ``h // 4 * 2`` beside its skip connection's ``h // 2``), and a binary elementwise op of two
  such tensors (DLA's residual adds): TVM gives the result no shape, and a later ``Resize``
  or ``MaxPool`` fails. Those dims are unified by a ``match_cast`` of the inputs (a run-time
  check, where onnxruntime fails on such sizes too).

Like TVM's importer where it uses ``assume_inbound``, the overrides assume what the export's
trace implies: slice bounds within their axis, non-negative run-time pads.
"""

from __future__ import annotations

import contextlib
import inspect
from fractions import Fraction

import numpy as np
import tvm
from tvm import relax, tirx
from tvm.sym import Analyzer, ConstIntBound

from tvmamp.tensors import int_or_expr

# Exporters write INT64_MAX (or INT32_MAX) for "to the end", their negations for "from the start".
_END = 1 << 31


@contextlib.contextmanager
def symbolic_converters(overrides=None, added=None):
    """Within the block, TVM's ONNX importer uses the overrides of this module, and those
    given (``{op: rewrite}``, :mod:`.onnx_converters`'s), converts the ``added`` ops it has no
    converter for, and a converter that fails raises :class:`UnsupportedOperatorError` naming
    its op.

    TVM looks its converters up with ``onnx_frontend._get_convert_map()`` for every node;
    the block swaps that function and restores it on exit.
    """
    from tvm.relax.frontend.onnx import onnx_frontend

    original = onnx_frontend._get_convert_map
    base = original()
    rewrites = {**OVERRIDES, **(overrides or {})}
    wrapped = {op: _overriding(base[op], rewrite) for op, rewrite in rewrites.items()}
    wrapped |= {op: _added(onnx_frontend.OnnxOpConverter, op, f) for op, f in (added or {}).items()}
    named = {op: _naming_failures(op, c) for op, c in {**base, **wrapped}.items()}
    onnx_frontend._get_convert_map = lambda: {**original(), **named}
    try:
        yield
    finally:
        onnx_frontend._get_convert_map = original


def _naming_failures(op: str, converter):
    """A subclass of ``converter`` whose failures raise :class:`UnsupportedOperatorError`
    naming ``op``: TVM's converters assert on inputs they do not handle (an ``Attention`` with
    rotary embeddings: "rotary position embedding is not currently supported"), and an
    ``AssertionError`` escaped the CLI as a traceback."""
    from .common import UnsupportedOperatorError

    class Named(converter):
        @classmethod
        def get_converter(cls, opset):
            convert = converter.get_converter(opset)

            def checked(bb, inputs, attr, params):
                try:
                    return convert(bb, inputs, attr, params)
                except UnsupportedOperatorError:
                    raise
                except Exception as err:
                    text = _message(err)
                    raise UnsupportedOperatorError(
                        f"tvmamp.from_onnx: TVM's ONNX converter for {op} (opset {opset}) "
                        f"failed on this node: {type(err).__name__}: {text}",
                        [op],
                    ) from err

            return checked

    Named.__name__ = Named.__qualname__ = converter.__name__
    return Named


def _message(err: Exception, limit: int = 400) -> str:
    """``err``'s message on one line, shortened to ``limit`` characters. Its first line alone
    can stop mid-sentence: "mask index should be in shape of (batch_size, seq_len),"."""
    text = " ".join(line.strip() for line in str(err).strip().splitlines() if line.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _added(base, op: str, convert):
    """A converter class (a subclass of TVM's ``OnnxOpConverter``) for an op TVM has none for:
    ``convert(bb, inputs, attr, params, None)`` at every opset; None from it is a refusal."""
    from .common import UnsupportedOperatorError

    class Added(base):
        @classmethod
        def get_converter(cls, opset):
            def converted(bb, inputs, attr, params):
                out = convert(bb, inputs, attr, params, None)
                if out is None:
                    raise UnsupportedOperatorError(
                        f"tvmamp.from_onnx: {op} needs an input of known shape", [op]
                    )
                return out

            return converted

    Added.__name__ = Added.__qualname__ = op
    return Added


def _overriding(converter, rewrite):
    """A subclass of ``converter`` that tries ``rewrite`` first, at every opset.

    ``rewrite(bb, inputs, attr, params, fallback)`` returns the converted expression, or None
    to leave the node to TVM's converter ``fallback`` (for the model's opset).
    """

    # a rewrite whose result depends on the op's version takes it as ``opset``
    versioned = "opset" in inspect.signature(rewrite).parameters

    class Override(converter):
        @classmethod
        def get_converter(cls, opset):
            fallback = converter.get_converter(opset)
            extra = {"opset": opset} if versioned else {}

            def convert(bb, inputs, attr, params):
                out = rewrite(bb, inputs, attr, params, fallback, **extra)
                return fallback(bb, inputs, attr, params) if out is None else out

            return convert

    Override.__name__ = Override.__qualname__ = converter.__name__
    return Override


# ----------------------------------------------------------------------------- before the import


def split_shapes_as_slices(onnx, model):
    """``model`` with every ``Split`` of a shape (a ``Shape`` output, or a ``Gather`` of one
    by a list of indices) into parts of constant sizes written as one ``Slice`` a part: a
    copy, or ``model`` itself where there is no such ``Split``.

    onnxruntime's transpose optimiser (level 99 of its transformer optimiser: LLaMA files)
    splits shapes into their dims with ``Split``. TVM's importer refuses a shape as its input
    ("cannot handle ShapeExpr inputs"), or splits a tensor of it at run time, and the
    ``Reshape`` to the shape rebuilt from the parts failed ("Reshape requires the input new
    shape to be Shape"). A ``Slice`` of a shape by constant bounds stays a shape (or a
    constant)."""
    graph = model.graph
    constants = _constant_ints(onnx, graph)
    shapes = _shape_values(graph, constants)
    found = [i for i, n in enumerate(graph.node) if _split_sizes(n, shapes, constants)]
    if not found:
        return model
    copy = type(model)()
    copy.CopyFrom(model)
    for i in reversed(found):
        node = copy.graph.node[i]
        slices = _as_slices(onnx, node, _split_sizes(node, shapes, constants))
        del copy.graph.node[i]
        for offset, new in enumerate(slices):
            copy.graph.node.insert(i + offset, new)
    return copy


# The name prefix of the Casts that make a shape a tensor (``permuted_shapes_as_tensors``).
AS_TENSOR = "tvmamp/as_tensor/"

# The ops TVM's importer gives a shape to (its ``shape_compatible_ops``), and ``Split``, which
# ``split_shapes_as_slices`` writes as ``Slice``s. Any other op refuses one ("cannot handle
# ShapeExpr inputs").
_SHAPE_READERS = frozenset(
    "Reshape Resize ConstantOfShape Gather Slice Shape Expand Concat Equal Where Cast CastLike "
    "Squeeze Split".split()
)


def permuted_shapes_as_tensors(onnx, model):
    """``model`` where an op that takes no shapes reads a permutation ``Gather`` of a shape
    through a ``Cast`` to int64 named ``tvmamp/as_tensor/...``: a copy, or ``model`` itself
    where none does.

    :func:`_gather` keeps ``Gather(Shape(x), perm)`` (onnxruntime's transpose optimiser's
    ``Shape(Transpose(x))``) a shape, for the ``Reshape`` it feeds. A ``Mul`` or ``ReduceProd``
    of it was then refused by TVM's importer. :func:`_cast` leaves such a ``Cast`` to TVM,
    which makes the shape a constant where it is static, else a tensor.
    """
    graph = model.graph
    constants = _constant_ints(onnx, graph)
    shapes = _shape_values(graph, constants)
    permuted = {
        node.output[0]
        for node in graph.node
        if node.op_type == "Gather"
        and node.output[0] in shapes
        and sorted(constants[node.input[1]].tolist()) == list(range(constants[node.input[1]].size))
    }
    read = {
        name
        for node in graph.node
        if node.op_type not in _SHAPE_READERS
        for name in node.input
        if name in permuted
    }
    if not read:
        return model
    copy = type(model)()
    copy.CopyFrom(model)
    nodes = list(copy.graph.node)
    del copy.graph.node[:]
    for node in nodes:
        if node.op_type not in _SHAPE_READERS:
            node.input[:] = [f"{n}/tensor" if n in read else n for n in node.input]
        copy.graph.node.append(node)
        for name in node.output:
            if name in read:
                cast = onnx.helper.make_node(
                    "Cast",
                    [name],
                    [f"{name}/tensor"],
                    AS_TENSOR + name,
                    to=7,  # INT64
                )
                copy.graph.node.append(cast)
    return copy


def _constant_ints(onnx, graph) -> dict:
    """``{name: numpy array}`` of the integer initializers and ``Constant`` outputs."""
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and len(node.attribute) == 1:
            if node.attribute[0].name == "value":
                arrays[node.output[0]] = onnx.numpy_helper.to_array(node.attribute[0].t)
    return {name: a for name, a in arrays.items() if a.dtype.kind in "iu"}


def _shape_values(graph, constants) -> set:
    """Names of the values that are shapes: ``Shape`` outputs, and ``Gather`` (axis 0) of
    them by a 1-D constant index."""
    shapes = set()
    for node in graph.node:
        if node.op_type == "Shape" and node.domain in ("", "ai.onnx"):
            shapes.add(node.output[0])
        elif node.op_type == "Gather" and node.input[0] in shapes and _axis(node) == 0:
            index = constants.get(node.input[1])
            if index is not None and index.ndim == 1:
                shapes.add(node.output[0])
    return shapes


def _axis(node) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 0)


def _split_sizes(node, shapes, constants) -> list | None:
    """The constant part sizes of a ``Split`` of a shape, else None."""
    if node.op_type != "Split" or node.domain not in ("", "ai.onnx"):
        return None
    if node.input[0] not in shapes or _axis(node) not in (0, -1):
        return None
    sizes = next((list(a.ints) for a in node.attribute if a.name == "split"), None)
    if sizes is None and len(node.input) > 1 and node.input[1] in constants:
        sizes = [int(v) for v in constants[node.input[1]].reshape(-1)]
    return sizes if sizes and len(sizes) == len(node.output) else None


def _as_slices(onnx, node, sizes: list) -> list:
    """``Constant`` bounds and one ``Slice`` a part of ``node`` (a ``Split``)."""
    helper, base = onnx.helper, node.name or node.output[0]
    nodes, start = [], 0
    for k, (out, size) in enumerate(zip(node.output, sizes)):
        bounds = [f"{base}/slice{k}_{w}" for w in ("starts", "ends", "axes")]
        for name, value in zip(bounds, (start, start + size, 0)):
            array = onnx.numpy_helper.from_array(np.array([value], "int64"), name)
            nodes.append(helper.make_node("Constant", [], [name], value=array))
        if out:
            nodes.append(helper.make_node("Slice", [node.input[0], *bounds], [out]))
        start += size
    return nodes


# ----------------------------------------------------------------------------- value helpers


def _ints(value):
    """The integers of an integer constant (flattened), else None."""
    if isinstance(value, tvm.ir.GenericConst):
        array = value.value.numpy()
        if array.dtype.kind in "iu":
            return [int(v) for v in array.ravel()]
    return None


def _scalar(value):
    """An int for a one-element integer constant, the expression for a PrimExpr, else None."""
    ints = _ints(value)
    if ints is not None:
        return ints[0] if len(ints) == 1 else None
    return value if tvm.ir.is_prim_expr(value) else None


def _dims(value):
    """The dims of a tensor with a known shape, else None."""
    ty = getattr(value, "ty", None)
    if isinstance(ty, relax.TensorType) and isinstance(ty.shape, relax.ShapeExpr):
        return list(ty.shape.values)
    return None


def _static(dim) -> bool:
    return isinstance(dim, (int, tirx.IntImm))


def _dtype(value) -> str:
    """The dtype of a constant or a PrimExpr."""
    if isinstance(value, tvm.ir.GenericConst):
        return str(value.value.numpy().dtype)
    return str(getattr(value, "dtype", None) or value.ty)


def _i64(value):
    if isinstance(value, int):
        return tirx.IntImm("int64", value)
    return value if _dtype(value) == "int64" else tirx.Cast("int64", value)


def _shape_analyzer(*exprs) -> Analyzer:
    """An analyzer that knows the symbolic dims in ``exprs`` are non-negative."""
    analyzer = Analyzer()
    for expr in exprs:
        for var in tirx.analysis.undefined_vars(expr):
            analyzer.update(var, ConstIntBound(0, ConstIntBound.POS_INF), override=True)
    return analyzer


def _symbolic_values(bb, expr):
    """The elements of a small integer tensor computed from shapes (``shape_to_tensor``, then
    reshapes, transposes, slices, concats and casts), as a numpy array of ints and PrimExprs;
    None where it is computed otherwise.

    torch's ``F.pad`` exports its amounts so: ``Shape``, arithmetic, then a reshape to pairs, a
    reversal and a transpose into ONNX's order, which TVM's importer turns into tensors whose
    values it no longer knows (torchvision's Swin at a symbolic image size): which amounts are
    constants is known only this way.
    """
    while isinstance(expr, relax.Var) and bb.lookup_binding(expr) is not None:
        expr = bb.lookup_binding(expr)
    if isinstance(expr, relax.ShapeExpr):
        return np.array(list(expr.values), dtype=object)
    if isinstance(expr, tvm.ir.GenericConst):
        array = expr.value.numpy()
        return array.astype(object) if array.dtype.kind in "iu" else None
    if not isinstance(expr, relax.Call) or not isinstance(expr.op, tvm.ir.Op):
        return None
    name, args = expr.op.name, expr.args
    if name == "relax.concat" and isinstance(args[0], relax.Tuple):
        parts = [_symbolic_values(bb, part) for part in args[0].fields]
        if any(part is None for part in parts):
            return None
        return np.concatenate(parts, axis=int(expr.attrs.axis))
    values = _symbolic_values(bb, args[0])
    if values is None:
        return None
    if name == "relax.shape_to_tensor":
        return values
    if name == "relax.astype":
        return values if str(expr.attrs.dtype).startswith(("int", "uint")) else None
    if name == "relax.reshape" and isinstance(args[1], relax.ShapeExpr):
        shape = [int_or_expr(d) for d in args[1].values]
        return values.reshape(shape) if all(isinstance(d, int) for d in shape) else None
    if name == "relax.permute_dims":
        axes = expr.attrs.axes
        return values.transpose(None if axes is None else [int(a) for a in axes])
    if name == "relax.strided_slice":
        bounds = [[int_or_expr(v) for v in arg] for arg in args[1:]]
        if len(bounds) == 3:
            bounds.append([1] * len(bounds[0]))
        if not all(isinstance(v, int) for arg in bounds for v in arg):
            return None
        index = [slice(None)] * values.ndim
        for axis, begin, end, stride in zip(*bounds):
            index[axis] = slice(begin, end, stride)
        return values[tuple(index)]
    return None


def constant_input(params, inputs, index):
    """Input ``index`` with initializers read as constants, None where it is absent."""
    from tvm.relax.frontend.onnx.onnx_frontend import get_constant

    if len(inputs) <= index or inputs[index] is None:
        return None
    return get_constant(inputs[index], params)


# ----------------------------------------------------------------------------- overrides


def _range(bb, inputs, attr, params, fallback):
    """``Range(start, limit, delta)`` with a symbolic start or limit and a constant delta.

    TVM computes the count as a run-time tensor and casts it to a fresh size ``range_len_N``,
    which no longer equals the sequence length; broadcasts with the sequence then lose their
    shape (XLNet's relative positions, ConvBERT). Here the count is the symbolic
    ``ceil((limit - start) / delta)``, used where it is provably non-negative.
    """
    values = [constant_input(params, inputs, i) for i in range(3)]
    start, limit, delta = (_scalar(v) for v in values)
    if not isinstance(delta, int) or delta == 0 or start is None or limit is None:
        return None
    if isinstance(start, int) and isinstance(limit, int):
        return None
    dtype = _dtype(values[0])
    if dtype not in ("int32", "int64"):
        return None
    start, limit = _i64(start), _i64(limit)
    span, step = (limit - start, delta) if delta > 0 else (start - limit, -delta)
    analyzer = _shape_analyzer(span)
    count = analyzer.simplify(tirx.floordiv(span + (step - 1), step))
    if not analyzer.can_prove(count >= 0):
        return None
    positions = relax.op.arange(relax.prim_value(_i64(0)), relax.prim_value(count), dtype="int64")
    first = relax.op.reshape(relax.op.shape_to_tensor(relax.ShapeExpr([start])), ())
    out = relax.op.add(relax.op.multiply(positions, relax.const(delta, "int64")), first)
    return out if dtype == "int64" else relax.op.astype(out, dtype)


def _slice_bound(value, dim):
    """A Slice bound on an axis of size ``dim``, as ONNX clamps it (a symbolic bound that is
    negative for every positive size counts from the end, as a constant one does)."""
    if not isinstance(value, int):
        return _shape_analyzer(dim).simplify(dim + value) if _negative(value) else value
    if value >= _END:
        return dim
    if value <= -_END:
        return _i64(0)
    if _static(dim):
        size = int(dim)
        return _i64(min(max(value + size, 0), size) if value < 0 else min(value, size))
    return _shape_analyzer(dim).simplify(dim + value) if value < 0 else _i64(value)


def _slice(bb, inputs, attr, params, fallback):
    """``Slice`` to the end (``INT64_MAX``) or from a negative constant, next to a symbolic
    axis or bound.

    With a symbolic bound TVM passes ``assume_inbound=True`` and does not clamp the constant
    ones (MPT: an extent of ``seq + 9223372036854775295``); on a symbolic axis it clamps with
    a ``min``/``max`` it cannot simplify (WavLM: ``min(max(L, 0), L + 1)``). Here the bounds
    are rewritten against the axis: ``INT64_MAX`` is its size, ``-k`` is ``size - k``, and
    other constants are clamped where the axis is static. Steps must be 1.
    """
    dims = _dims(inputs[0]) if len(inputs) >= 3 else None
    found = None if dims is None else _slice_args(inputs, params, len(dims))
    if found is None:
        return None
    axes, starts, ends = found
    constants = [b for b in starts + ends if isinstance(b, int)]
    symbolic = len(constants) < 2 * len(axes) or not all(_static(dims[a]) for a in axes)
    negative = any(_negative(b) for b in starts + ends if not isinstance(b, int))
    if not symbolic or (all(0 <= b < _END for b in constants) and not negative):
        return None
    starts = [relax.prim_value(_slice_bound(b, dims[a])) for a, b in zip(axes, starts)]
    ends = [relax.prim_value(_slice_bound(b, dims[a])) for a, b in zip(axes, ends)]
    ones = [relax.prim_value(_i64(1))] * len(axes)
    return relax.op.strided_slice(inputs[0], axes, starts, ends, ones, assume_inbound=True)


def _negative(value) -> bool:
    """Whether a symbolic bound is negative for all positive sizes (``-seq``: the legacy
    exporter's ``x[:, :, -seq:]``, T5's position bias). TVM's converter and Relax take such a
    start as it is: T5's encoder exported by optimum sliced ``2 * seq`` rows off a ``seq``
    axis and refused every input at run time."""
    analyzer = Analyzer()
    for var in tirx.analysis.undefined_vars(value):
        analyzer.update(var, ConstIntBound(1, ConstIntBound.POS_INF), override=True)
    return analyzer.can_prove(value < 0)


def _slice_args(inputs, params, rank):
    """``(axes, starts, ends)`` of a Slice with static axes and unit steps (bounds int or
    PrimExpr), else None."""
    bounds = [constant_input(params, inputs, i) for i in (1, 2)]
    bounds = [
        _ints(b) or (list(b.values) if isinstance(b, relax.ShapeExpr) else None) for b in bounds
    ]
    axes, steps = (constant_input(params, inputs, i) for i in (3, 4))
    if None in bounds or len(bounds[0]) != len(bounds[1]):
        return None
    axes = list(range(len(bounds[0]))) if axes is None else _ints(axes)
    if axes is None or len(axes) != len(bounds[0]) or not all(-rank <= a < rank for a in axes):
        return None
    if steps is not None and set(_ints(steps) or [0]) != {1}:
        return None
    return [a % rank for a in axes], bounds[0], bounds[1]


def _gather(bb, inputs, attr, params, fallback):
    """``Gather`` (axis 0) of a shape.

    A shape held in a variable (``Shape`` of a tensor whose dims TVM does not know) reaches
    TVM's converter, which calls ``shape_of`` on it and fails: it is made a tensor first. A
    1-D constant index into a shape becomes a run-time tensor in TVM even where the picked dims
    are static (DeBERTa v1's ``chunk``: ``Shape(x)[[-1]]``), and a later ``Slice`` or
    ``Reshape`` reading it loses its shape: it is a constant here. A permutation of all the
    dims is onnxruntime's transpose optimiser's ``Shape(Transpose(x, perm))`` (level-99 LLaMA
    files): a shape, as ``Shape`` gives it, which a later ``Gather``, ``Concat`` or
    ``Reshape`` takes where a tensor failed ("Reshape requires the input new shape to be
    Shape").
    """
    data, index = inputs[0], inputs[1]
    if attr.get("axis", 0) != 0:
        return None
    if isinstance(data, relax.ShapeExpr):
        picks = _ints(index)
        if picks is None or index.value.numpy().ndim != 1:
            return None
        if sorted(picks) == list(range(len(data.values))):  # Shape(Transpose(x)), as a shape
            return relax.ShapeExpr([data.values[i] for i in picks])
        if not all(-len(data.values) <= i < len(data.values) for i in picks):
            return None
        dims = [data.values[i] for i in picks]
        if not all(_static(d) for d in dims):
            return None
        return relax.const(np.array([int(d) for d in dims], "int64"), "int64")
    if isinstance(data, relax.Expr) and isinstance(data.ty, relax.ShapeType):
        shape = bb.normalize(relax.op.shape_to_tensor(data))
        return fallback(bb, [shape, *inputs[1:]], attr, params)
    return None


def _expand(bb, inputs, attr, params, fallback):
    """``Expand`` of a tensor with symbolic dims to a constant shape.

    TVM reads ``dim.value`` of every input dim and fails on a symbolic one (WavLM). Here each
    target dim of -1 or 1 keeps the input's dim, and a static one needs an input dim of 1 or
    the same size; anything else is left to TVM.
    """
    data, target = inputs[0], _ints(constant_input(params, inputs, 1))
    dims = _dims(data)
    if target is None or dims is None or all(_static(d) for d in dims):
        return None
    rank = max(len(dims), len(target))
    padded = [_i64(1)] * (rank - len(dims)) + dims
    target = [1] * (rank - len(target)) + target
    out = []
    for dim, size in zip(padded, target):
        if size in (-1, 1):
            out.append(dim)
        elif _static(dim) and int(dim) in (1, size):
            out.append(_i64(size))
        else:
            return None
    if rank == len(dims) and all(a.same_as(b) for a, b in zip(out, dims)):
        return data
    return relax.op.broadcast_to(data, relax.ShapeExpr(out))


def _pad(bb, inputs, attr, params, fallback):
    """``Pad`` in constant mode: constant pads as ``relax.nn.pad`` (:func:`_constant_pad`),
    and pads known only at run time.

    ``F.pad`` with amounts computed from shapes exports them as a tensor computation, and TVM
    takes constant pads only ("Dynamic pads are not supported yet", SEW-D). Here the pads are
    cast into fresh sizes and padded with; they must be non-negative.
    """
    from tvm import topi
    from tvm.relax.frontend.onnx.onnx_frontend import _tensor_to_shape_expr

    data, pads, value = (
        inputs[0],
        constant_input(params, inputs, 1),
        constant_input(params, inputs, 2),
    )
    ty = getattr(data, "ty", None)
    rank = ty.ndim if isinstance(ty, relax.TensorType) else -1
    if attr.get("mode", b"constant") not in (b"constant", "constant") or rank < 0:
        return None
    if constant_input(params, inputs, 3) is not None:  # Pad-18 axes
        return None
    if value is not None and not isinstance(value, tvm.ir.GenericConst):
        return None
    if isinstance(pads, tvm.ir.GenericConst):
        return _constant_pad(bb, data, pads, value, rank)
    # A shape as pads never gets here (TVM refuses shape inputs to Pad before converting); a
    # tensor of pads must be 1-D, of 2 * rank elements.
    pads_ty = getattr(pads, "ty", None)
    if not isinstance(pads_ty, relax.TensorType):
        return None
    length = (_dims(pads) or [None])[0]
    if pads_ty.ndim != 1 or (_static(length) and int(length) != 2 * rank):
        return None
    value = 0.0 if value is None else value.value.numpy().item()
    known = _symbolic_values(bb, pads)
    known = list(known.ravel()) if known is not None and known.size == 2 * rank else None
    if known is None or not all(_static(k) for k in known):
        pads = pads if pads_ty.dtype == "int64" else bb.normalize(relax.op.astype(pads, "int64"))
        amounts = list(_tensor_to_shape_expr(bb, pads, 2 * rank, "pad").values)
    if known is not None:
        # A constant amount (0 on the axes not padded) is kept: a fresh size there hides that
        # the axis keeps its size (the LayerNorm after Swin's PatchMerging lost its shape).
        # The others stay run-time sizes: as the graph's expressions they grow with every
        # stage, and lowering Swin's kernels ran for over 25 minutes without ending.
        amounts = [int(k) if _static(k) else amounts[i] for i, k in enumerate(known)]
    return bb.emit_te(topi.nn.pad, data, amounts[:rank], amounts[rank:], value)


def _constant_pad(bb, data, pads, value, rank):
    """Constant non-negative pads as ``relax.nn.pad`` (TVM emits a TE ``call_tir``), which
    :mod:`tvmamp.relay_passes.pad_into_conv` can fold into the convolution that reads it (a
    ``padding="same"`` export); else None, for TVM's converter."""
    widths = [int(w) for w in pads.value.numpy().ravel()]
    if len(widths) != 2 * rank or min(widths) < 0:
        return None
    fill = 0.0 if value is None else float(value.value.numpy().item())
    interleaved = [w for axis in range(rank) for w in (widths[axis], widths[rank + axis])]
    return bb.normalize(relax.op.nn.pad(data, interleaved, "constant", fill))


def _conv(bb, inputs, attr, params, fallback):
    """``Conv`` with ``auto_pad`` SAME_UPPER or SAME_LOWER over static spatial sizes, with its
    pads computed here: TVM pads such an input with a kernel of its own (timm's ConvMixer
    exports ``padding="same"`` so), which the conv-to-GEMM rewrite cannot follow."""
    mode = _text(attr.get("auto_pad", b"NOTSET"))
    dims, kernel = _dims(inputs[0]), _dims(inputs[1])
    if mode not in ("SAME_UPPER", "SAME_LOWER") or dims is None or kernel is None:
        return None
    spatial = dims[2:]
    sizes = list(attr.get("kernel_shape", kernel[2:]))
    if not all(_static(d) for d in (*spatial, *sizes)):
        return None
    strides = list(attr.get("strides", [1] * len(spatial)))
    dilations = list(attr.get("dilations", [1] * len(spatial)))
    before, after = [], []
    for size, k, stride, dilation in zip(spatial, sizes, strides, dilations, strict=True):
        size, k = int(size), int(k)
        out = -(-size // int(stride))
        total = max(0, (out - 1) * int(stride) + (k - 1) * int(dilation) + 1 - size)
        first = total // 2 if mode == "SAME_UPPER" else total - total // 2
        before.append(first)
        after.append(total - first)
    explicit = {**attr, "auto_pad": b"NOTSET", "pads": before + after}
    return fallback(bb, inputs, explicit, params)


def _cast(bb, inputs, attr, params, fallback):
    """``Cast`` of a shape to int64: the shape itself (TVM makes it a tensor), except where
    :func:`permuted_shapes_as_tensors` asks for a tensor."""
    from onnx import TensorProto

    named = attr.get("tvm_custom", {}).get("name") or ""
    if isinstance(inputs[0], relax.ShapeExpr) and attr.get("to") == TensorProto.INT64:
        return None if named.startswith(AS_TENSOR) else inputs[0]
    return None


def _reshape(bb, inputs, attr, params, fallback):
    """``Reshape`` of a symbolic scalar (a ``Squeeze`` of a ``Shape`` slice, or arithmetic
    on such) to one element: the shape ``[value]``, as TVM's ``Unsqueeze`` makes it.
    ``torch.onnx.export(dynamo=True)`` writes every size it computes so (``batch * heads``,
    ``past + seq``) before a ``Concat`` into a shape; TVM holds the scalar as a PrimExpr,
    and its ``Reshape`` accepts tensors only (nn.TransformerEncoder and decoders with a
    key/value cache, exported with dynamic shapes, failed to import)."""
    value = inputs[0]
    if not tvm.ir.is_prim_expr(value):
        return _reshape_inferred(inputs[0], constant_input(params, inputs, 1), attr)
    shape = _ints(constant_input(params, inputs, 1))
    if shape == []:
        return value
    if shape is not None and len(shape) == 1 and shape[0] in (-1, 1):
        return relax.ShapeExpr([_i64(value)])
    return None


def _reshape_inferred(data, shape, attr):
    """``Reshape`` of a tensor with symbolic dims to a shape (computed at run time) with one
    ``-1``, that dim given as the input's dims left over once the target's other dims are
    cancelled against them. Relax infers ``-1`` as the quotient of two products, which it
    cannot simplify when a dim is a sum: ``[batch, 4, past + seq, 16] -> [-1, past + seq,
    16]`` gave ``batch * (past + seq) * 64 // (past * 16 + seq * 16)``, a kernel over which
    LLVM codegen failed ("Binding of variable rmod ... conflicts"), in every decoder with a
    key/value cache exported by ``torch.onnx.export(dynamo=True)`` with dynamic shapes.
    None where the dims do not cancel so (TVM's converter then infers it)."""
    dims = _dims(data)
    if not isinstance(shape, relax.ShapeExpr) or dims is None:
        return None
    target = [int_or_expr(d) for d in shape.values]
    if sum(1 for d in target if isinstance(d, int) and d == -1) != 1 or any(
        isinstance(d, int) and d < -1 for d in target
    ):
        return None
    if not attr.get("allowzero", 0):  # 0 copies the input's dim
        target = [dims[k] if isinstance(d, int) and d == 0 else d for k, d in enumerate(target)]
    if any(isinstance(d, int) and d == 0 for d in target) or all(_static(d) for d in dims):
        return None
    known = [d for d in target if not (isinstance(d, int) and d == -1)]
    inferred = _quotient(dims, known)
    if inferred is None:
        return None
    out = [inferred if isinstance(d, int) and d == -1 else _i64(d) for d in target]
    return relax.op.reshape(data, relax.ShapeExpr(out))


def _factors(dims) -> tuple[int, list]:
    """The product of ``dims`` as a constant and a list of symbolic factors."""
    constant, symbolic = 1, []
    pending = list(dims)
    while pending:
        dim = pending.pop()
        if _static(dim):
            constant *= int(dim)
        elif isinstance(dim, tirx.Mul):
            pending += [dim.a, dim.b]
        else:
            symbolic.append(dim)
    return constant, symbolic


def _quotient(dims, known):
    """``prod(dims) / prod(known)`` as a product of the factors of ``dims`` that ``known``'s
    do not cancel, or None where some factor of ``known`` cancels none, or the constants do
    not divide."""
    top, numerator = _factors(dims)
    bottom, denominator = _factors(known)
    if bottom == 0 or top % bottom:
        return None
    analyzer = _shape_analyzer(*numerator, *denominator)
    for factor in denominator:
        equal = [k for k, n in enumerate(numerator) if analyzer.can_prove_equal(n, factor)]
        if not equal:
            return None
        numerator.pop(equal[0])
    result = tirx.IntImm("int64", top // bottom)
    for factor in numerator:
        result = result * _i64(factor)
    return analyzer.simplify(result)


def _resize(bb, inputs, attr, params, fallback):
    """``Resize`` of an NCHW tensor over symbolic spatial sizes, or to symbolic sizes, given as a
    shape, or by constant scales of 1 on the batch and channels (module docstring). (DeepLabV3's
    pooled branch resizes ``[n, c, 1, 1]`` to the feature map's size.) Anything else (a
    region of interest, ``axes``, an aspect-ratio policy, antialiasing) is left to TVM."""
    from .common import UnsupportedOperatorError

    data = inputs[0]
    dims = _dims(data)
    roi, scales, sizes = (constant_input(params, inputs, i) for i in (1, 2, 3))
    shaped = isinstance(sizes, relax.ShapeExpr) and not all(_static(d) for d in sizes.values)
    if dims is None or len(dims) != 4 or (all(_static(d) for d in dims[2:]) and not shaped):
        return None
    policy = attr.get("keep_aspect_ratio_policy", b"stretch")
    if roi is not None or "axes" in attr or attr.get("antialias", 0) or policy != b"stretch":
        return None
    if isinstance(sizes, relax.ShapeExpr) and len(sizes.values) == 4 and scales is None:
        out = list(sizes.values[2:])
    elif isinstance(scales, tvm.ir.GenericConst) and sizes is None:
        values = scales.value.numpy().astype(np.float32).ravel().tolist()
        if len(values) != 4 or values[:2] != [1.0, 1.0]:
            return None
        checked, out = list(dims), []
        for axis in (2, 3):
            ratio = Fraction(values[axis]).limit_denominator(64)
            if np.float32(ratio.numerator / ratio.denominator) != np.float32(values[axis]):
                raise UnsupportedOperatorError(
                    f"tvmamp.from_onnx: Resize with scale {values[axis]:g} on axis {axis} of "
                    f"symbolic size {dims[axis]}: its output size floor(in * scale) is not "
                    "exact in integer arithmetic. Export it with `sizes` (F.interpolate("
                    "size=...)) or pass a static shape_dict.",
                    ["Resize"],
                )
            if _static(dims[axis]) and int(dims[axis]) % ratio.denominator:
                return None  # prepare_for_import rewrote or refused it; defer to TVM
            whole = dims[axis] // ratio.denominator
            if not _static(dims[axis]) and ratio.denominator > 1:
                checked[axis] = whole * ratio.denominator
            out.append(_shape_analyzer(dims[axis]).simplify(whole * ratio.numerator))
        if any(not a.same_as(b) for a, b in zip(checked, dims)):
            data = bb.match_cast(data, relax.TensorType(checked, data.ty.dtype))
    else:
        return None
    mode = _text(attr.get("mode", b"nearest"))
    return relax.op.image.resize2d(
        data,
        size=relax.ShapeExpr([_i64(d) for d in out]),
        roi=[0.0] * 4,
        layout="NCHW",
        method="nearest_neighbor" if mode == "nearest" else mode,
        coordinate_transformation_mode=_text(
            attr.get("coordinate_transformation_mode", b"half_pixel")
        ),
        rounding_method=_text(attr.get("nearest_mode", b"round_prefer_floor")),
        cubic_alpha=attr.get("cubic_coeff_a", -0.75),
        cubic_exclude=attr.get("exclude_outside", 0),
        extrapolation_value=attr.get("extrapolation_value", 0.0),
    )


def _text(value) -> str:
    return value.decode("ascii") if isinstance(value, bytes) else str(value)


def _concat(bb, inputs, attr, params, fallback):
    """``Concat`` of tensors whose dims off the axis TVM cannot prove equal: each such dim is
    unified (:func:`_unified`), and the concat left to TVM."""
    shapes = [_dims(x) for x in inputs]
    if not shapes or any(s is None for s in shapes) or len({len(s) for s in shapes}) != 1:
        return None
    rank = len(shapes[0])
    cast = _unified(bb, inputs, shapes, {attr.get("axis", 0) % rank} if rank else set())
    return None if cast is None else fallback(bb, cast, attr, params)


def _elementwise(bb, inputs, attr, params, fallback):
    """A binary elementwise op (``Add``, ``Mul``...) of two tensors of one rank whose dims TVM
    cannot prove equal: DLA's residual adds a strided conv's ``(h - 1) // 4 + 1`` rows to a
    max pool's ``(h - 3) // 4 + 1``, equal for the sizes the model takes; a decoder with a
    key/value cache adds a ``(batch, 1, 1, total)`` mask to ``(batch, heads, seq, past +
    seq)`` scores. TVM gave the result no shape, and the next ``MaxPool`` or ``Reshape``
    failed. The dims are unified (:func:`_unified`; onnxruntime fails on sizes where they
    differ), but for those where either side is a static 1 (a broadcast), and the op left to
    TVM."""
    shapes = [_dims(x) for x in inputs]
    if len(inputs) != 2 or any(s is None for s in shapes) or len(shapes[0]) != len(shapes[1]):
        return None
    broadcast = {
        k for k, ds in enumerate(zip(*shapes)) if any(_static(d) and int(d) == 1 for d in ds)
    }
    cast = _unified(bb, inputs, shapes, broadcast)
    return None if cast is None else fallback(bb, cast, attr, params)


def _unified(bb, inputs, shapes, skipped):
    """``inputs`` ``match_cast`` so that their dims (but on the ``skipped`` axes) are the same
    expressions, or None where TVM proves them equal already. Each dim is a static one where
    there is one, else the first that is not a plain variable: TVM's CanonicalizeBindings
    substitutes ``h -> h // 4 * 4`` from a match_cast to a variable that the other dim is an
    expression of, without end (a segfault). The casts check the sizes at run time."""
    rank = len(shapes[0])
    analyzer = _shape_analyzer(*(d for s in shapes for d in s))
    unified = list(shapes[0])
    changed = False
    for k in range(rank):
        column = [s[k] for s in shapes]
        if k in skipped or all(analyzer.can_prove_equal(column[0], d) for d in column[1:]):
            continue
        ranked = [d for d in column if _static(d)]
        ranked += [d for d in column if not isinstance(d, tirx.Var)]
        unified[k] = (ranked or column)[0]
        changed = True
    if not changed:
        return None
    cast = []
    for x, shape in zip(inputs, shapes):
        want = [shape[k] if k in skipped else unified[k] for k in range(rank)]
        if any(not analyzer.can_prove_equal(a, b) for a, b in zip(want, shape)):
            x = bb.match_cast(x, relax.TensorType(want, x.ty.dtype))
        cast.append(x)
    return cast


def _pool(bb, inputs, attr, params, fallback):
    """``MaxPool`` (or ``AveragePool`` not counting its padding) with ``ceil_mode`` over
    symbolic sizes, as floor mode with the end padding grown by ``stride - 1``, where that is
    the same: where no last window can start past the input (PyTorch and onnxruntime drop such
    a window), i.e. the end padding is at most ``kernel - stride``. Relax types a ceil-mode
    output over a symbolic size with an ``if_then_else`` that no later pass can carry (FuseOps
    failed: "Cannot find the FInferType attribute registered to op: prim.if_then_else",
    torchvision's GoogLeNet exported with dynamic sizes)."""
    dims = _dims(inputs[0])
    if not attr.get("ceil_mode", 0) or dims is None or all(_static(d) for d in dims[2:]):
        return None
    if _text(attr.get("auto_pad", b"NOTSET")) != "NOTSET" or attr.get("count_include_pad", 0):
        return None
    kernel = list(attr["kernel_shape"])
    rank = len(kernel)
    strides = list(attr.get("strides", [1] * rank))
    dilations = list(attr.get("dilations", [1] * rank))
    pads = list(attr.get("pads", [0] * 2 * rank))
    span = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    if any(pads[rank + i] > span[i] - strides[i] for i in range(rank)):
        return None
    grown = pads[:rank] + [pads[rank + i] + strides[i] - 1 for i in range(rank)]
    return fallback(bb, inputs, {**attr, "ceil_mode": 0, "pads": grown}, params)


def _clip(bb, inputs, attr, params, fallback):
    """``Clip`` by constant scalar bounds (inputs, or attributes before opset 11; or none) as
    ``relax.op.clip``: TVM emits a TE ``maximum`` and ``minimum`` call, which the NHWC rows of
    the CPU conv rewrite cannot follow (MobileNetV2's ReLU6 sent every block back to NCHW:
    2.6x onnxruntime's time with dynamic image sizes). A NaN bound is no bound, as onnxruntime
    has it."""
    bounds = []
    for index, name, default in ((1, "min", -np.inf), (2, "max", np.inf)):
        if name in attr:  # Clip-1 and Clip-6: attributes
            bounds.append(float(attr[name]))
            continue
        bound = constant_input(params, inputs, index)
        if bound is None:
            bounds.append(default)
            continue
        if not isinstance(bound, tvm.ir.GenericConst) or bound.value.numpy().size != 1:
            return None
        value = float(bound.value.numpy().reshape(()))
        bounds.append(default if np.isnan(value) else value)
    ty = getattr(inputs[0], "ty", None)
    if not isinstance(ty, relax.TensorType) or not str(ty.dtype).startswith(("float", "bfloat")):
        return None
    return relax.op.clip(inputs[0], *bounds)


OVERRIDES = {
    "Cast": _cast,
    "Reshape": _reshape,
    "Resize": _resize,
    "Concat": _concat,
    "MaxPool": _pool,
    "Clip": _clip,
    "AveragePool": _pool,
    **{op: _elementwise for op in ("Add", "Sub", "Mul", "Div", "Max", "Min")},
    "Range": _range,
    "Slice": _slice,
    "Gather": _gather,
    "Expand": _expand,
    "Pad": _pad,
    "Conv": _conv,
}
