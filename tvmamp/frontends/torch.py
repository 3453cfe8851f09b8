"""Import PyTorch models: torch.export, then TVM's ExportedProgram importer, params detached."""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Mapping

from . import torch_moe, torch_ops, torch_pool
from .common import UnsupportedOperatorError, node_arg, rename_params, require, split_params
from .torch_graph import (
    compute_binary_ops_in_their_dtype,
    count_from_the_start_in_selects,
    drop_legacy_empty_cat_inputs,
    give_cumulative_ops_their_dtype,
    give_group_norms_their_affine,
    put_grid_channels_first,
    wrap_negative_index_tensors,
)

TRAIN_MODES = ("eval", "error")

# Ops that only a train-mode module exports (after decomposition); TVM imports them wrongly
# for inference (dropout as identity, BatchNorm without its running-stat updates).
_TRAIN_ONLY_OPS = {
    "_native_batch_norm_legit_functional.default": "BatchNorm with batch statistics",
    "native_dropout.default": "dropout",
}

# ATen ops that draw random numbers. TVM's importer bakes one fixed draw into the build
# (randn, randn_like), passes the input through (bernoulli) or returns zeros (exponential);
# the rest it lacks.
_RANDOM_OPS = frozenset(
    "bernoulli cauchy exponential geometric log_normal multinomial normal poisson rand "
    "rand_like randint randint_like randn randn_like randperm uniform".split()
)


def from_torch(
    module,
    example_inputs,
    *,
    dynamic_batch: bool = False,
    train_mode: str = "eval",
    custom_convert_map: Mapping | None = None,
):
    """Import a ``torch.nn.Module`` (or a ``torch.export.ExportedProgram``) into Relax.

    Parameters
    ----------
    module : torch.nn.Module or torch.export.ExportedProgram
        The model. An ExportedProgram is imported as it is (``example_inputs`` may be None).
    example_inputs : tensor, array, tuple of them, or dict of str to them
        Inputs for ``torch.export``; their shapes and dtypes become ``main``'s signature. A
        dict passes them by keyword (``{"input_ids": ids, "attention_mask": mask}`` for a
        Hugging Face model), and ``main`` takes them in the dict's order.
    dynamic_batch : bool
        Export dimension 0 of every input as a symbolic batch size (the example batch must be
        at least 2, since torch specialises sizes 0 and 1).
    train_mode : str
        What to do with a module in train mode, whose dropout and BatchNorm TVM would import
        silently wrong. The module is always exported in eval mode (for inference) and its
        modes are restored afterwards; when that changes a dropout, norm or attention layer,
        ``"eval"`` (default) warns and ``"error"`` refuses with a ValueError.
    custom_convert_map : dict, optional
        Extra op converters for TVM's importer (``"op.overload"`` -> converter).

    Returns
    -------
    mod : tvm.IRModule
        ``main(*inputs, *params)`` with the ``num_input`` attribute; BatchNorm running
        statistics stay constants.
    params : dict of str to numpy.ndarray
        Weights by their PyTorch names (``"fc.weight"``), for ``tvmamp.build(params=...)``.
    """
    torch = require("torch", "torch", "tvmamp.from_torch")
    _check_choice(train_mode)
    if isinstance(module, torch.export.ExportedProgram):
        return import_exported_program(module, custom_convert_map=custom_convert_map)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(
            f"tvmamp.from_torch: expected a torch.nn.Module or torch.export.ExportedProgram, "
            f"got {type(module).__name__}"
        )
    _check_float32_weights(torch, module)
    args, kwargs = _as_tensors(torch, example_inputs)
    dynamic = _batch_dims(torch, module, args, kwargs) if dynamic_batch else None
    with _eval_mode(torch, module, train_mode):
        try:
            program = torch.export.export(module, args, kwargs, dynamic_shapes=dynamic)
        except Exception as err:  # torch raises many types; report them as one
            raise RuntimeError(
                f"tvmamp.from_torch: torch.export could not trace {type(module).__name__}: "
                f"{err}{_cache_hint(module, err)}"
            ) from err
    return import_exported_program(program, custom_convert_map=custom_convert_map)


def _check_float32_weights(torch, module) -> None:
    """Refuse a model whose weights are float16/bfloat16 (``model.half()``), with the fix.

    TVM's importer mixes them with float32 values (a Linear's bias add failed with "Binary
    operators must have the same datatype"), and choosing low precision is tvmamp's job.
    """
    error = _low_weights_error(torch, [*module.named_parameters(), *module.named_buffers()])
    if error is not None:
        raise error


def _low_weights_error(torch, named) -> ValueError | None:
    """The error for the first float16/bfloat16 tensor of ``(name, tensor)`` pairs, if any."""
    for name, tensor in named:
        if tensor.dtype in (torch.float16, torch.bfloat16):
            dtype = str(tensor.dtype).removeprefix("torch.")
            return ValueError(
                f"tvmamp.from_torch: {name!r} is {dtype}; import the float32 model "
                f"(model.float(), with float32 inputs) and let tvmamp convert it: "
                f"tvmamp.build(mod, 'O2', target, {dtype!r}) (or 'O3' for everything low)"
            )
    return None


def _check_choice(train_mode):
    if train_mode not in TRAIN_MODES:
        raise ValueError(
            f"tvmamp.from_torch: train_mode {train_mode!r} is not one of {', '.join(TRAIN_MODES)}"
        )


def _as_tensors(torch, example_inputs) -> tuple[tuple, dict]:
    """``(args, kwargs)`` of tensors for ``torch.export``."""
    if example_inputs is None:
        raise TypeError("tvmamp.from_torch: example_inputs are required to export a module")

    def tensor(x):
        return x if isinstance(x, torch.Tensor) else torch.as_tensor(x)

    if isinstance(example_inputs, Mapping):
        bad = [k for k in example_inputs if not isinstance(k, str)]
        if bad:
            raise TypeError(
                f"tvmamp.from_torch: example_inputs keys must be argument names, got {bad}"
            )
        return (), {k: tensor(v) for k, v in example_inputs.items()}
    items = example_inputs if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    return tuple(tensor(x) for x in items), {}


