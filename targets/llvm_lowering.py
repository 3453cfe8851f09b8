"""The TIR lowering of CPU kernels: TVM's pipeline, with register tiles kept on the stack.

TVM's ``LowerTVMBuiltin`` turns every ``local`` buffer of a host function whose size it cannot
prove is below 1 KB on the CPU (in practice: every one, since the device type of a packed
function is not a constant there) into a ``TVMBackendAllocWorkspace`` call. The register tiles
of tvmamp's GEMM and conv kernels (``cache_write(..., "local")``, 16 zmm registers = 1 KB) then
live in heap memory. In a serial kernel LLVM still keeps them in registers, because the
kernel's buffer arguments are ``noalias``; inside a parallel loop they are not (TVM passes them
through a closure), so LLVM stores every accumulator after each ``vdpbf16ps`` and reloads the
operands: a bf16 GEMM built for two cores was 2.6x slower *on one thread* than the serial one
(BENCHMARKS.md, issue 16).

:func:`stack_local_tiles` marks those allocations ``disable_lower_builtin`` (TVM's own
annotation, ``tirx::transform::kDisableLowerTVMBuiltin``), so they stay ``alloca``\\ s that
LLVM promotes to registers; only small static ``local`` buffers are marked
(:data:`STACK_LIMIT_BYTES`), so no kernel can overflow a thread's stack. The pass runs right
before ``LowerTVMBuiltin``, in the TIR pipeline :data:`PIPELINE`, which the ``llvm`` target
entry names for ``tvm.compile`` and tuning builds.
"""

from __future__ import annotations

import functools

import tvm
import tvm_ffi
from tvm import tirx

# The TIR pipeline name the llvm target entry builds with (tvm.tirx.register_tir_pipeline).
PIPELINE = "tvmamp.llvm"
# TVM's annotation that keeps an allocation out of LowerTVMBuiltin (kDisableLowerTVMBuiltin).
DISABLE_LOWER_BUILTIN = "disable_lower_builtin"
# Largest ``local`` buffer kept on the stack: 4 KB, twice the 32 zmm registers of AVX-512.
STACK_LIMIT_BYTES = 4096


def _static_bytes(buffer: tirx.Buffer) -> int | None:
    """The size of ``buffer`` in bytes when its shape is constant, else None."""
    size = tvm.DataType(buffer.dtype).bits // 8 * tvm.DataType(buffer.dtype).lanes
    for extent in buffer.shape:
        if not isinstance(extent, tirx.IntImm):
            return None
        size *= int(extent)
    return size


def _mark(node: tirx.AllocBuffer) -> tirx.AllocBuffer:
    buffer = node.buffer
    size = _static_bytes(buffer)
    if buffer.scope() != "local" or size is None or size > STACK_LIMIT_BYTES:
        return node
    annotations = dict(node.annotations or {})
    if DISABLE_LOWER_BUILTIN in annotations:
        return node
    annotations[DISABLE_LOWER_BUILTIN] = tirx.IntImm("bool", 1)
    return tirx.AllocBuffer(buffer, annotations, node.span)


@tirx.transform.prim_func_pass(opt_level=0, name="tvmamp.StackLocalTiles")
def stack_local_tiles(func: tirx.PrimFunc, _mod, _ctx) -> tirx.PrimFunc:
    """Mark each static ``local`` allocation of at most 4 KB ``disable_lower_builtin``."""
    body = tvm_ffi.structural_map(func.body, [(tirx.AllocBuffer, _mark)])
    return func if body.same_as(func.body) else func.with_body(body)


def _pipeline_factory():
    """TVM's default (s_tir) pipeline; the host finalisation first keeps local tiles on stack."""
    from tvm.s_tir.pipeline import default_s_tir_pipeline

    lower, finalize_host, finalize_device = default_s_tir_pipeline()

    def finalize_host_with_stack_tiles():
        return tvm.transform.Sequential([stack_local_tiles, finalize_host()])

    return lower, finalize_host_with_stack_tiles, finalize_device


@functools.cache
def register() -> str:
    """Register :data:`PIPELINE` with TVM once; return its name for ``tvm.compile``."""
    tirx.register_tir_pipeline(PIPELINE, _pipeline_factory)
    return PIPELINE


def tir_pipeline(_target: tvm.target.Target) -> str:
    """The ``tir_pipeline`` of CPU builds (the llvm target entry's ``tir_pipeline``)."""
    return register()


@tvm.register_global_func("tvmamp.meta_schedule.llvm_build", override=True)
def meta_schedule_build(mod: tvm.IRModule, target: tvm.target.Target, _params=None):
    """meta_schedule's default CPU build, lowered with :data:`PIPELINE` as ``tvm.compile`` is.

    Tuning candidates are timed as the final build will run them (local tiles on the stack).
    """
    import tvm.s_tir.tensor_intrin  # noqa: F401  (registers TVM's intrinsics, as TVM's build does)
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm.tirx.build(mod, target=target, pipeline=register())
