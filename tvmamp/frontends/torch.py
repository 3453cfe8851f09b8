"""Import PyTorch models: torch.export, then TVM's ExportedProgram importer, params detached."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Mapping

from .common import UnsupportedOperatorError, rename_params, require, split_params
from .torch_graph import (
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
    args, kwargs = _as_tensors(torch, example_inputs)
    dynamic = _batch_dims(torch, args, kwargs) if dynamic_batch else None
    with _eval_mode(torch, module, train_mode):
        try:
            program = torch.export.export(module, args, kwargs, dynamic_shapes=dynamic)
        except Exception as err:  # torch raises many types; report them as one
            raise RuntimeError(
                f"tvmamp.from_torch: torch.export could not trace {type(module).__name__}: "
                f"{err}{_cache_hint(module, err)}"
            ) from err
    return import_exported_program(program, custom_convert_map=custom_convert_map)


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


def _batch_dims(torch, args, kwargs):
    """``dynamic_shapes`` making dimension 0 of every input one symbolic batch size."""
    batch = torch.export.Dim("batch")
    if kwargs:
        return {name: {0: batch} for name in kwargs}
    return tuple({0: batch} for _ in args)


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
    """torch's ``mode="nearest"``: the source pixel is ``floor(dst * in / out)``.

    TVM's importer emits half-pixel centres and rounding, which is torch's "nearest-exact":
    the two pick different pixels whenever ``out / in`` is not an integer (a 5 x 6 image resized
    to 7 x 9 differed in most pixels, silently). With ``scale_factor`` and ``in * scale`` not an
    integer, torch steps by ``1 / scale`` where this steps by ``in / out``: a one-pixel
    difference at some positions remains.
    """
    import tvm
    from tvm import relax

    x = importer.env[node.args[0]]
    size = node.args[1] if len(node.args) > 1 else node.kwargs.get("output_size")
    scales = node.args[2] if len(node.args) > 2 else node.kwargs.get("scale_factors")
    if not size:
        dims = importer.shape_of(x)
        if not all(isinstance(dims[i], tvm.tirx.IntImm) for i in range(2, len(dims))):
            return importer._upsample_nearest2d(node)  # symbolic sizes: TVM's own conversion
        scales = scales if isinstance(scales, (list, tuple)) else [scales, scales]
        size = [int(int(dims[2 + i]) * float(s)) for i, s in enumerate(scales)]
    resize = relax.op.image.resize2d(
        x,
        [int(d) for d in size],
        layout="NCHW",
        method="nearest_neighbor",
        coordinate_transformation_mode="asymmetric",
        rounding_method="floor",
    )
    return importer.block_builder.emit(resize)


def _extremum(reduce):
    """A converter of ``aten.amax``/``amin(x, dim=(), keepdim=False)``: ``reduce`` over ``dim``
    (every axis when it is empty, as in torch). TVM's importer has none, so ``torch.logsumexp``
    (which decomposes into ``amax``) could not be imported."""

    def convert(node, importer):
        x = importer.env[node.args[0]]
        dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", ())
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        axes = [int(d) for d in dims] if dims else None
        return importer.block_builder.emit(reduce(x, axis=axes, keepdims=bool(keep)))

    return convert


def _converters() -> dict:
    from tvm import relax

    return {
        "upsample_nearest2d.vec": _upsample_nearest,
        "amax.default": _extremum(relax.op.max),
        "amin.default": _extremum(relax.op.min),
    }


# tvmamp's converters for ops TVM's importer lacks or translates wrongly (custom_convert_map
# format); a user's custom_convert_map overrides them.
CONVERTERS = _converters()


def import_exported_program(program, custom_convert_map: Mapping | None = None):
    """Import an ExportedProgram: returns ``(mod, params)`` as :func:`from_torch` does."""
    from tvm.relax.frontend.torch import from_exported_program
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    component = "tvmamp.from_torch"
    program = program.run_decompositions()
    drop_legacy_empty_cat_inputs(program)
    give_cumulative_ops_their_dtype(program)
    count_from_the_start_in_selects(program)
    wrap_negative_index_tensors(program)
    give_group_norms_their_affine(program)
    put_grid_channels_first(program)
    calls = [n for n in program.graph.nodes if n.op == "call_function"]
    _refuse_train_ops(calls, program)
    converters = {**CONVERTERS, **(custom_convert_map or {})}
    known = set(ExportedProgramImporter().convert_map) | set(converters)
    missing = sorted({str(n.target) for n in calls if n.target.__name__ not in known})
    if missing:
        raise UnsupportedOperatorError(
            f"{component}: TVM's PyTorch importer does not support {', '.join(missing)}; "
            "rewrite these ops in the model or pass custom_convert_map",
            missing,
        )
    mod = from_exported_program(
        program,
        keep_params_as_input=True,
        unwrap_unit_return_tuple=True,
        custom_convert_map=converters,
        run_ep_decomposition=False,
    )
    values = list(mod["main"].attrs["params"]) if "params" in mod["main"].attrs else []
    mod, params = split_params(mod, values, component)
    names = _torch_names(program)
    mod["main"] = rename_params(mod["main"], names)
    return mod, {names.get(k, k): v for k, v in params.items()}


def _refuse_train_ops(calls, program):
    found = sorted(
        {
            _TRAIN_ONLY_OPS[n.target.__name__]
            for n in calls
            if n.target.__name__ in _TRAIN_ONLY_OPS
            and n.kwargs.get("train", n.args[2] if len(n.args) > 2 else True) is not False
        }
    )
    if found or program.graph_signature.buffers_to_mutate:
        found = found or ["buffer updates"]
        raise ValueError(
            f"tvmamp.from_torch: the exported program was traced in train mode ({', '.join(found)}"
            "); TVM would import it silently wrong for inference. Export it again after "
            "module.eval(), or pass the module itself to tvmamp.from_torch"
        )


def _torch_names(program) -> dict:
    """Relax parameter name (``p_fc_weight``) -> PyTorch name (``fc.weight``)."""
    from torch.export.graph_signature import InputKind

    kind = InputKind.PARAMETER
    return {s.arg.name: s.target for s in program.graph_signature.input_specs if s.kind == kind}