def _batch_dims(torch, module, args, kwargs):
    """``dynamic_shapes`` making dimension 0 of every input one symbolic batch size.

    ``torch.export`` matches them to ``forward``'s signature: the inputs a ``*args``
    parameter collects take one tuple of specs (a wrapper's ``forward(self, *inputs)`` failed
    with "inputs has 1 elements, but dynamic_shapes has 2 elements").
    """
    batch = torch.export.Dim("batch")
    if kwargs:
        return {name: {0: batch} for name in kwargs}
    specs = [{0: batch} for _ in args]
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read: one spec per input
        return tuple(specs)
    for index, param in enumerate(params):
        if param.kind is inspect.Parameter.VAR_POSITIONAL:
            return (*specs[:index], tuple(specs[index:]))
    return tuple(specs)


def _cache_hint(module, err) -> str:
    """Advice for a Hugging Face model whose KV cache (an output) torch.export cannot return."""
    config = getattr(module, "config", None)
    if getattr(config, "use_cache", False) and "Cache" in str(err):
        return (
            "; the model returns its KV cache: set model.config.use_cache = False "
            "(or pass use_cache=False) before importing it"
        )
    return ""


def _train_sensitive(torch, module) -> list[str]:
    """Names of submodules in train mode whose result depends on it (dropout, norms, attention)."""
    nn = torch.nn
    kinds = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._NormBase, nn.MultiheadAttention)
    return [
        name or type(module).__name__
        for name, m in module.named_modules()
        if m.training and (isinstance(m, kinds) or (isinstance(m, nn.RNNBase) and m.dropout > 0))
    ]


@contextlib.contextmanager
def _eval_mode(torch, module, train_mode: str):
    """Export in eval mode: warn (or refuse) when that changes a layer; restore modes after."""
    training = _train_sensitive(torch, module)
    if training and train_mode == "error":
        raise ValueError(
            f"tvmamp.from_torch: the module is in train mode ({', '.join(training[:3])}"
            f"{', ...' if len(training) > 3 else ''}); TVM would import dropout as identity and "
            "drop BatchNorm's running-stat updates. Call module.eval() first, or pass "
            "train_mode='eval'"
        )
    if training:
        warnings.warn(
            f"tvmamp.from_torch: the module was in train mode; importing it in eval mode for "
            f"inference (dropout off, BatchNorm uses running statistics) for {len(training)} "
            f"layers ({', '.join(training[:3])}{', ...' if len(training) > 3 else ''}); the "
            "module's own mode is restored after export",
            UserWarning,
            stacklevel=4,
        )
    modes = {m: m.training for m in module.modules()}
    module.eval()
    try:
        yield
    finally:
        for m, was_training in modes.items():
            m.train(was_training)


def _upsample_nearest(node, importer):
    """torch's ``mode="nearest"``: the source pixel is ``floor(dst * in / out)``, or with a
    ``scale_factor`` ``floor(dst * float(1 / scale))`` (in float32, as ATen).

    TVM's importer emits half-pixel centres and rounding, which is torch's "nearest-exact":
    the two pick different pixels whenever ``out / in`` is not an integer (a 5 x 6 image resized
    to 7 x 9 differed in most pixels, silently). Where a ``scale_factor`` maps some pixel
    differently from ``in / out`` (5 rows scaled by 1.7: rows 5 and 6 of 8), the rows and
    columns are gathered by torch's own source indices instead.
    """
    import numpy as np
    import tvm
    from tvm import relax

    x = importer.env[node.args[0]]
    size = node.args[1] if len(node.args) > 1 else node.kwargs.get("output_size")
    scales = node.args[2] if len(node.args) > 2 else node.kwargs.get("scale_factors")
    bb = importer.block_builder
    if not size:
        dims = importer.shape_of(x)
        if not all(isinstance(dims[i], tvm.tirx.IntImm) for i in range(2, len(dims))):
            return importer._upsample_nearest2d(node)  # symbolic sizes: TVM's own conversion
        scales = scales if isinstance(scales, (list, tuple)) else [scales, scales]
        size = [int(int(dims[2 + i]) * float(s)) for i, s in enumerate(scales)]
        sources = [
            _nearest_sources(int(dims[2 + i]), size[i], float(s)) for i, s in enumerate(scales)
        ]
        ratios = [_nearest_sources(int(dims[2 + i]), size[i], None) for i in range(2)]
        if any(not np.array_equal(a, b) for a, b in zip(sources, ratios, strict=True)):
            for axis, index in enumerate(sources):
                x = bb.emit(relax.op.take(x, relax.const(index, "int64"), axis=2 + axis))
            return x
    resize = relax.op.image.resize2d(
        x,
        [int(d) for d in size],
        layout="NCHW",
        method="nearest_neighbor",
        coordinate_transformation_mode="asymmetric",
        rounding_method="floor",
    )
    return bb.emit(resize)


def _nearest_sources(size_in: int, size_out: int, scale):
    """ATen's ``nearest_idx``: the source index of each output index along one axis."""
    import numpy as np

    out = np.arange(size_out)
    if size_out == size_in:
        return out
    if size_out == 2 * size_in:
        return out >> 1
    step = np.float32(1.0 / scale) if scale else np.float32(size_in) / np.float32(size_out)
    return np.minimum(np.floor(out.astype(np.float32) * step).astype(np.int64), size_in - 1)


def _static_ints(dims):
    """``dims`` as Python ints, or None when any of them is symbolic."""
    import tvm

    if not all(isinstance(d, (int, tvm.tirx.IntImm)) for d in dims):
        return None
    return [int(d) for d in dims]


