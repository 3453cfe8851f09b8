"""Rewrites of a decomposed ExportedProgram's graph that TVM's PyTorch importer needs.

Each rewrite keeps the program's meaning and turns a pattern TVM's importer translates wrongly
or refuses into one it translates right. They run on the program returned by
``run_decompositions`` (a new program), never on the caller's.
"""

from __future__ import annotations

CAT_OPS = ("cat.default", "concat.default")


def drop_legacy_empty_cat_inputs(program) -> int:
    """Remove the 1-D empty tensors from ``aten.cat`` inputs; return how many were removed.

    ``torch.cat`` skips any input of shape ``(0,)`` whatever the rank of the others (a legacy
    rule). Hugging Face's ``DynamicCache`` relies on it: its first ``update`` concatenates the
    4-D key and value states to ``torch.tensor([])``. TVM's ``concat`` requires one rank and
    fails ("Concat expects all input tensors to have same ndim"). A cat left with one input
    is that input (exported graphs are functional, so no copy is needed). A cat whose other
    inputs have another dtype than its result (torch promotes across all inputs) is left alone.
    """
    graph = program.graph
    removed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or _overload_name(node) not in CAT_OPS:
            continue
        tensors = list(node.args[0])
        kept = [t for t in tensors if not _is_legacy_empty(t)]
        if not kept or len(kept) == len(tensors) or not all(_same_dtype(t, node) for t in kept):
            continue
        removed += len(tensors) - len(kept)
        if len(kept) == 1:
            node.replace_all_uses_with(kept[0])
            graph.erase_node(node)
        else:
            node.args = (kept, *node.args[1:])
    if removed:
        graph.eliminate_dead_code()
        program.graph_module.recompile()
    return removed


def _overload_name(node) -> str:
    return getattr(node.target, "__name__", "")


def _value(node):
    return node.meta.get("val") if hasattr(node, "meta") else None


def _is_legacy_empty(node) -> bool:
    value = _value(node)
    return value is not None and hasattr(value, "shape") and tuple(value.shape) == (0,)


def _same_dtype(source, cat) -> bool:
    a, b = _value(source), _value(cat)
    return a is not None and b is not None and getattr(a, "dtype", None) == b.dtype


CUMULATIVE_OPS = ("cumsum.default", "cumprod.default")


def give_cumulative_ops_their_dtype(program) -> int:
    """Name the result dtype of ``aten.cumsum``/``cumprod`` calls that promote; return how many.

    torch computes a cumulative sum of a bool or integer tensor in int64 when no ``dtype`` is
    given (Hugging Face decoders build position ids as ``attention_mask.cumsum(-1)``); TVM's
    importer keeps the input dtype, and LLVM then fails to add bools ("MatchesCode(kDLFloat)").
    Passing the result dtype that torch.export recorded makes both agree.
    """
    changed = 0
    for node in program.graph.nodes:
        if node.op != "call_function" or _overload_name(node) not in CUMULATIVE_OPS:
            continue
        source, result = _value(node.args[0]), _value(node)
        if source is None or result is None or node.kwargs.get("dtype") is not None:
            continue
        if source.dtype != result.dtype:
            node.kwargs = {**node.kwargs, "dtype": result.dtype}
            changed += 1
    if changed:
        program.graph_module.recompile()
    return changed


def count_from_the_start_in_selects(program) -> int:
    """Give ``aten.select.int`` calls a non-negative index; return how many were rewritten.

    ``x[:, -1]`` (an RNN's last step, a decoder's last token) exports as ``select(x, 1, -1)``.
    TVM's importer makes it ``take(x, -1, mode="fast")``, which reads before the tensor: the
    result is whatever memory lies there, silently (a GRU classifier returned 3.6e33). With a
    static size the index becomes ``size + index``; along a symbolic dimension the select
    becomes ``squeeze(slice(x, dim, index, index + 1))``, whose negative start TVM resolves.
    """
    import torch

    graph, changed = program.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or _overload_name(node) != "select.int":
            continue
        source, dim, index = node.args[0], node.args[1], node.args[2]
        value = _value(source)
        if not isinstance(index, int) or index >= 0 or value is None:
            continue
        dim = dim % value.dim()
        size = value.shape[dim]
        if isinstance(size, int):
            node.args = (source, dim, size + index)
        else:
            aten = torch.ops.aten
            with graph.inserting_before(node):
                end = index + 1 if index < -1 else None
                part = graph.call_function(aten.slice.Tensor, (source, dim, index, end))
                squeezed = graph.call_function(aten.squeeze.dim, (part, dim))
            squeezed.meta = dict(node.meta)
            node.replace_all_uses_with(squeezed)
            graph.erase_node(node)
        changed += 1
    if changed:
        program.graph_module.recompile()
    return changed


