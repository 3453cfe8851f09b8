"""Read the tensor-core instructions out of CUDA PTX (or CUDA source), kernel by kernel."""

from __future__ import annotations

import dataclasses
import re

_ENTRY = re.compile(r"\.entry\s+(\w+)\s*\(")
# A CUDA C kernel definition (not its forward declaration): TVM's inline asm names the same
# instructions as the PTX does.
_CUDA_KERNEL = re.compile(
    r"__global__\s+void\s+(?:__launch_bounds__\(\d+\)\s+)?(\w+)\([^;{]*\)\s*\{"
)
_MMA = re.compile(r"\b((?:wmma\.)?mma\.sync\.aligned\.[a-z0-9.]+)")
_SHAPE = re.compile(r"^m\d+n\d+k\d+$")
_PTX_TYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "tf32": "tfloat32"}
# Kernels TVM names after the GEMM-like op they compute.
GEMM_KERNEL = re.compile(r"(matmul|dense|conv2d)")


@dataclasses.dataclass(frozen=True)
class TensorCoreOp:
    """One tensor-core instruction: its PTX spelling, operand and accumulator dtypes."""

    instruction: str
    shape: str
    operand_dtype: str
    accumulate_dtype: str

    @classmethod
    def parse(cls, instruction: str) -> TensorCoreOp:
        """Parse ``mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`` or a wmma spelling.

        ``wmma.mma`` for fp16 names only the D and C types ("...m16n16k16.f32.f32"); its
        operands are f16 by definition.
        """
        parts = instruction.split(".")
        shape_at = next(i for i, p in enumerate(parts) if _SHAPE.match(p))
        types = [p for p in parts[shape_at + 1 :] if p in _PTX_TYPES]
        if len(types) == 2:
            types = [types[0], "f16", "f16", types[1]]
        if len(types) != 4 or types[1] != types[2]:
            raise ValueError(f"tvmamp.targets.ptx: cannot read the types of {instruction!r}")
        return cls(instruction, parts[shape_at], _PTX_TYPES[types[1]], _PTX_TYPES[types[0]])


@dataclasses.dataclass(frozen=True)
class KernelReport:
    """What one PTX kernel uses of the tensor cores."""

    name: str
    tensor_core_ops: tuple[TensorCoreOp, ...]
    ldmatrix: bool
    cp_async: bool

    @property
    def is_gemm(self) -> bool:
        """Whether TVM named the kernel after a matmul, dense or conv2d."""
        return GEMM_KERNEL.search(self.name) is not None

    def summary(self) -> str:
        """One line: the kernel, its tensor-core instructions and data movement."""
        ops = ", ".join(sorted({op.instruction for op in self.tensor_core_ops})) or "-"
        flags = (("ldmatrix", self.ldmatrix), ("cp.async", self.cp_async))
        extras = [word for word, used in flags if used]
        return f"{self.name}: {ops}" + (f" [{', '.join(extras)}]" if extras else "")


def kernel_reports(ptx: str) -> list[KernelReport]:
    """One :class:`KernelReport` per kernel (a PTX ``.entry`` or a CUDA ``__global__``), in order.

    Parameters
    ----------
    ptx : str
        PTX from ``Executable.get_source("ptx")``, or CUDA source from ``get_source("cuda")``.
    """
    entry = _ENTRY if _ENTRY.search(ptx) else _CUDA_KERNEL
    starts = [(m.start(), m.group(1)) for m in entry.finditer(ptx)]
    reports = []
    for index, (start, name) in enumerate(starts):
        end = starts[index + 1][0] if index + 1 < len(starts) else len(ptx)
        body = ptx[start:end]
        ops = tuple(TensorCoreOp.parse(i) for i in sorted(set(_MMA.findall(body))))
        reports.append(KernelReport(name, ops, "ldmatrix" in body, "cp.async" in body))
    return reports


def gemm_kernels_without_tensor_cores(
    ptx: str, operand_dtype: str, accumulate_dtype: str = "float32"
) -> list[str]:
    """Names of matmul/conv kernels that do not use tensor cores with the given dtypes."""
    missing = []
    for report in kernel_reports(ptx):
        if not report.is_gemm:
            continue
        ok = [
            op
            for op in report.tensor_core_ops
            if op.operand_dtype == operand_dtype and op.accumulate_dtype == accumulate_dtype
        ]
        if not ok:
            missing.append(report.name)
    return missing
