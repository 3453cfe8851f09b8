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
entry names for ``tvm.compile`` and tuning builds. The same pipeline first places the software
prefetches that GEMM schedules ask for (:mod:`tvmamp.schedules.cpu.prefetch`), and lowers a
kernel of very large expressions without TVM's ``CommonSubexprElim`` (:data:`CSE_MAX_NODES`).

:func:`register_math_lowering` fills gaps in TVM's LLVM lowering of math intrinsics: ``sinh`` and
``cosh`` had none in any dtype, and ``asin``, ``acos``, ``atan``, ``asinh``, ``acosh`` and
``atan2`` none in float16, so a model using them failed to build ("unknown intrinsic").
"""

from __future__ import annotations

import functools

import tvm
import tvm_ffi
from tvm import tirx
from tvm.ir import Var
from tvm.ir.expr import Expr
from tvm_ffi.structural import WalkResult

from ..schedules.cpu.bounds import inject_likely
from ..schedules.cpu.prefetch import inject_prefetch
from .registry import derived_pass_context

# The TIR pipeline name the llvm target entry builds with (tvm.tirx.register_tir_pipeline).
PIPELINE = "tvmamp.llvm"
# TVM's annotation that keeps an allocation out of LowerTVMBuiltin (kDisableLowerTVMBuiltin).
DISABLE_LOWER_BUILTIN = "disable_lower_builtin"
# Largest ``local`` buffer kept on the stack: 4 KB, twice the 32 zmm registers of AVX-512.
STACK_LIMIT_BYTES = 4096
# Expression nodes of one stored value (a shared subexpression counted at each use) past which
# a kernel is lowered without TVM's CommonSubexprElim, whose time grows faster than the
# expression: RWKV's recurrence, unrolled over 128 tokens and fused into elementwise kernels
# and a GEMM epilogue, made four kernels whose CSE took 25 s of a 93 s build (2 layers, width
# 256). LLVM's own common-subexpression passes still run on them. The kernels of the zoo's
# other models stay far below the limit.
CSE_MAX_NODES = 20000


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
    """TVM's default (s_tir) pipeline, with the prefetches the schedules asked for placed first
    (:data:`.schedules.cpu.prefetch.inject_prefetch`); the host finalisation first keeps local
    tiles on the stack."""
    from tvm.s_tir.pipeline import default_s_tir_pipeline

    lower, finalize_host, finalize_device = default_s_tir_pipeline()

    def finalize_host_with_stack_tiles():
        return tvm.transform.Sequential([stack_local_tiles, finalize_host()])

    lower_with_prefetch = tvm.transform.Sequential(
        [inject_prefetch, inject_likely, _large_without_cse(lower)]
    )
    return lower_with_prefetch, finalize_host_with_stack_tiles, finalize_device


def expression_nodes(node, limit: int) -> int:
    """The expression nodes of ``node``, each shared subexpression counted at every use (as
    a pass walking the tree meets them; a variable or buffer is one node); past ``limit`` the
    count stops, returning more than ``limit``."""
    found = 0

    def visit(value):
        nonlocal found
        found += 1
        if found > limit or isinstance(value, Var):  # in TVM 0.27 a buffer is a Var
            return WalkResult.SKIP
        return WalkResult.ADVANCE

    tvm_ffi.structural_walk(node, [(Expr, visit)], order="pre")
    return found


def largest_store(func: tirx.PrimFunc, limit: int) -> int:
    """The most :func:`expression_nodes` of one stored value of ``func``: at most ``limit``,
    or more than ``limit`` when a value exceeds it."""
    largest = 0

    def visit(store):
        nonlocal largest
        if largest <= limit:
            largest = max(largest, expression_nodes(store.value, limit))
        return WalkResult.SKIP

    tvm_ffi.structural_walk(func.body, [(tirx.BufferStore, visit)], order="pre")
    return largest


def _large_without_cse(lower: tvm.transform.Pass) -> tvm.transform.Pass:
    """``lower``, with the kernels that store a value of more than :data:`CSE_MAX_NODES`
    expression nodes lowered apart, under ``tirx.disable_cse_tir``."""

    @tvm.transform.module_pass(opt_level=0, name="tvmamp.LowerLargeWithoutCSE")
    def run(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        large = {
            gvar
            for gvar, func in mod.functions_items()
            if isinstance(func, tirx.PrimFunc)
            and largest_store(func, CSE_MAX_NODES) > CSE_MAX_NODES
        }
        if not large:
            return lower(mod)
        parts = [
            tvm.IRModule(
                {g: f for g, f in mod.functions_items() if (g in large) == is_large},
                attrs=mod.attrs,
            )
            for is_large in (False, True)
        ]
        with derived_pass_context({"tirx.disable_cse_tir": True}):
            lowered = lower(parts[1])
        rest = lower(parts[0]) if parts[0].functions else parts[0]
        rest.update(lowered)
        return rest

    return run


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


# Intrinsics whose LLVM lowering TVM has for float32 only: float16 and bfloat16 calls are computed
# in float32 (one rounding at the end), and float32 calls keep TVM's own rule.
_FLOAT32_ONLY = ("tirx.asin", "tirx.acos", "tirx.atan", "tirx.asinh", "tirx.acosh", "tirx.atan2")
# Below this |x|, sinh(x) is its Taylor series to x^5 (the exp difference would cancel): the
# next term is below 5e-8 of the value there.
_SINH_SERIES_BELOW = 0.25


def _scalar_dtype(call: tirx.Call) -> str:
    """The element dtype of ``call`` (a vectorised loop's calls are ``float32x16`` and such)."""
    dtype = tvm.DataType(str(call.ty))
    return str(dtype.with_lanes(1)) if dtype.lanes > 1 else str(dtype)


def _float32_like(call: tirx.Call) -> str:
    lanes = tvm.DataType(str(call.ty)).lanes
    return "float32" if lanes == 1 else f"float32x{lanes}"


def _in_float32(call: tirx.Call, compute) -> tirx.PrimExpr:
    """``compute(args)`` in float32 for a float16/bfloat16 ``call``, cast back to its dtype."""
    args = [tirx.Cast(_float32_like(call), a) for a in call.args]
    return tirx.Cast(str(call.ty), compute(*args))


def _low_float_in_float32(call: tirx.Call) -> tirx.PrimExpr:
    if _scalar_dtype(call) not in ("float16", "bfloat16"):
        return call  # unchanged: TVM's next rule (its float32 one) applies
    return _in_float32(
        call, lambda *args: tirx.call_intrin(_float32_like(call), call.op.name, *args)
    )


def _sinh(x: tirx.PrimExpr) -> tirx.PrimExpr:
    half = tirx.const(0.5, "float32")
    x2 = x * x
    series = x * (1 + x2 * (tirx.const(1 / 6, "float32") + x2 * tirx.const(1 / 120, "float32")))
    exp = half * (tirx.exp(x) - tirx.exp(-x))
    return tirx.Select(tirx.abs(x) < tirx.const(_SINH_SERIES_BELOW, "float32"), series, exp)


def _cosh(x: tirx.PrimExpr) -> tirx.PrimExpr:
    return tirx.const(0.5, "float32") * (tirx.exp(x) + tirx.exp(-x))


def _hyperbolic(compute):
    def lower(call: tirx.Call) -> tirx.PrimExpr:
        dtype = _scalar_dtype(call)
        if dtype == "float32":
            return compute(call.args[0])
        if dtype in ("float16", "bfloat16"):
            return _in_float32(call, compute)
        return call  # float64: TVM's rule (a libm call) applies

    return lower


@functools.cache
def register_math_lowering() -> None:
    """Register the LLVM lowering rules above with TVM (``tirx.register_intrin_lowering``)."""
    for name in _FLOAT32_ONLY:
        tirx.register_intrin_lowering(name, "llvm", f=_low_float_in_float32, level=99)
    tirx.register_intrin_lowering("tirx.sinh", "llvm", f=_hyperbolic(_sinh), level=99)
    tirx.register_intrin_lowering("tirx.cosh", "llvm", f=_hyperbolic(_cosh), level=99)
