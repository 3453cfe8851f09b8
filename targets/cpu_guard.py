"""The CPU feature guard: code built for one x86 CPU raises a clear error on a CPU that lacks its
instructions, instead of dying with SIGILL.

At build time :class:`CpuFeatureGuard` makes every public Relax function first call
``tvmamp_check_cpu_features(mask, target)``, before any kernel runs: ``mask`` has bit ``i`` set
for each feature ``FEATURES[i]`` the kernels may use. Two implementations answer that name:

- in an exported library, a small C++ function linked into the ``.so`` by ``export_library``
  (:func:`export_options`), compiled by the system compiler with its default flags (baseline
  x86-64, never the target's ``-mcpu``, so the check itself cannot fault). It reads CPUID and XCR0
  once (later calls compare two masks), asks Linux for AMX permission where AMX is needed, and
  raises a TVM error naming the missing features. The VM finds it among the library's own
  functions, so it works with only the TVM runtime loaded. The library also exports
  ``tvmamp_compiled_cpu_features()``, a JSON record of the target and features it was compiled
  for;
- in this process (a model built and run in Python), a global function registered here that
  checks the host's /proc/cpuinfo features (cached per mask; a Python call, about 3 us).
"""

from __future__ import annotations

import functools
import json
import os

import tvm
from tvm import relax

from .cpu_features import check_cpu_features, describe_target, target_cpu_features
from .cpu_guard_source import (
    GUARD_FUNC,
    INFO_FUNC,
    compiled_record,
    feature_mask,
    guard_source,
    mask_features,
)


@tvm.transform.module_pass(opt_level=0, name="tvmamp.CpuFeatureGuard")
class CpuFeatureGuard:
    """Prepend ``GUARD_FUNC(mask, target)`` to every public Relax function.

    Run it last (after ``VMShapeLower``), so the check is the function's first instruction:
    nothing compiled for the target, not even a shape function, runs before it.

    Parameters
    ----------
    features : sequence of str
        LLVM feature names the kernels may use ("avx512bf16", "amx-bf16", ...).
    target : str
        The target they were compiled for, as the error message shows it.
    """

    def __init__(self, features, target: str):
        self.mask = feature_mask(features)
        self.target = target

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        mod = mod.clone()
        for gvar, func in list(mod.functions_items()):
            if isinstance(func, relax.Function) and "global_symbol" in (func.attrs or {}):
                mod[gvar] = self._guard(func)
        return mod

    def _guard(self, func: relax.Function) -> relax.Function:
        args = [tvm.tirx.IntImm("int64", self.mask), tvm.ir.StringImm(self.target)]
        call = relax.Call(relax.ExternFunc(GUARD_FUNC), args, ty_args=[relax.ObjectType()])
        builder = relax.BlockBuilder()
        call = builder.normalize(call)
        guard = relax.VarBinding(relax.Var("cpu_guard", call.ty), call)
        body = func.body
        blocks = list(body.blocks) if isinstance(body, relax.SeqExpr) else []
        if blocks and not isinstance(blocks[0], relax.DataflowBlock):
            blocks[0] = relax.BindingBlock([guard, *blocks[0].bindings])
        else:
            blocks.insert(0, relax.BindingBlock([guard]))
        result = body.body if isinstance(body, relax.SeqExpr) else body
        body = builder.normalize(relax.SeqExpr(blocks, result))
        return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs, func.span)


def guard_passes(target: tvm.target.Target) -> list:
    """The guard pass for an llvm target whose code uses features beyond baseline x86-64."""
    features = target_cpu_features(target)
    return [CpuFeatureGuard(features, describe_target(target))] if features else []


@tvm.register_global_func(GUARD_FUNC, override=True)
def _check_in_process(mask: int, target: str) -> None:
    """The guard for code run in this process: the host's features from /proc/cpuinfo."""
    _check_cached(int(mask), str(target))


@functools.lru_cache(maxsize=64)
def _check_cached(mask: int, target: str) -> None:
    check_cpu_features(target, mask_features(mask))


def export_options(target: tvm.target.Target, workspace: str) -> dict:
    """``export_library`` keyword arguments that link the guard into the library ({} when the
    code needs no feature beyond baseline x86-64). ``workspace`` receives the source file."""
    if not target_cpu_features(target):
        return {}
    from tvm_ffi import libinfo

    path = os.path.join(workspace, "tvmamp_cpu_guard.cc")
    with open(path, "w", encoding="utf-8") as f:
        f.write(guard_source(target))
    include = [libinfo.find_include_path(), libinfo.find_dlpack_include_path()]
    return {"addons": [path], "options": [f"-I{p}" for p in include]}


def compiled_features(lib: tvm.runtime.Module) -> dict | None:
    """The record of a loaded library (``{"target": ..., "features": [...]}``), or None for a
    library without the guard (built for baseline x86-64, or by another tool)."""
    try:
        info = lib.get_function(INFO_FUNC, query_imports=True)
    except AttributeError:  # tvm_ffi's answer for a missing function
        return None
    return json.loads(str(info()))


def check_library(lib: tvm.runtime.Module) -> None:
    """Raise the guard's RuntimeError now if this host lacks a feature ``lib`` was built for."""
    record = compiled_features(lib)
    if record:
        check_cpu_features(record["target"], record["features"])


__all__ = [
    "GUARD_FUNC",
    "INFO_FUNC",
    "CpuFeatureGuard",
    "check_library",
    "compiled_features",
    "compiled_record",
    "export_options",
    "feature_mask",
    "guard_passes",
    "guard_source",
    "mask_features",
]