def _resample_taps(node, axis, in_dims, out_dims, dtype):
    """The (index, weight) taps torch's own kernel uses along spatial ``axis`` of ``node``.

    The op is linear and separable, and its weights along one axis do not depend on the
    others: run it on ``in_dims[axis]`` one-hot images that are two pixels wide along the other
    axes (kept at size 2, scale 1: torch's antialiased kernel gets one-pixel axes wrong), so
    ``out[k, 0, ..., o, ...]`` is the weight of input pixel ``k`` in output pixel ``o``.
    Torch's own source-index mapping (``1 / scale`` with ``scale_factor``, ``align_corners``,
    antialias filters, an output of size 1) comes out as it is.
    Returns ``(index, weight)`` arrays of shape ``(out, taps)``.
    """
    import numpy as np
    import torch

    args = list(node.args) + [None] * (5 - len(node.args))
    size, align = args[1], args[2]
    if node.target._overloadname == "vec":
        scales = node.kwargs.get("scale_factors", args[3])
        size = node.kwargs.get("output_size", size)
        if size is not None:
            call = ([out_dims[axis] if i == axis else 2 for i in range(len(in_dims))], align, None)
        else:
            call = (
                None,
                align,
                [float(scales[i]) if i == axis else 1.0 for i in range(len(in_dims))],
            )
    else:
        scales = [node.kwargs.get(n, args[3 + i]) for i, n in enumerate(("scales_h", "scales_w"))]
        size = [out_dims[axis] if i == axis else 2 for i in range(len(in_dims))]
        call = (size, align, *[scales[i] if i == axis else None for i in range(len(in_dims))])
    align = node.kwargs.get("align_corners", align)
    call = (call[0], align, *call[2:])
    n = in_dims[axis]
    shape = [n, 1, *[n if i == axis else 1 for i in range(len(in_dims))]]
    wide = [n, 1, *[n if i == axis else 2 for i in range(len(in_dims))]]
    basis = torch.eye(n, dtype=dtype).reshape(shape).expand(wide).contiguous()
    with torch.no_grad():
        out = node.target(basis, *call)
    first = [slice(None) if i == axis else 0 for i in range(len(in_dims))]
    matrix = out[(slice(None), 0, *first)].T.double().numpy()  # (out, in)
    assert matrix.shape[0] == out_dims[axis], (matrix.shape, out_dims, axis)
    taps = max(1, int((matrix != 0).sum(1).max()))
    index = np.zeros((matrix.shape[0], taps), "int64")
    weight = np.zeros((matrix.shape[0], taps), "float64")
    for o, row in enumerate(matrix):
        nonzero = np.flatnonzero(row)
        index[o] = nonzero[0] if len(nonzero) else 0  # padding taps: weight 0, own pixel
        index[o, : len(nonzero)] = nonzero
        weight[o, : len(nonzero)] = row[nonzero]
    return index, weight


# Ops whose symbolic-size form with an output size TVM's own converter (the importer method
# named) maps as torch does.
_BY_OUTPUT_SIZE = {
    "upsample_bilinear2d.vec": "_upsample_bilinear2d",
    "upsample_bicubic2d.vec": "_upsample_bicubic2d",
}


def _upsample_separable(node, importer):
    """``upsample_bilinear2d`` (``.vec``/``.default``), ``upsample_bicubic2d.vec`` and the
    antialiased ``_upsample_*_aa``.

    TVM's importer maps output to input coordinates by ``in / out`` where torch, given a
    ``scale_factor``, steps by ``1 / scale`` (a 5 x 7 image scaled by 1.5 was off by up to 1.4,
    silently); it runs antialiased resizes as plain bilinear (off by 1.8 downsampling), and an
    output of size 1 with ``align_corners=True`` divided by zero. Here, with static spatial
    sizes, each spatial axis is resampled in turn by gathering its taps (``take``) and adding
    them up with constant weights, both taken from torch's own kernel (:func:`_resample_taps`).
    """
    import numpy as np
    import torch
    from tvm import relax

    x = importer.env[node.args[0]]
    target = str(node.target)
    dims = importer.shape_of(x)
    in_dims = _static_ints([dims[i] for i in range(2, len(dims))])
    out_val = node.meta.get("val")
    out_dims = _static_ints(list(out_val.shape)[2:]) if out_val is not None else None
    if in_dims is None or out_dims is None:
        scales = node.args[3] if len(node.args) > 3 else node.kwargs.get("scale_factors")
        align = node.args[2] if len(node.args) > 2 else node.kwargs.get("align_corners")
        single = out_dims is not None and align and 1 in out_dims  # TVM divides by out - 1
        op = target.split(".", 1)[-1]  # aten.upsample_bicubic2d.vec -> upsample_bicubic2d.vec
        if op in _BY_OUTPUT_SIZE and not scales and not single:
            return getattr(importer, _BY_OUTPUT_SIZE[op])(node)
        raise UnsupportedOperatorError(
            f"tvmamp.from_torch: {target} with symbolic spatial sizes is not supported "
            "(torch's scale_factor / antialias mapping needs static input and output sizes); "
            "export with static image sizes or pass an explicit output size",
            [target],
        )
    dtype = str(x.ty.dtype)
    torch_dtype = out_val.dtype if out_val.dtype.is_floating_point else torch.float32
    bb, out = importer.block_builder, x
    for axis in range(len(in_dims)):
        index, weight = _resample_taps(node, axis, in_dims, out_dims, torch_dtype)
        if np.array_equal(index[:, 0], np.arange(in_dims[axis])) and index.shape[1] == 1:
            if np.all(weight == 1):
                continue  # the identity along this axis
        bcast = [1] * (len(in_dims) - axis - 1)
        total = None
        for tap in range(index.shape[1]):
            w = weight[:, tap]
            if tap > 0 and not w.any():
                continue
            picked = relax.op.take(out, relax.const(index[:, tap]), axis=2 + axis)
            if not np.all(w == 1):
                w = relax.const(w.reshape(-1, *bcast).astype(dtype))
                picked = relax.op.multiply(picked, w)
            picked = bb.emit(picked)
            total = picked if total is None else bb.emit(relax.op.add(total, picked))
        out = total
    return out


