"""Executable: a compiled tvmamp model on the Relax VM, callable with numpy arrays."""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax

from tvmamp.relay_passes.auto_mixed_precision import np_dtype, tensor_dtype


def _device_for(target: tvm.target.Target) -> tvm.runtime.Device:
    kind = target.kind.name
    return tvm.cpu(0) if kind in ("llvm", "c") else tvm.device(kind, 0)


class Executable:
    """A built model: call it with numpy arrays (or TVM tensors) to run ``main``.

    Attributes
    ----------
    mod : tvm.IRModule
        The converted Relax module before lowering: it shows which op runs in which dtype.
    stats : tvmamp.relay_passes.AmpReport
        What the AMP pass did (casts, ops per dtype, forced nodes).
    target : tvm.target.Target
    policy : tvmamp.Policy
    partition : object or None
        For BYOC targets (the NPU), the partition report: which ops run on the accelerator and
        which fell back to the host, and why.
    plan : tvmamp.PrecisionPlan or None
        The precision plan applied (``build(plan=...)`` or ``level="auto-search"``).
    """

    def __init__(self, vm_exec, target, mod, stats, policy, notes=()):
        self.vm_exec = vm_exec
        self.target = target
        self.mod = mod
        self.stats = stats
        self.policy = policy
        self.notes = list(notes)
        self.partition = None
        self.plan = None
        self.device = _device_for(target)
        self._vm = None
        self._params = [(p.name, p.ty) for p in mod["main"].params] if "main" in mod else []

    @property
    def vm(self) -> relax.VirtualMachine:
        """The Relax VM (created on first use; needs the target's device)."""
        if self._vm is None:
            if not self.device.exist:
                raise RuntimeError(
                    f"tvmamp: no {self.target.kind.name} device on this machine to run the "
                    "executable; export it with export_library() and run it where one exists"
                )
            self._vm = relax.VirtualMachine(self.vm_exec, self.device)
        return self._vm

    def __call__(self, *inputs, func: str = "main"):
        """Run ``func`` and return numpy arrays (a tuple for tuple outputs)."""
        return to_numpy(self.vm[func](*self._convert_inputs(inputs)))

    def _convert_inputs(self, inputs):
        if len(inputs) != len(self._params):
            names = ", ".join(n for n, _ in self._params)
            raise TypeError(
                f"tvmamp: main takes {len(self._params)} inputs ({names}), got {len(inputs)}"
            )
        return [self._convert(x, name, ty) for x, (name, ty) in zip(inputs, self._params)]

    def _convert(self, value, name, ty):
        if isinstance(value, tvm.runtime.Tensor):
            return value
        array = np.asarray(value)
        want = tensor_dtype_of(ty)
        if want is not None and array.dtype != np_dtype(want):
            raise TypeError(
                f"tvmamp: input {name!r} has dtype {array.dtype}, but the model expects {want}"
            )
        shape = static_shape(ty)
        if shape is not None and tuple(array.shape) != shape:
            raise ValueError(
                f"tvmamp: input {name!r} has shape {array.shape}, but the model expects {shape}"
            )
        return tvm.runtime.tensor(array, self.device)

    def export_library(self, path: str) -> str:
        """Write a shared library loadable with ``tvm.runtime.load_module``."""
        self.vm_exec.export_library(path)
        return path

    def get_source(self, fmt: str = "asm") -> str:
        """Generated code: "asm" or "ll" for LLVM kernels, "cuda" or "ptx" for CUDA ones."""
        formats = ("asm", "ll", "cuda", "ptx")
        if fmt not in formats:
            raise ValueError(f"tvmamp: source format {fmt!r} is not one of {', '.join(formats)}")
        if fmt == "ptx":
            from tvm.support import nvcc

            arch = str(self.target.attrs.get("arch", "sm_80"))
            with self.target:  # nvcc reads the compute version from the current target
                ptx = nvcc.compile_cuda(self.get_source("cuda"), "ptx", arch, compiler="nvcc")
            return ptx if isinstance(ptx, str) else bytes(ptx).decode()
        kind = "cuda" if fmt == "cuda" else "llvm"
        sources = [m.inspect_source(fmt) for m in _walk(self.vm_exec.mod) if m.kind == kind]
        if not sources:
            raise ValueError(f"tvmamp: this executable has no {kind} module to show as {fmt}")
        return "\n".join(sources)


def _walk(module):
    yield module
    for sub in module.imports:
        yield from _walk(sub)


def tensor_dtype_of(ty) -> str | None:
    """dtype of a TensorType, or None."""
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else None


def static_shape(ty) -> tuple | None:
    """The shape of a TensorType when every dimension is a constant, else None."""
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    dims = ty.shape.values
    if not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
        return None
    return tuple(int(d) for d in dims)


def to_numpy(value):
    """Convert VM outputs (tensors, tuples of tensors) to numpy."""
    if isinstance(value, tvm.runtime.Tensor):
        return value.numpy()
    if isinstance(value, (list, tuple)) or hasattr(value, "__len__"):
        return tuple(to_numpy(v) for v in value)
    return value


__all__ = ["Executable", "tensor_dtype", "to_numpy"]