def give_group_norms_their_affine(program) -> int:
    """Pass ones and zeros to ``native_group_norm`` calls without a weight or bias; return how
    many calls changed.

    ``GroupNorm(affine=False)`` exports its weight and bias as None, and TVM's importer emits a
    ``group_norm`` with null arguments, which fails with "Found null pointer node while
    traversing AST". A weight of ones and a bias of zeros compute the same.
    """
    import torch

    graph, changed = program.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or _overload_name(node) != "native_group_norm.default":
            continue
        data, weight, bias, _, channels = node.args[:5]
        if weight is not None and bias is not None:
            continue
        value = _value(data)
        dtype = value.dtype if value is not None else torch.float32
        with graph.inserting_before(node):
            fill = {"dtype": dtype, "device": torch.device("cpu")}
            if weight is None:
                weight = graph.call_function(torch.ops.aten.ones.default, ([channels],), fill)
            if bias is None:
                bias = graph.call_function(torch.ops.aten.zeros.default, ([channels],), fill)
        node.args = (data, weight, bias, *node.args[3:])
        changed += 1
    if changed:
        program.graph_module.recompile()
    return changed


INDEX_OPS = ("index.Tensor", "index_put.default", "index_put_.default")


def wrap_negative_index_tensors(program) -> int:
    """Make the integer index tensors of ``aten.index.Tensor`` and ``index_put`` non-negative;
    return how many.

    ``x[:, [-1, 0]]`` indexes with a tensor holding -1; TVM's importer makes it a ``take`` in
    "fast" mode, which reads before the tensor (silently wrong, as for ``select``), and
    tvmamp's ``index_put`` converter scatters with ``scatter_nd``, which reads no negative
    index either. Each index
    tensor along a dimension of size ``n`` becomes ``where(i < 0, i + n, i)``, so run-time
    indices are handled too; along a symbolic dimension (a dynamic batch) ``n`` is its
    ``sym_size``.
    """
    import torch

    aten, graph, changed = torch.ops.aten, program.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or _overload_name(node) not in INDEX_OPS:
            continue
        source, indices = node.args[0], list(node.args[1])
        value = _value(source)
        if value is None:
            continue
        for dim, index in enumerate(indices):
            index_value = _value(index) if index is not None else None
            size = value.shape[dim] if dim < value.dim() else None
            if (
                index_value is None
                or index_value.dtype.is_floating_point
                or index_value.dtype == torch.bool
            ):
                continue
            with graph.inserting_before(node):
                if not isinstance(size, int):  # a symbolic dimension (a dynamic batch)
                    size = graph.call_function(aten.sym_size.int, (source, dim))
                    size.meta["val"] = value.shape[dim]
                negative = graph.call_function(aten.lt.Scalar, (index, 0))
                shifted = graph.call_function(aten.add.Tensor, (index, size))
                wrapped = graph.call_function(aten.where.self, (negative, shifted, index))
            negative.meta["val"] = index_value < 0
            shifted.meta["val"] = index_value  # same shape and dtype
            wrapped.meta["val"] = index_value
            indices[dim] = wrapped
            changed += 1
        node.args = (source, indices, *node.args[2:])
    if changed:
        program.graph_module.recompile()
    return changed