def _avg_pool(node, importer):
    """``aten.avg_pool2d``/``avg_pool3d`` with ``divisor_override``: window sum / divisor.

    TVM's importer drops ``divisor_override`` and divides by the window size (0.25 off for a
    2 x 2 window and divisor 3, silently). Here the input is zero-padded explicitly (and past
    its end where ``ceil_mode`` makes a last partial window), every window is then whole, and
    the mean over the window times ``window size / divisor`` is torch's sum / divisor.
    """
    from tvm import relax

    args = list(node.args) + [None] * (7 - len(node.args))
    names = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")
    for i, name in enumerate(names, start=1):
        args[i] = node.kwargs.get(name, args[i])
    divisor = node.kwargs.get("divisor_override", args[6])
    nd = 3 if "avg_pool3d" in str(node.target) else 2
    if divisor is None:
        return importer._avg_pool3d(node) if nd == 3 else importer._avg_pool2d(node)
    x = importer.env[node.args[0]]

    def per_dim(value, default):
        value = default if value is None or value == [] else value
        value = list(value) if isinstance(value, (list, tuple)) else [value]
        return [int(v) for v in value] * (nd if len(value) == 1 else 1)

    kernel = per_dim(args[1], None)
    stride = per_dim(args[2], kernel)
    padding = per_dim(args[3], 0)
    bb, batched = importer.block_builder, x.ty.ndim == nd + 2
    if not batched:
        x = bb.emit(relax.op.expand_dims(x, 0))
    dims = importer.shape_of(x)
    in_dims = [dims[i] for i in range(2, len(dims))]
    out_val = node.meta.get("val")
    out_dims = _static_ints(list(out_val.shape)[-nd:]) if out_val is not None else None
    extra = [0] * nd
    if args[4]:  # ceil_mode: the last window may pass the padded input
        static_in = _static_ints(in_dims)
        if static_in is None or out_dims is None:
            raise UnsupportedOperatorError(
                f"tvmamp.from_torch: {node.target} with divisor_override and ceil_mode=True "
                "needs static spatial sizes",
                [str(node.target)],
            )
        for i in range(nd):
            needed = (out_dims[i] - 1) * stride[i] + kernel[i]
            extra[i] = max(0, needed - static_in[i] - 2 * padding[i])
    if any(padding) or any(extra):
        widths = [0, 0, 0, 0] + [w for i in range(nd) for w in (padding[i], padding[i] + extra[i])]
        x = bb.emit(relax.op.nn.pad(x, widths, "constant", 0.0))
    pool, layout = (
        (relax.op.nn.avg_pool3d, "NCDHW") if nd == 3 else (relax.op.nn.avg_pool2d, "NCHW")
    )
    mean = bb.emit(pool(x, kernel, stride, [0] * (2 * nd), layout=layout))
    window = 1
    for k in kernel:
        window *= k
    dtype = str(mean.ty.dtype)
    out = bb.emit(relax.op.multiply(mean, relax.const(window / float(divisor), dtype)))
    return out if batched else bb.emit(relax.op.squeeze(out, [0]))


def _clamp(node, importer):
    """``aten.clamp``/``clamp_min``/``clamp_max`` (scalar or tensor bounds, either may be None).

    TVM's importer makes a missing bound an infinite ``clip`` bound, which an integer tensor
    cannot hold ("Cannot convert infinity to BigInt" for ``int_tensor.clamp(min=1)``, and so
    for every 1-D linear and trilinear interpolate, which torch decomposes into one). Here each
    given bound is a ``maximum``/``minimum`` in the result's dtype.
    """
    import math

    from tvm import relax

    name = node.target.__name__
    x = importer.env[node.args[0]]
    rest = list(node.args[1:])
    if name.startswith("clamp_min"):
        low, high = (rest[0] if rest else node.kwargs.get("min")), None
    elif name.startswith("clamp_max"):
        low, high = None, (rest[0] if rest else node.kwargs.get("max"))
    else:
        rest += [None] * (2 - len(rest))
        low = node.kwargs.get("min", rest[0])
        high = node.kwargs.get("max", rest[1])
    result = node.meta.get("val")
    dtype = (
        importer._convert_data_type(result.dtype, importer.env)
        if getattr(result, "dtype", None) is not None
        else str(x.ty.dtype)
    )
    bb = importer.block_builder
    if str(x.ty.dtype) != dtype:
        x = bb.emit(relax.op.astype(x, dtype))

    def bound(value, infinite):
        if value is None:
            return None
        if isinstance(value, (bool, int, float)):
            if isinstance(value, float) and math.isinf(value) and value == infinite:
                return None
            if isinstance(value, float) and math.isinf(value) and "float" not in dtype:
                raise UnsupportedOperatorError(
                    f"tvmamp.from_torch: {node.target} of an integer tensor with an infinite "
                    f"bound {value} is not supported",
                    [str(node.target)],
                )
            return relax.const(value, dtype)
        value = importer.env[value]
        if str(value.ty.dtype) != dtype:
            value = bb.emit(relax.op.astype(value, dtype))
        return value

    low, high = bound(low, -math.inf), bound(high, math.inf)
    if low is not None:
        x = bb.emit(relax.op.maximum(x, low))
    if high is not None:
        x = bb.emit(relax.op.minimum(x, high))
    return x


def _arange(node, importer):
    """``aten.arange(start, end, step)`` with a negative step.

    Relax infers the wrong length for a negative step: ``arange(128, -128, -1)`` has 258
    elements there, 256 in torch, and ``arange(5, 0, -2)`` 4 instead of 3 (Funnel
    Transformer's relative positions failed to import; a model reading only the first
    elements would have been silently wrong). Here the length is torch's and the values are
    ``start + step * i``. Other calls go to TVM's converter.
    """
    import math

    from tvm import relax

    values = [node.kwargs.get(k) for k in ("start", "end", "step")]
    given = list(node.args) if len(node.args) != 1 else [None, node.args[0]]
    for i, arg in enumerate(given):
        values[i] = arg
    start, end, step = (0 if values[0] is None else values[0]), values[1], values[2]
    numbers = all(isinstance(v, (int, float)) for v in (start, end, step))
    if not numbers or step >= 0:
        return importer._arange(node)
    result = node.meta.get("val")
    dtype = importer._convert_data_type(result.dtype, importer.env)
    count = max(0, math.ceil((end - start) / step))
    index = relax.op.arange(0, count, 1, dtype)
    offsets = relax.op.multiply(index, relax.const(step, dtype))
    return importer.block_builder.emit(relax.op.add(offsets, relax.const(start, dtype)))


