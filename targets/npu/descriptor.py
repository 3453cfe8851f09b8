"""An NPU's limits as data: dtypes, ops, fused patterns and shape constraints."""

from __future__ import annotations

import dataclasses
import difflib
import re

# Single ops the built-in pattern table and the reference codegen know how to offload.
KNOWN_OPS = (
    "relax.matmul",
    "relax.nn.conv2d",
    "relax.add",
    "relax.multiply",
    "relax.nn.relu",
    "relax.nn.max_pool2d",
)

# Fused patterns: name -> the ops they contain besides astype and permute_dims. "dense" is a
# matmul whose right operand is a transposed weight ([N, K], the NPU's native weight layout).
KNOWN_FUSED = {
    "dense_bias_relu": ("relax.matmul", "relax.add", "relax.nn.relu"),
    "dense_bias_gelu": ("relax.matmul", "relax.add", "relax.nn.gelu"),
    "dense_bias": ("relax.matmul", "relax.add"),
    "matmul_bias_relu": ("relax.matmul", "relax.add", "relax.nn.relu"),
    "matmul_bias_gelu": ("relax.matmul", "relax.add", "relax.nn.gelu"),
    "matmul_bias": ("relax.matmul", "relax.add"),
    "conv2d_bias_relu": ("relax.nn.conv2d", "relax.add", "relax.nn.relu"),
    "conv2d_bias": ("relax.nn.conv2d", "relax.add"),
    "conv2d_relu": ("relax.nn.conv2d", "relax.nn.relu"),
}

# Ops that only move or reshape data: exact in fp16, so the host may keep them low.
DATA_MOVEMENT_OPS = (
    "relax.reshape",
    "relax.permute_dims",
    "relax.expand_dims",
    "relax.squeeze",
    "relax.flatten",
    "relax.nn.batch_flatten",
    "relax.broadcast_to",
    "relax.concat",
    "relax.split",
    "relax.stack",
    "relax.strided_slice",
    "relax.dynamic_strided_slice",
    "relax.layout_transform",
    "relax.repeat",
    "relax.tile",
    "relax.flip",
)


@dataclasses.dataclass(frozen=True)
class NpuDescriptor:
    """What an NPU can run. Everything else stays on the host CPU (in fp32 below O3).

    Parameters
    ----------
    name : str
        Codegen name: the codegen is ``relax.ext.<name>`` and patterns are ``<name>.<pattern>``.
    dtypes : tuple of str
        Tensor dtypes the NPU computes in (the AMP low dtype must be one of them).
    accumulate_dtypes : tuple of str
        ``out_dtype`` values matmul and conv2d may have (their accumulator).
    ops : tuple of str
        Single Relax ops the NPU runs (a subset of ``KNOWN_OPS``).
    fused : tuple of str
        Fused patterns (keys of ``KNOWN_FUSED``), matched before the single ops.
    channel_multiple : int
        Matmul K and N, and conv2d input and output channels, must be multiples of this.
    vector_multiple : int
        The innermost dimension of elementwise and pooling outputs must be a multiple of this.
    max_dilation : int
        Largest conv2d / max_pool2d dilation.
    max_kernel : int
        Largest conv2d / max_pool2d window side.
    max_rank : int
        Largest tensor rank.
    data_layout, kernel_layout : str
        The conv2d / max_pool2d layouts the NPU reads.
    merge_regions : bool
        Merge neighbouring offloaded patterns into one NPU function (``MergeCompositeFunctions``)
        instead of one function per pattern (``FuseOpsByPattern(annotate_codegen=True)``).
    """

    name: str
    dtypes: tuple = ("float16",)
    accumulate_dtypes: tuple = ("float32", "float16")
    ops: tuple = KNOWN_OPS
    fused: tuple = tuple(KNOWN_FUSED)
    channel_multiple: int = 16
    vector_multiple: int = 16
    max_dilation: int = 1
    max_kernel: int = 7
    max_rank: int = 4
    data_layout: str = "NCHW"
    kernel_layout: str = "OIHW"
    merge_regions: bool = True

    def __post_init__(self):
        validate(self)

    def runnable_ops(self) -> tuple[str, ...]:
        """Every Relax op that can run on the NPU, alone or inside a fused pattern."""
        fused_ops = [op for name in self.fused for op in KNOWN_FUSED[name]]
        return tuple(sorted(set(self.ops) | set(fused_ops)))


def _unknown(component: str, what: str, value, choices) -> ValueError:
    close = difflib.get_close_matches(str(value), list(choices), n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return ValueError(
        f"{component}: {what} {value!r} is not known{hint}; valid: {', '.join(choices)}"
    )


def validate(desc: NpuDescriptor) -> None:
    """Raise ValueError/TypeError for a descriptor the pattern table cannot honour."""
    component = f"tvmamp.targets.npu descriptor {desc.name!r}"
    if not isinstance(desc.name, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", desc.name):
        raise ValueError(f"{component}: name must be a C identifier such as 'my_npu'")
    for field in ("dtypes", "accumulate_dtypes", "ops", "fused"):
        if not isinstance(getattr(desc, field), tuple):
            raise TypeError(f"{component}: {field} must be a tuple, got {getattr(desc, field)!r}")
    for dtype in (*desc.dtypes, *desc.accumulate_dtypes):
        if dtype not in ("float16", "bfloat16", "float32"):
            raise _unknown(component, "dtype", dtype, ("float16", "bfloat16", "float32"))
    if not desc.dtypes or "float32" in desc.dtypes:
        raise ValueError(f"{component}: dtypes must list the NPU's low dtypes, got {desc.dtypes}")
    for op in desc.ops:
        if op not in KNOWN_OPS:
            raise _unknown(component, "op", op, KNOWN_OPS)
    for name in desc.fused:
        if name not in KNOWN_FUSED:
            raise _unknown(component, "fused pattern", name, KNOWN_FUSED)
    for field in ("channel_multiple", "vector_multiple", "max_dilation", "max_kernel", "max_rank"):
        value = getattr(desc, field)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{component}: {field} must be a positive int, got {value!r}")
    if (desc.data_layout, desc.kernel_layout) != ("NCHW", "OIHW"):
        raise ValueError(
            f"{component}: layouts {desc.data_layout}/{desc.kernel_layout} are not supported by "
            "the reference kernels; valid: NCHW/OIHW"
        )


# The reference NPU: fp16 only, a 16x16 matrix engine and a 16-lane vector unit, NCHW.
TVMAMP_NPU = NpuDescriptor(name="tvmamp_npu")
