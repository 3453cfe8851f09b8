"""Executable: a compiled tvmamp model on the Relax VM, callable with numpy arrays."""

from __future__ import annotations

import tempfile

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from tvmamp.targets import REGISTRY, resolve_target
from tvmamp.targets.cpu_features import check_cpu_features
from tvmamp.targets.cpu_guard import export_options
from tvmamp.tensors import check_array

# Bytes: TVM allocates tensors at this alignment, and its CPU kernels load them with aligned
# vector moves (``vmovaps``), so a less aligned input can crash the process.
ALIGNMENT = 64


def aligned_input(value, device: tvm.runtime.Device):
    """``value`` made safe to pass to a VM function.

    numpy arrays are copied into a new tensor on ``device``; other DLPack tensors (torch, ...)
    are wrapped without a copy when they are on ``device``, contiguous and 64-byte aligned, and
    copied otherwise; TVM tensors are copied (on their own device) only when not aligned or not
    contiguous. Tuples and lists are converted element by element; other values pass unchanged.
    """
    if isinstance(value, tvm_ffi.Tensor):
        return value if _is_aligned(value) else _copy(value, value.device)
    if isinstance(value, np.ndarray):
        return tvm.runtime.tensor(value, device)
    if isinstance(value, (tuple, list)):
        return type(value)(aligned_input(v, device) for v in value)
    if hasattr(type(value), "__dlpack__"):
        tensor = tvm_ffi.from_dlpack(value)
        if _is_aligned(tensor) and tensor.device == device:
            return tensor
        return _copy(tensor, device)
    return value


def _is_aligned(tensor) -> bool:
    return tensor.data_ptr() % ALIGNMENT == 0 and tensor.is_contiguous()


def _copy(tensor, device):
    if tensor.is_contiguous():
        return tvm.runtime.empty(tensor.shape, tensor.dtype, device).copyfrom(tensor)
    return tvm.runtime.tensor(np.ascontiguousarray(np.from_dlpack(tensor)), device)


class AlignedVirtualMachine(relax.VirtualMachine):
    """A Relax VM whose functions take numpy arrays, DLPack tensors and unaligned tensors.

    ``vm["main"](x)`` converts every argument with :func:`aligned_input` first (TVM passes
    numpy arrays to the kernels without a copy, and a numpy array is often not 64-byte
    aligned); so do ``time_evaluator``, ``set_input``, ``save_function`` and
    ``invoke_closure``. Everything else is ``relax.VirtualMachine``'s.
    """

    def __init__(self, rt_mod, device, memory_cfg=None):
        super().__init__(rt_mod, device, memory_cfg)
        self.device = device[0] if isinstance(device, (list, tuple)) else device

    def _align(self, args) -> list:
        return [aligned_input(a, self.device) for a in args]

    def __getitem__(self, name: str):
        return AlignedFunction(super().__getitem__(name), self.device)

    def invoke_closure(self, closure, *args):
        return super().invoke_closure(closure, *self._align(args))

    def save_function(self, func_name, saved_name, *args, include_return=True, **kwargs):
        kwargs = {k: aligned_input(v, self.device) for k, v in kwargs.items()}
        super().save_function(
            func_name, saved_name, *self._align(args), include_return=include_return, **kwargs
        )

    def set_input(self, func_name, *args, **kwargs):
        kwargs = {k: aligned_input(v, self.device) for k, v in kwargs.items()}
        super().set_input(func_name, *self._align(args), **kwargs)

    def time_evaluator(self, func_name, dev, *args, **kwargs):
        timer = super().time_evaluator(func_name, dev, *args, **kwargs)
        return lambda *inputs: timer(*self._align(inputs))


class AlignedFunction:
    """A VM function that converts its arguments with :func:`aligned_input` (``.function`` is
    the underlying TVM function)."""

    def __init__(self, function, device):
        self.function = function
        self.device = device

    def __call__(self, *args):
        return self.function(*(aligned_input(a, self.device) for a in args))