def _extremum_with_index(reduce, arg):
    """A converter of ``aten.max.dim``/``min.dim(x, dim, keepdim=False)``: the values and
    their int64 indices, as ``reduce`` and ``arg`` (first occurrence, as torch).

    TVM's importer makes ``max.dim`` a ``topk`` with k = 1, a sort kernel: Hiera's max over
    its mask units took 6 ms for 600k values (10 ns each). It has no ``min.dim``.
    """

    def convert(node, importer):
        from tvm import relax

        x = importer.env[node.args[0]]
        dim = node_arg(node, 1, "dim")
        keep = bool(node_arg(node, 2, "keepdim", False))
        bb = importer.block_builder
        values = bb.emit(reduce(x, axis=[dim], keepdims=keep))
        indices = bb.emit(relax.op.astype(arg(x, axis=dim, keepdims=keep), "int64"))
        return bb.emit(relax.Tuple([values, indices]))

    return convert


def _topk(node, importer):
    """``aten.topk(x, k, dim=-1, largest=True, sorted=True)``: values and int64 indices.

    TVM's importer refuses ``sorted=False`` ("Currently supports only sorted output"), which
    DeepSeek-V3's router asks for. The order of an unsorted topk is unspecified, so the
    sorted result is a valid one.
    """
    from tvm import relax

    x = importer.env[node.args[0]]
    k, dim = node_arg(node, 1, "k", 1), node_arg(node, 2, "dim", -1)
    largest = node_arg(node, 3, "largest", True)
    top = relax.op.topk(x, k=k, axis=dim, largest=bool(largest), ret_type="both", dtype="int64")
    return importer.block_builder.emit(top)


def _extremum(reduce):
    """A converter of ``aten.amax``/``amin(x, dim=(), keepdim=False)``: ``reduce`` over ``dim``
    (every axis when it is empty, as in torch). TVM's importer has none, so ``torch.logsumexp``
    (which decomposes into ``amax``) could not be imported."""

    def convert(node, importer):
        x = importer.env[node.args[0]]
        dims = node_arg(node, 1, "dim", ())
        keep = node_arg(node, 2, "keepdim", False)
        axes = [int(d) for d in dims] if dims else None
        return importer.block_builder.emit(reduce(x, axis=axes, keepdims=bool(keep)))

    return convert


def _elu(node, importer):
    """``aten.elu(x, alpha=1, scale=1, input_scale=1)``: ``scale * x`` where ``x > 0``, else
    ``scale * alpha * (exp(input_scale * x) - 1)``.

    ``F.selu`` decomposes to ``elu(x, 1.6733, 1.0507)``; TVM's converter ignores ``scale`` and
    ``input_scale``, so selu lost its 1.0507 factor (5% off, silently).
    """
    from tvm import relax

    x = importer.env[node.args[0]]
    alpha, scale, input_scale = (
        node.args[i] if len(node.args) > i else node.kwargs.get(name, 1.0)
        for i, name in ((1, "alpha"), (2, "scale"), (3, "input_scale"))
    )
    dtype = str(x.ty.dtype)

    def times(factor, value):
        return value if factor == 1 else relax.op.multiply(value, relax.const(factor, dtype))

    bb = importer.block_builder
    positive = times(scale, x)
    negative = relax.op.subtract(relax.op.exp(times(input_scale, x)), relax.const(1, dtype))
    negative = times(float(scale) * float(alpha), negative)
    above = relax.op.greater(x, relax.const(0, dtype))
    return bb.emit(relax.op.where(above, positive, negative))


def _div_mode(node, importer):
    """``aten.div.Tensor_mode(a, b, rounding_mode)``: ``a // b`` (floor) or truncated division.

    TVM's converter makes a Python-int operand an int32 constant, so ``int64_tensor // 3`` and
    ``float_tensor // -3`` failed ("Binary operators must have the same datatype"). Here both
    operands take the result's dtype (graph passes have cast tensors that torch promotes).
    """
    from tvm import relax

    operands = _operands(node, importer)
    if operands is None:
        return importer._div(node)
    a, b, dtype = operands
    mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("rounding_mode")
    bb = importer.block_builder
    if mode is None:
        return bb.emit(relax.op.divide(a, b))
    if mode == "floor":
        return bb.emit(relax.op.floor_divide(a, b))
    if mode != "trunc":
        raise ValueError(f"tvmamp.from_torch: aten.div: unknown rounding_mode {mode!r}")
    if "float" in dtype:
        return bb.emit(relax.op.trunc(relax.op.divide(a, b)))
    return bb.emit(relax.op.divide(a, b))  # integer division in TIR truncates, as C does


def _binary(op_name):
    """A converter of a binary op TVM's importer lacks: both operands (tensors or Python
    scalars) in the result's dtype, then ``relax.op.<op_name>``."""

    def convert(node, importer):
        from tvm import relax

        operands = _operands(node, importer)
        if operands is None:
            raise UnsupportedOperatorError(
                f"tvmamp.from_torch: {node.target} is supported on tensors and Python "
                f"numbers only, got {node.args[:2]}",
                [str(node.target)],
            )
        a, b, _ = operands
        return importer.block_builder.emit(getattr(relax.op, op_name)(a, b))

    return convert


def _operands(node, importer):
    """``(a, b, dtype)``: a binary op's two operands (tensors or Python numbers) as Relax
    tensors of the result's dtype, or None for other operands (symbolic sizes)."""
    from tvm import relax

    result = node.meta.get("val")
    if getattr(result, "dtype", None) is None:
        return None
    dtype = importer._convert_data_type(result.dtype, importer.env)
    operands = []
    for arg in node.args[:2]:
        value = importer.env[arg] if hasattr(arg, "meta") else arg
        if isinstance(value, (bool, int, float)):
            value = relax.const(value, dtype)
        elif not isinstance(getattr(value, "ty", None), relax.TensorType):
            return None
        elif str(value.ty.dtype) != dtype:
            value = importer.block_builder.emit(relax.op.astype(value, dtype))
        operands.append(value)
    return (*operands, dtype)


