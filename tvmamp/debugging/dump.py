"""Op-output dumps: run an instrumented build once and keep every op's output, in graph order."""

from __future__ import annotations

import dataclasses
import json
import os

import ml_dtypes
import numpy as np
import tvm

from tvmamp.conversion import convert
from tvmamp.pipeline import (
    add_instrumentation_hook,
    compile_converted,
    remove_instrumentation_hook,
)

from .instrument import Site, instrument_module, packed_call, tensor_fields

DUMP_FUNC = "tvmamp.debugging.dump_tensor"
_MANIFEST, _TENSORS = "dump.json", "tensors.npz"


@dataclasses.dataclass
class OpRecord:
    """One op output: where it came from, and its value (bf16 kept as float32)."""

    site: Site
    dtype: str
    value: np.ndarray


@dataclasses.dataclass
class OpDump:
    """Every op output of one run, in the order the ops ran, plus how the model was built."""

    records: list
    meta: dict

    def save(self, path: str | os.PathLike) -> str:
        """Write ``dump.json`` and ``tensors.npz`` into the directory ``path``."""
        os.makedirs(path, exist_ok=True)
        sites = [{**dataclasses.asdict(r.site), "out_dtype": r.dtype} for r in self.records]
        with open(os.path.join(path, _MANIFEST), "w", encoding="utf-8") as f:
            json.dump({"meta": self.meta, "records": sites}, f, indent=1)
        np.savez(os.path.join(path, _TENSORS), *[r.value for r in self.records])
        return os.fspath(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> OpDump:
        """Read a dump written by :meth:`save`."""
        manifest = os.path.join(path, _MANIFEST)
        if not os.path.isfile(manifest):
            raise FileNotFoundError(
                f"tvmamp.debugging: {os.fspath(path)!r} is not an op dump (no {_MANIFEST}); "
                "write one with record_op_outputs(...).save(path)"
            )
        with open(manifest, encoding="utf-8") as f:
            data = json.load(f)
        with np.load(os.path.join(path, _TENSORS)) as arrays:
            values = [arrays[f"arr_{i}"] for i in range(len(data["records"]))]
        records = []
        for site, value in zip(data["records"], values):
            out_dtype = site.pop("out_dtype")
            records.append(OpRecord(Site(**site), out_dtype, value))
        return cls(records, data["meta"])


_RECORDING: list[list] = []


@tvm.register_global_func(DUMP_FUNC, override=True)
def _dump_tensor(tensor, func, index, op, var, dtype):
    if not _RECORDING:
        return
    value = tensor.numpy()
    out_dtype = "bfloat16" if value.dtype == ml_dtypes.bfloat16 else str(value.dtype)
    if out_dtype == "bfloat16":
        value = value.astype(np.float32)
    site = Site(str(func), int(index), str(op), str(var), str(dtype))
    _RECORDING[-1].append(OpRecord(site, out_dtype, value.copy()))


def dump_hook(converted) -> tvm.IRModule:
    """Instrumentation hook: hand every float op output to the active recording."""

    def emit(site: Site, value):
        return [
            packed_call(DUMP_FUNC, t, s.func, str(s.index), s.op, s.var, s.dtype)
            for s, t in tensor_fields(site, value)
        ]

    return instrument_module(converted.mod, emit)


def record_op_outputs(model, inputs, level: str = "O1", **convert_kwargs) -> OpDump:
    """Build ``model`` instrumented, run ``main`` once on ``inputs``, keep every op output.

    Parameters
    ----------
    model : tvm.IRModule or relax.Function
        The fp32 model.
    inputs : list of np.ndarray
        Data inputs of ``main``.
    level : str
        AMP level ("O0" for the fp32 reference).
    **convert_kwargs
        Passed to :func:`tvmamp.convert` (``target``, ``dtype``, ``params``, custom lists...).

    Returns
    -------
    OpDump
    """
    converted = convert(model, level, **convert_kwargs)
    add_instrumentation_hook(dump_hook)
    try:
        exe = compile_converted(converted)
    finally:
        remove_instrumentation_hook(dump_hook)
    _RECORDING.append([])
    try:
        exe(*inputs)
    finally:
        records = _RECORDING.pop()
    meta = {"level": level, "dtype": exe.policy.low_dtype, "target": str(exe.target.kind.name)}
    return OpDump(records, meta)