class Executable:
    """A built model: call it with numpy arrays (or TVM tensors) to run ``main``.

    Attributes
    ----------
    mod : tvm.IRModule
        The converted Relax module before lowering: it shows which op runs in which dtype.
    stats : tvmamp.relay_passes.AmpReport
        What the AMP pass did (casts, ops per dtype, forced nodes).
    target : tvm.target.Target
    entry : tvmamp.targets.TargetEntry
        What tvmamp knows about the target: its device, the source formats it can show. The
        entry the model was converted for (``Converted.entry``); by default the one registered
        for the target's kind.
    policy : tvmamp.Policy
    partition : object or None
        For BYOC targets (the NPU), the partition report: which ops run on the accelerator and
        which fell back to the host, and why.
    plan : tvmamp.PrecisionPlan or None
        The precision plan applied (``build(plan=...)`` or ``level="auto-search"``).
    """

    def __init__(self, vm_exec, target, mod, stats, policy, notes=(), entry=None):
        self.vm_exec = vm_exec
        self.target = target
        self.mod = mod
        self.stats = stats
        self.policy = policy
        self.notes = list(notes)
        self.partition = None
        self.plan = None
        self.entry = entry if entry is not None else resolve_target(target)[1]
        self.device = self.entry.device(target)
        self._vm = None
        self._params = [(p.name, p.ty) for p in mod["main"].params] if "main" in mod else []

    @property
    def vm(self) -> AlignedVirtualMachine:
        """The Relax VM (created on first use; needs the target's device and CPU features).

        Its functions copy numpy arrays, DLPack tensors and TVM tensors that are not 64-byte
        aligned into aligned tensors on ``self.device`` (TVM's kernels assume the alignment).
        """
        if self._vm is None:
            if not self.device.exist:
                raise RuntimeError(
                    f"tvmamp: no {self.target.kind.name} device on this machine to run the "
                    "executable; export it with export_library() and run it where one exists"
                )
            check_cpu_features(self.target)
            self._vm = AlignedVirtualMachine(self.vm_exec, self.device)
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
        return tvm.runtime.tensor(check_array(value, name, ty, "tvmamp"), self.device)

    def export_library(self, path: str) -> str:
        """Write a shared library loadable with ``tvm.runtime.load_module``.

        For a CPU target beyond baseline x86-64 the library holds the CPU feature guard
        (:mod:`tvmamp.targets.cpu_guard`): on a CPU without the target's features its functions
        raise an error naming them instead of crashing.
        """
        with tempfile.TemporaryDirectory(prefix="tvmamp_export_") as workspace:
            self.vm_exec.export_library(path, **export_options(self.target, workspace))
        return path

    def get_source(self, fmt: str = "asm") -> str:
        """Generated code in a format of the target entry's ``source_formats``.

        "asm" or "ll" for LLVM (host and CPU) code on every target; "cuda" or "ptx" for the
        kernels of CUDA targets (PTX compiled by nvcc from the CUDA source, no GPU needed).
        """
        source = self.entry.source_formats.get(fmt)
        if source is None:
            raise _unavailable(fmt)
        texts = [
            m.inspect_source(source.module_format)
            for m in _walk(self.vm_exec.mod)
            if m.kind == source.module_kind
        ]
        if not texts:
            raise ValueError(
                f"tvmamp: this executable has no {source.module_kind} module to show as {fmt}"
            )
        text = "\n".join(texts)
        return source.convert(self.target, text) if source.convert is not None else text


def _unavailable(fmt: str) -> ValueError:
    """The error for a format this executable's target cannot show."""
    known = {name: f for e in REGISTRY.values() for name, f in e.source_formats.items()}
    if fmt not in known:
        return ValueError(f"tvmamp: source format {fmt!r} is not one of {', '.join(known)}")
    kind = known[fmt].module_kind
    return ValueError(f"tvmamp: this executable has no {kind} module to show as {fmt}")


def _walk(module):
    yield module
    for sub in module.imports:
        yield from _walk(sub)


def to_numpy(value):
    """Convert VM outputs (tensors, tuples of tensors) to numpy."""
    if isinstance(value, tvm.runtime.Tensor):
        return value.numpy()
    if isinstance(value, (list, tuple)) or hasattr(value, "__len__"):
        return tuple(to_numpy(v) for v in value)
    return value


__all__ = ["AlignedVirtualMachine", "Executable", "aligned_input", "to_numpy"]