def _index_operands(node, importer):
    """``(data, index tensors by dim)`` of ``aten.index``/``index_put``, or None where tvmamp
    leaves the call to TVM (a boolean mask, or a single index tensor: a ``take``)."""
    data = importer.env[node.args[0]]
    indices = list(node.args[1]) + [None] * (data.ty.ndim - len(node.args[1]))
    tensors = {d: importer.env[i] for d, i in enumerate(indices) if i is not None}
    if any(str(t.ty.dtype) == "bool" for t in tensors.values()):
        return None
    return data, tensors


def _advanced_layout(ndim, dims):
    """For index tensors on ``dims``: the permutation putting them first, and whether torch
    keeps the broadcast index dims in place (the indexed dims are adjacent) and where."""
    rest = [d for d in range(ndim) if d not in dims]
    in_place = dims == list(range(dims[0], dims[-1] + 1)) and dims[0] > 0
    return dims + rest, (dims[0] if in_place else 0)


def _move_axes(bb, x, start, count, to):
    """Move ``count`` axes of ``x`` starting at ``start`` to position ``to``."""
    from tvm import relax

    if start == to or count == 0:
        return x
    axes = list(range(x.ty.ndim))
    block = axes[start : start + count]
    rest = axes[:start] + axes[start + count :]
    return bb.emit(relax.op.permute_dims(x, rest[:to] + block + rest[to:]))


def _index(node, importer):
    """``aten.index.Tensor`` with several index tensors (``x[:, i, j]``, ``nn.Unfold``).

    TVM's importer expands each ``None`` (a full slice) into an ``arange`` that does not
    broadcast with the index tensors ("index_tensor: cannot broadcast index shapes") or takes
    index tensors one after another, an outer product where torch broadcasts them (silently
    wrong for ``x[:, [[0, 1, 2]], [1, 2, 3]]``). Here the indexed dims go first, one
    ``index_tensor`` gathers with the broadcast indices, and the broadcast dims move to where
    torch puts them (in place of adjacent indexed dims, else first).
    """
    from tvm import relax

    if _boolean_mask(node, importer, "x[mask]") is not None:
        raise ValueError(
            "tvmamp.from_torch: aten.index.Tensor with a boolean mask (x[mask]) has a shape that "
            "depends on the mask's values, which a compiled model cannot have; index with "
            "integer indices (torch.nonzero of a constant mask), or use torch.where(mask, x, 0)"
        )
    operands = _index_operands(node, importer)
    if operands is None or len(operands[1]) < 2:
        return importer._index_tensor(node)
    data, tensors = operands
    bb, dims = importer.block_builder, sorted(tensors)
    perm, position = _advanced_layout(data.ty.ndim, dims)
    if perm != sorted(perm):
        data = bb.emit(relax.op.permute_dims(data, perm))
    index = [_as_int64(bb, tensors[d]) for d in dims]
    out = bb.emit(relax.op.index_tensor(data, index))
    rank = max(t.ty.ndim for t in tensors.values())
    return _move_axes(bb, out, 0, rank, position)


def _index_put(node, importer):
    """``aten.index_put(x, indices, values, accumulate)``: ``x[indices] = values`` (``+=``).

    TVM's importer requires an index tensor for every dim ("IndexPut requires the number of
    index tensors (1) to match the data tensor dimensions (2)" for ``x[rows] = v``) and
    expands ``None`` into aranges that do not broadcast (``nn.Fold``); its ``index_put``
    accumulates in a parallel loop, which races on repeated indices. Here the indexed dims go
    first and one ``scatter_nd`` (serial over the indices) writes or adds ``values``,
    broadcast to the shape of ``x[indices]``; the dims are then put back.
    """
    from tvm import relax

    mask = _boolean_mask(node, importer, "x[mask] = values")
    if mask is not None:
        return _masked_put(node, importer, mask)
    operands = _index_operands(node, importer)
    if operands is None:
        return importer._index_put(node)
    data, tensors = operands
    values = importer.env[node.args[2]]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    bb, dims, ndim = importer.block_builder, sorted(tensors), data.ty.ndim
    perm, position = _advanced_layout(ndim, dims)
    shape = list(data.ty.shape)
    batch = _broadcast_shape([list(t.ty.shape) for t in tensors.values()])
    rest = [shape[d] for d in perm[len(dims) :]]
    target = rest[:position] + batch + rest[position:]  # the shape of data[indices]
    if str(values.ty.dtype) != str(data.ty.dtype):
        values = bb.emit(relax.op.astype(values, data.ty.dtype))
    values = bb.emit(relax.op.broadcast_to(values, target))
    values = _move_axes(bb, values, position, len(batch), 0)
    index = [
        bb.emit(relax.op.expand_dims(relax.op.broadcast_to(_as_int64(bb, tensors[d]), batch), -1))
        for d in dims
    ]
    index = bb.emit(relax.op.concat(index, axis=-1)) if len(index) > 1 else index[0]
    if perm != sorted(perm):
        data = bb.emit(relax.op.permute_dims(data, perm))
    reduction = "add" if accumulate else "update"
    out = bb.emit(relax.op.scatter_nd(data, index, values, reduction))
    if perm == sorted(perm):
        return out
    inverse = [perm.index(d) for d in range(ndim)]
    return bb.emit(relax.op.permute_dims(out, inverse))


def _boolean_mask(node, importer, what: str):
    """The boolean index of ``aten.index``/``index_put`` (``x[mask]``), or None without one.

    Only one mask over the leading dims (``mask.shape == x.shape[:k]``) is supported; any
    other boolean index is refused with a clear error (TVM's importer failed with "Take op
    requires the input indices to have integer dtype").
    """
    data = importer.env[node.args[0]]
    indices = [importer.env[i] if i is not None else None for i in node.args[1]]
    masks = [t for t in indices if t is not None and str(t.ty.dtype) == "bool"]
    if not masks:
        return None
    mask = indices[0]
    leading = [int(d) for d in data.ty.shape.values[: mask.ty.ndim]] if mask is not None else []
    shape = [int(d) for d in mask.ty.shape.values] if mask is not None else None
    if len(indices) != 1 or masks[0] is not mask or shape != leading:
        dims = [d for d, t in enumerate(indices) if t is not None]
        raise ValueError(
            f"tvmamp.from_torch: {what} with a boolean mask is supported only for one mask "
            f"over the leading dims of x (here indices at dims {dims} of x of shape "
            f"{tuple(int(d) for d in data.ty.shape.values)}); rewrite the indexing with "
            "torch.where or integer indices"
        )
    return mask


