"""A relax.frontend.nn Module's forward exported for training, its input_spec checked first."""

from __future__ import annotations

import inspect

import tvm

EXAMPLE = "input_spec={'x': nn.spec.Tensor(shape, 'float32'), ...}"


def export_forward(module, input_spec) -> tvm.IRModule:
    """``module.export_tvm`` of its ``forward`` for ``input_spec``, which must name forward's
    arguments: nn's exporter drops a name forward lacks and leaves an argument without a spec
    out of the call (Python's "missing 1 required positional argument")."""
    if not isinstance(input_spec, dict) or not input_spec:
        raise TypeError(
            f"tvmamp.training: an nn.Module needs {EXAMPLE} naming the inputs of its forward"
        )
    _check_names(module, input_spec)
    for name, spec in input_spec.items():
        if name != "$":  # nn's exporter options
            _check_tensor(name, spec)
    mod, _ = module.export_tvm(spec={"forward": dict(input_spec)})  # it pops "$"
    return mod


def _check_names(module, input_spec: dict) -> None:
    """Refuse spec names forward does not take and forward arguments without a spec."""
    params = inspect.signature(module.forward).parameters.values()
    named = [p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    names = [p.name for p in named]
    required = [p.name for p in named if p.default is p.empty]
    unknown = [n for n in input_spec if n not in names and n != "$"]
    missing = [n for n in required if n not in input_spec]
    if not unknown and not missing:
        return
    problems = [f"{n!r} is not an argument of forward" for n in unknown]
    problems += [f"forward's argument {n!r} has no spec" for n in missing]
    raise ValueError(
        f"tvmamp.training: input_spec names {', '.join(map(repr, input_spec))}, but "
        f"{type(module).__name__}.forward takes ({', '.join(names)}): {'; '.join(problems)}"
    )


def _check_tensor(name: str, spec) -> None:
    """A data input is an ``nn.spec.Tensor``; a float one is float32 (tvmamp picks the
    precision: at O1-O3 the step casts it to the low dtype where the first low op reads it)."""
    from tvm.relax.frontend import nn

    if not isinstance(spec, nn.spec.Tensor):
        raise TypeError(
            f"tvmamp.training: input_spec[{name!r}] must be nn.spec.Tensor(shape, dtype), got "
            f"{spec!r}: a train step takes tensors"
        )
    dtype = str(spec.dtype)
    if dtype != "float32" and "float" in dtype:
        raise TypeError(
            f"tvmamp.training: input_spec[{name!r}] is {dtype}; give float32 inputs "
            f"(nn.spec.Tensor({tuple(spec.shape)}, 'float32')): tvmamp chooses the precision "
            "from level and dtype, and a low input would meet the fp32 params in the graph"
        )