def put_grid_channels_first(program) -> int:
    """Give ``grid_sampler_2d`` its grid as ``[N, 2, H, W]``; return how many calls changed.

    torch's grid is ``[N, H, W, 2]``; TVM's importer passes it as it is to
    ``relax.op.image.grid_sample``, which reads ``[N, 2, H, W]``: the result had the shape
    ``[N, C, W, 2]``, silently. A ``permute(grid, [0, 3, 1, 2])`` makes the two agree.
    """
    import torch

    graph, changed = program.graph, 0
    for node in list(graph.nodes):
        if node.op != "call_function" or _overload_name(node) != "grid_sampler_2d.default":
            continue
        grid = node.args[1]
        value = _value(grid)
        if value is None or value.dim() != 4:
            continue
        with graph.inserting_before(node):
            moved = graph.call_function(torch.ops.aten.permute.default, (grid, [0, 3, 1, 2]))
        moved.meta["val"] = value.permute(0, 3, 1, 2)
        node.args = (node.args[0], moved, *node.args[2:])
        changed += 1
    if changed:
        program.graph_module.recompile()
    return changed


# Elementwise binary ops whose result dtype is the one torch computes in (type promotion).
ARITHMETIC_OPS = frozenset(
    f"{op}.{overload}"
    for op in ("add", "sub", "rsub", "mul", "div", "floor_divide", "remainder", "fmod", "pow")
    for overload in ("Tensor", "Scalar", "Tensor_mode", "Scalar_mode", "default")
) | {"pow.Tensor_Scalar", "pow.Tensor_Tensor", "remainder.Scalar_Tensor"}
# Comparisons: a bool result, computed in the promoted dtype of their operands.
COMPARISON_OPS = frozenset(
    f"{op}.{overload}"
    for op in ("eq", "ne", "lt", "le", "gt", "ge")
    for overload in ("Tensor", "Scalar")
)


def compute_binary_ops_in_their_dtype(program) -> int:
    """Cast the tensor operands of binary ops to the dtype torch computes them in; return how
    many operands were cast.

    TVM's importer converts a Python scalar operand to the tensor's dtype and divides two
    integer tensors in integers, where torch promotes: ``int_tensor * 2.5`` multiplied by 2,
    ``int_tensor / 3`` truncated and ``int_tensor < 2.5`` compared with 2 (all silently wrong),
    and ``int_tensor // 2.5`` failed ("Binary operators must have the same datatype"). An
    operand whose dtype is not the one torch computes in (the result's dtype for arithmetic,
    ``torch.result_type`` of the operands for comparisons) gets an ``aten._to_copy`` to it.
    """
    import torch

    graph, changed = program.graph, 0
    for node in list(graph.nodes):
        name = _overload_name(node)
        if node.op != "call_function" or (name not in ARITHMETIC_OPS | COMPARISON_OPS):
            continue
        operands = list(node.args[:2])
        values = [_value(a) if hasattr(a, "meta") else a for a in operands]
        if len(values) < 2 or not all(_is_tensor_or_number(torch, v) for v in values):
            continue
        result = _value(node)
        if not isinstance(result, torch.Tensor):
            continue
        dtype = result.dtype
        if name in COMPARISON_OPS:
            dtype = torch.result_type(*(_dtype_stand_in(torch, v) for v in values))
        for i, (arg, value) in enumerate(zip(operands, values)):
            if not isinstance(value, torch.Tensor) or value.dtype == dtype:
                continue
            with graph.inserting_before(node):
                cast = graph.call_function(
                    torch.ops.aten._to_copy.default, (arg,), {"dtype": dtype}
                )
            cast.meta["val"] = value.to(dtype)
            operands[i] = cast
            changed += 1
        node.args = (*operands, *node.args[2:])
    if changed:
        program.graph_module.recompile()
    return changed


def _is_tensor_or_number(torch, value) -> bool:
    return isinstance(value, (torch.Tensor, bool, int, float))


def _dtype_stand_in(torch, value):
    """``value`` for ``torch.result_type``: a Python number, or an empty tensor of the tensor's
    dtype and rank (a 0-d tensor promotes like a scalar)."""
    if isinstance(value, torch.Tensor):
        return torch.empty([0] * value.dim(), dtype=value.dtype)
    return value