def _masked_put(node, importer, mask):
    """``x[mask] = values`` (``+=`` with ``accumulate``) as ``where(mask, values, x)``.

    ``values`` must broadcast to the dims of ``x`` after the mask's (a scalar, a row): values
    listed one per True element depend on the mask's count, which the compiled graph cannot.
    """
    from tvm import relax

    bb = importer.block_builder
    data = importer.env[node.args[0]]
    values = importer.env[node.args[2]]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    rest = list(data.ty.shape.values[mask.ty.ndim :])
    if values.ty.ndim > len(rest):
        raise ValueError(
            "tvmamp.from_torch: x[mask] = values with one value per True element of the mask "
            "is not supported (its length depends on the mask); pass a scalar or a tensor that "
            "broadcasts over x's remaining dims, or use torch.where"
        )
    if str(values.ty.dtype) != str(data.ty.dtype):
        values = bb.emit(relax.op.astype(values, data.ty.dtype))
    values = bb.emit(relax.op.broadcast_to(values, list(data.ty.shape.values)))
    if accumulate:
        values = bb.emit(relax.op.add(data, values))
    cond = mask
    for _ in rest:
        cond = bb.emit(relax.op.expand_dims(cond, -1))
    return bb.emit(relax.op.where(cond, values, data))


def _as_int64(bb, index):
    from tvm import relax

    if str(index.ty.dtype) == "int64":
        return index
    return bb.emit(relax.op.astype(index, "int64"))


def _broadcast_shape(shapes):
    """NumPy broadcasting of static or symbolic shapes (a non-1 size wins)."""
    import tvm

    rank = max(len(s) for s in shapes)
    out = []
    for axis in range(rank):
        size = 1
        for s in shapes:
            at = axis - rank + len(s)
            if at >= 0 and not (isinstance(s[at], tvm.tirx.IntImm) and int(s[at]) == 1):
                size = s[at]
        out.append(size)
    return out


def _converters() -> dict:
    from tvm import relax

    return {
        "upsample_nearest2d.vec": _upsample_nearest,
        "upsample_bilinear2d.vec": _upsample_separable,
        "upsample_bilinear2d.default": _upsample_separable,
        "upsample_bicubic2d.vec": _upsample_separable,
        "_upsample_bilinear2d_aa.default": _upsample_separable,
        "_upsample_bicubic2d_aa.default": _upsample_separable,
        "_upsample_bilinear2d_aa.vec": _upsample_separable,
        "_upsample_bicubic2d_aa.vec": _upsample_separable,
        "avg_pool2d.default": _avg_pool,
        "avg_pool3d.default": _avg_pool,
        "clamp.default": _clamp,
        "clamp.Tensor": _clamp,
        "clamp_min.default": _clamp,
        "clamp_max.default": _clamp,
        "amax.default": _extremum(relax.op.max),
        "amin.default": _extremum(relax.op.min),
        "elu.default": _elu,
        "div.Tensor_mode": _div_mode,
        "index.Tensor": _index,
        "index_put.default": _index_put,
        "topk.default": _topk,
        "max.dim": _extremum_with_index(relax.op.max, relax.op.argmax),
        "min.dim": _extremum_with_index(relax.op.min, relax.op.argmin),
        "arange.start_step": _arange,
        "histc.default": torch_moe.histc,
        "grouped_mm_fallback.default": torch_moe.grouped_mm,
        "_grouped_mm.default": torch_moe.grouped_mm,
        "max_pool2d_with_indices.default": torch_pool.max_pool_with_indices(2),
        "max_pool3d_with_indices.default": torch_pool.max_pool_with_indices(3),
        "adaptive_max_pool2d.default": torch_pool.adaptive_max_pool(2),
        "adaptive_max_pool3d.default": torch_pool.adaptive_max_pool(3),
        "scatter.src": torch_ops.scatter(None),
        "matmul.default": torch_ops.matmul,
        "mm.default": torch_ops.matmul,
        "bmm.default": torch_ops.matmul,
        "addmm.default": torch_ops.addmm,
        "scatter_add.default": torch_ops.scatter("add"),
        "scatter_reduce.two": torch_ops.scatter_reduce,
        "prod.dim_int": torch_ops.prod_dim,
        "hypot.default": torch_ops.hypot,
        "kthvalue.default": torch_ops.kthvalue,
        "_embedding_bag.default": torch_ops.embedding_bag,
        "_embedding_bag_forward_only.default": torch_ops.embedding_bag,
        "var_mean.correction": torch_ops.var_mean,
        "sort.stable": torch_ops.stable_sort,
        "searchsorted.Tensor": torch_ops.searchsorted,
        "triu_indices.default": torch_ops.triangle_indices(upper=True),
        "tril_indices.default": torch_ops.triangle_indices(upper=False),
        "masked_scatter.default": torch_ops.masked_scatter,
        "_cdist_forward.default": torch_ops.cdist,
        "unfold.default": torch_ops.unfold,
        "exp2.default": torch_ops.exp2,
        "empty.memory_format": torch_ops.empty,
        "empty_permuted.default": torch_ops.empty,
        "repeat.default": torch_ops.repeat,
        "fmax.default": torch_ops.nan_ignoring("maximum"),
        "fmin.default": torch_ops.nan_ignoring("minimum"),
        "remainder.Scalar_Tensor": _binary("floor_mod"),
        **{
            f"{name}.{overload}": _binary(op)
            for names, op in (
                (("__rshift__", "bitwise_right_shift"), "right_shift"),
                (("__lshift__", "bitwise_left_shift"), "left_shift"),
            )
            for name in names
            for overload in ("Scalar", "Tensor", "Tensor_Scalar", "Scalar_Tensor")
        },
    }


# tvmamp's converters for ops TVM's importer lacks or translates wrongly (custom_convert_map
# format); a user's custom_convert_map overrides them.
CONVERTERS = _converters()


def import_exported_program(program, custom_convert_map: Mapping | None = None):
    """Import an ExportedProgram: returns ``(mod, params)`` as :func:`from_torch` does."""
    from tvm.relax.frontend.torch import from_exported_program
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    component = "tvmamp.from_torch"
    program = program.run_decompositions(_decompositions())
    drop_legacy_empty_cat_inputs(program)
    give_cumulative_ops_their_dtype(program)
    count_from_the_start_in_selects(program)
    wrap_negative_index_tensors(program)
    give_group_norms_their_affine(program)
    put_grid_channels_first(program)
    compute_binary_ops_in_their_dtype(program)
    calls = [n for n in program.graph.nodes if n.op == "call_function"]
    _refuse_train_ops(calls, program)
    _refuse_random_ops(calls)
    converters = {**CONVERTERS, **(custom_convert_map or {})}
    known = set(ExportedProgramImporter().convert_map) | set(converters)
    missing = sorted({str(n.target) for n in calls if n.target.__name__ not in known})
    if missing:
        raise UnsupportedOperatorError(
            f"{component}: TVM's PyTorch importer does not support {', '.join(missing)}; "
            "rewrite these ops in the model or pass custom_convert_map",
            missing,
        )
    try:
        mod = from_exported_program(
            program,
            keep_params_as_input=True,
            unwrap_unit_return_tuple=True,
            custom_convert_map=converters,
            run_ep_decomposition=False,
        )
    except TypeError as err:  # TVM's converters mix a low model's weights with fp32 constants
        low = _low_weights_error(require("torch", "torch", component), program.state_dict.items())
        if low is None:
            raise
        raise low from err
    mod = _broadcast_non_finite_fills(mod)
    values = list(mod["main"].attrs["params"]) if "params" in mod["main"].attrs else []
    mod, params = split_params(mod, values, component)
    names = _torch_names(program)
    mod["main"] = rename_params(mod["main"], names)
    return mod, {names.get(k, k): v for k, v in params.items()}


def _decompositions() -> dict:
    """torch.export's default decompositions, less the ops a converter here takes whole:
    ``upsample_bicubic2d.vec`` decomposes into about 160 gathers, clamps and products (a 64 to
    128 px bicubic resize took 10 s to build and ran 3x torch's time)."""
    import torch

    table = torch.export.default_decompositions()
    table.pop(torch.ops.aten.upsample_bicubic2d.vec, None)
    return table


def _broadcast_non_finite_fills(mod):
    """Turn ``full``/``full_like`` of an infinite or NaN constant into ``broadcast_to`` of it.

    TVM's legalization of ``full`` checks a non-finite fill value with ``"float" in dtype``,
    where ``dtype`` is a PrimType, and fails ("argument of type 'PrimType' is not iterable"):
    ``torch.full((T, T), float("-inf"))``, the causal mask of ``nn.Transformer``, could not
    be built. ``broadcast_to`` computes the same tensor and legalizes.
    """
    import numpy as np
    import tvm
    from tvm import relax

    full, full_like = tvm.ir.Op.get("relax.full"), tvm.ir.Op.get("relax.full_like")

    @relax.expr_functor.mutator
    class Rewriter(relax.PyExprMutator):
        def visit_call_(self, call):
            call = self.visit_expr_post_order(call)
            kind = "full" if call.op.same_as(full) else "like" if call.op.same_as(full_like) else ""
            value = call.args[1] if kind else None
            if not isinstance(value, tvm.ir.Constant):
                return call
            array = value.value.numpy()
            if array.size != 1 or np.isfinite(array).all():
                return call
            number = float(array.reshape(()))
            shape = call.args[0] if kind == "full" else call.args[0].ty.shape
            if shape is None:
                return call
            fill = relax.const(number, str(call.ty.dtype))
            return relax.op.broadcast_to(fill, shape)

    for name, func in list(mod.functions_items()):
        if isinstance(func, relax.Function):
            mod[name] = Rewriter().visit_expr(func)
    return mod


def _refuse_train_ops(calls, program):
    found = sorted(
        {
            _TRAIN_ONLY_OPS[n.target.__name__]
            for n in calls
            if n.target.__name__ in _TRAIN_ONLY_OPS
            and n.kwargs.get("train", n.args[2] if len(n.args) > 2 else True) is not False
        }
    )
    mutated = sorted(program.graph_signature.buffers_to_mutate.values())
    statistics = [name for name in mutated if name.rsplit(".", 1)[-1] in _NORM_STATISTICS]
    if found or statistics:
        found = found or [f"updates of {', '.join(statistics)}"]
        raise ValueError(
            f"tvmamp.from_torch: the exported program was traced in train mode ({', '.join(found)}"
            "); TVM would import it silently wrong for inference. Export it again after "
            "module.eval(), or pass the module itself to tvmamp.from_torch"
        )
    if mutated:
        raise ValueError(
            f"tvmamp.from_torch: the model updates its buffers {', '.join(mutated)} in place; "
            "a compiled model keeps no state between calls. Pass such a buffer as an input "
            "and return its new value instead"
        )


# The buffers a normalisation layer updates in train mode (BatchNorm's running statistics).
_NORM_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def _refuse_random_ops(calls):
    found = sorted({str(n.target) for n in calls if n.target.__name__.split(".")[0] in _RANDOM_OPS})
    if found:
        raise UnsupportedOperatorError(
            f"tvmamp.from_torch: the model draws random numbers ({', '.join(found)}); TVM's "
            "importer would build one fixed draw, or none, into the executable. Pass the random "
            "tensor as an input of the model instead",
            found,
        )


def _torch_names(program) -> dict:
    """Relax parameter name (``p_fc_weight``) -> PyTorch name (``fc.weight``)."""
    from torch.export.graph_signature import InputKind

    kind = InputKind.PARAMETER
    return {s.arg.name: s.target for s in program.graph_signature.input_specs if s.kind == kind}
