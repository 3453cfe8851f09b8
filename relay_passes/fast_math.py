"""Fast transcendental functions (exp, erf, tanh, sigmoid, silu, gelu, softmax, log-softmax)
for CPU kernels.

LLVM has no vector ``exp``/``erf``/``tanh``: TVM's versions call the scalar libm routine per
element (3-9 ns per element, against 0.5 for onnxruntime's polynomials), and bf16 ones widen to
fp32 first; a GELU epilogue took 17 ms of a 35 ms transformer layer. :class:`FastMath` rewrites
those ops on the dtypes it is given into kernels that compute in fp32 with polynomials that
vectorise (TVM's ``fast_erf``/``fast_tanh``, and an exp with a two-constant range reduction,
within 1 ulp) and round back to the op's dtype. Its softmax splits each row into a body of whole
SIMD vectors and a tail, which the CPU row-reduction schedule (``schedules/cpu/reduction.py``)
accumulates in registers. :func:`LowPrecisionFastMath` is the fp16/bf16-only variant: fp32 ops
keep TVM's exact libm functions.
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import relax, te, tirx, topi

from .bindings import bound_values, call_of, scalar_constant
from .gemm_softmax import ROW_SOFTMAX
from .nan_ops import isnan
from .symbolic_rows import needs_padding

LOW_DTYPES = ("float16", "bfloat16")


def _widened(fast):
    """Return a TE function: widen to fp32, apply ``fast``, round back."""

    def compute(x, *args):
        wide = topi.cast(x, "float32")
        return topi.cast(fast(wide, *args), x.dtype)

    return compute


def _gelu(x):
    """``0.5 * x * (1 + erf(x / sqrt(2)))`` with the fast erf (a NaN stays NaN through the
    factor ``x``, so the clamping erf needs no guard here)."""
    return 0.5 * x * (1.0 + topi.fast_erf(x * (1.0 / math.sqrt(2.0))))


def _gelu_tanh(x):
    """``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))`` with the fast tanh."""
    inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)
    return 0.5 * x * (1.0 + topi.fast_tanh(inner))


# Cephes' expf: ln 2 split in two for an exact range reduction, then a degree-6 polynomial on
# [-ln2/2, ln2/2]. Within 2 ulp of exp over the clamped range, where TVM's ``fast_exp``
# reduces with one constant and drifts to 70 ulp (4e-6 relative) near |x| = 80.
_LOG2E = 1.44269504088896341
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4
_EXP_POLY = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1)
_EXP_MIN, _EXP_MAX = -87.33, 88.37  # exp stays a normal fp32 number (2^n built from bits)


_EXP_OVERFLOW = 88.7228394  # log of the largest fp32 number: above it exp is +inf


def _exp_of(value):
    """The expression ``exp(value)`` for an fp32 expression, vectorisable (no libm call).

    NaN stays NaN, values past the overflow threshold give +inf and those below the range
    give 0, as libm's ``expf`` (without these selects the clamp made NaN and +inf finite: a
    NaN or an overflow in a softmax's row vanished from its result).
    """
    v = tirx.max(tirx.min(value, _EXP_MAX), _EXP_MIN)
    n = tirx.floor(v * _LOG2E + 0.5)
    r = v - n * _LN2_HI - n * _LN2_LO
    p = tirx.const(_EXP_POLY[0], "float32")
    for c in _EXP_POLY[1:]:
        p = p * r + c
    poly = (p * r + 0.5) * (r * r) + r + 1.0
    scale = (n.astype("int32") + 127) << 23
    result = poly * tirx.reinterpret("float32", scale)
    result = tirx.Select(value < _EXP_MIN, tirx.const(0.0, "float32"), result)
    result = tirx.Select(value > _EXP_OVERFLOW, tirx.const(float("inf"), "float32"), result)
    return tirx.Select(isnan(value), value, result)


def _erf(x):
    """TVM's ``fast_erf``, which clamps its input, with NaN kept NaN."""
    fast = topi.fast_erf(x)
    return te.compute(
        x.shape, lambda *i: tirx.Select(isnan(x(*i)), x(*i), fast(*i)), name="erf_fast"
    )


def _exp(x):
    """``exp(x)`` for fp32 ``x``, vectorisable (no libm call)."""
    return te.compute(x.shape, lambda *i: _exp_of(x(*i)), name="exp_fast", tag="elemwise")


def _softmax(x, axis, safe: bool = False):
    """``exp(x - max) / sum(exp(x - max))`` along ``axis`` with the vectorisable exp.

    Each reduction is split into a body whose length is a multiple of :data:`_CHUNK` and a
    tail, so the CPU row-reduction schedule can accumulate the body in SIMD registers. With
    ``safe``, a ``-inf`` element gives exactly 0 (the clamped exp gives 1e-38) and a row all
    ``-inf``, whose sum is then 0, gives zeros instead of NaN. (Its max cannot tell: ``te.max``
    starts from the lowest finite value, not ``-inf``.)
    """
    axis = axis % len(x.shape)
    peak = row_reduce(x, axis, te.max, tirx.max)

    def row(value, i):
        return value(*i[:axis], *i[axis + 1 :])

    zero = tirx.const(0, x.dtype)
    if safe:
        masked = tirx.const(float("-inf"), x.dtype)
        e = te.compute(
            x.shape,
            lambda *i: tirx.Select(x(*i) == masked, zero, _exp_of(x(*i) - row(peak, i))),
            name="exp_fast",
            tag="elemwise",
        )
    else:
        e = _exp(te.compute(x.shape, lambda *i: x(*i) - row(peak, i)))
    total = row_reduce(e, axis, te.sum, tirx.Add)
    if safe:
        return te.compute(
            x.shape, lambda *i: tirx.Select(row(total, i) == zero, zero, e(*i) / row(total, i))
        )
    return te.compute(x.shape, lambda *i: e(*i) / row(total, i))


def _log_softmax(x, axis):
    """``x - max - log(sum(exp(x - max)))`` along ``axis`` with the vectorisable exp (TVM's
    calls libm's ``expf`` per element: 12x the softmax's time); one ``log`` per row."""
    axis = axis % len(x.shape)
    peak = row_reduce(x, axis, te.max, tirx.max)

    def row(value, i):
        return value(*i[:axis], *i[axis + 1 :])

    shifted = te.compute(x.shape, lambda *i: x(*i) - row(peak, i), name="shifted")
    total = row_reduce(_exp(shifted), axis, te.sum, tirx.Add)
    log_total = te.compute(total.shape, lambda *i: tirx.log(total(*i)), name="log_total")
    return te.compute(x.shape, lambda *i: shifted(*i) - row(log_total, i), name="log_softmax")


def _safe_softmax(x, axis):
    """:func:`_softmax` that gives zeros for a row of ``-inf`` (see :func:`safe_softmax_of`)."""
    return _softmax(x, axis, safe=True)


# A row reduction's body is a multiple of 16 elements: one AVX-512 register of fp32.
_CHUNK = 16


def row_reduce(x, axis: int, reduce, combine):
    """``reduce`` over ``axis`` (dropped): a body of whole chunks, then the tail.

    A symbolic axis (a dynamic sequence length) is split the same way, unless it is provably
    whole chunks: its body, ``n // 16 * 16``, is provably whole vectors for the row-reduction
    schedule. At run time either part may then be empty, and an empty reduction is never
    initialised (its initial value is written in its first iteration), so the result selects
    the other part alone: without that, a length of 16, 32 or 128 read the tail's
    uninitialised maximum, and MPT's output was garbage.
    """
    n = x.shape[axis]
    shape = [d for i, d in enumerate(x.shape) if i != axis]
    if isinstance(n, tirx.IntImm):
        n = int(n)
        body = n - n % _CHUNK
        split = 0 < body < n
    else:
        body = n // _CHUNK * _CHUNK
        split = needs_padding(n, _CHUNK)
    parts = []
    for start, size in ((0, body), (body, n - body)) if split else ((0, n),):
        parts.append(te.compute(shape, _reducer(x, axis, reduce, start, te.reduce_axis((0, size)))))
    if len(parts) == 1:
        return parts[0]
    if isinstance(n, int):
        return te.compute(shape, lambda *i: combine(parts[0](*i), parts[1](*i)))

    def either(*i):
        both = combine(parts[0](*i), parts[1](*i))
        return tirx.Select(body == 0, parts[1](*i), tirx.Select(body == n, parts[0](*i), both))

    return te.compute(shape, either)


def _reducer(x, axis: int, reduce, start: int, k):
    """The fcompute of ``reduce`` over ``x[..., start + k, ...]`` (``k`` along ``axis``)."""
    return lambda *i: reduce(x(*i[:axis], start + k, *i[axis:]), axis=k)


def _sigmoid(x):
    """``1 / (1 + exp(-x))`` with the vectorisable exp (whose input is clamped: no overflow)."""
    return 1.0 / (1.0 + _exp(-x))


def _silu(x):
    """``x * sigmoid(x)`` with the fast exp."""
    return x * _sigmoid(x)


# relax op name -> (fp32 fast TE function, attribute names passed as extra arguments)
FAST = {
    "relax.exp": (_exp, ()),
    "relax.erf": (_erf, ()),
    "relax.tanh": (topi.fast_tanh, ()),
    "relax.nn.gelu": (_gelu, ()),
    "relax.nn.gelu_tanh": (_gelu_tanh, ()),
    "relax.nn.softmax": (_softmax, ("axis",)),
    "relax.nn.log_softmax": (_log_softmax, ("axis",)),
    "relax.sigmoid": (_sigmoid, ()),
    "relax.nn.silu": (_silu, ()),
}


def _op(expr, bindings: dict, name: str) -> relax.Call | None:
    """The call of op ``name`` that ``expr`` (a variable, through ``bindings``) is, or None."""
    return call_of(bindings.get(expr, expr), tvm.ir.Op.get(name))


def _is_zero(expr, bindings: dict) -> bool:
    """Whether ``expr`` is a constant 0, ``zeros[_like]`` or ``full[_like]`` of 0."""
    expr = bindings.get(expr, expr)
    name = getattr(expr.op, "name", None) if isinstance(expr, relax.Call) else None
    if name in ("relax.zeros", "relax.zeros_like"):
        return True
    if name in ("relax.full", "relax.full_like"):
        expr = expr.args[1]
    if isinstance(expr, tvm.ir.expr.Constant):
        value = expr.value.numpy()
        return value.size == 1 and float(value.reshape(())) == 0.0
    return False


def safe_softmax_of(call: relax.Call, bindings: dict) -> tuple[relax.Expr, int, str] | None:
    """``(x, axis, dtype)`` when ``call`` is torch's safe softmax (its probabilities cast to
    ``dtype``, as mixed precision may do between the softmax and the ``where``), else None.

    PyTorch's attention exports ``where(all(x == -inf, axis), 0, softmax(x, axis))`` with the
    ``all`` spelled ``not(max(int8(not(x == -inf)), axis, keepdims))``. Left alone, the ``all``
    is a second kernel that reads the scores again (0.4 ms of a 15 ms transformer layer on
    Emerald Rapids); in the softmax kernel a row is all ``-inf`` exactly when its sum is 0.
    """
    if getattr(call.op, "name", None) != "relax.where" or not _is_zero(call.args[1], bindings):
        return None
    probs, dtype = call.args[2], _dtype(call)
    cast = _op(probs, bindings, "relax.astype")
    if cast is not None:
        probs = cast.args[0]
    softmax = _op(probs, bindings, "relax.nn.softmax")
    flag = _op(call.args[0], bindings, "relax.logical_not")
    if softmax is None or flag is None or softmax.ty.shape is None:
        return None
    if not tvm_ffi.structural_equal(call.ty.shape, softmax.ty.shape):
        return None  # the zeros broadcast the result to a larger shape
    x, rank = softmax.args[0], len(softmax.ty.shape)
    axis = int(softmax.attrs.axis) % rank
    chain = flag.args[0]
    for name in ("relax.astype", "relax.max", "relax.astype", "relax.logical_not", "relax.equal"):
        step = _op(chain, bindings, name)
        if step is None:
            return None
        if name == "relax.max":
            axes = step.attrs.axis
            if not step.attrs.keepdims or axes is None or [int(a) % rank for a in axes] != [axis]:
                return None
        chain = step.args[0] if name != "relax.equal" else step
    if not chain.args[0].same_as(x) or scalar_constant(chain.args[1]) != float("-inf"):
        return None
    return x, axis, dtype


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod: tvm.IRModule, dtypes: tuple[str, ...]):
        super().__init__(mod)
        self.dtypes = dtypes
        self.bindings: dict = {}  # the original function's variable -> value
        self.safe_softmaxes = 0

    def visit_call_(self, call: relax.Call) -> relax.Expr:
        safe = safe_softmax_of(call, self.bindings)
        if safe is not None and _dtype(safe[0]) in self.dtypes:
            x, axis, dtype = safe
            self.safe_softmaxes += 1
            out = self._along_last(_safe_softmax, self.visit_expr(x), axis, "softmax_fast")
            return out if dtype == _dtype(x) else relax.op.astype(out, dtype)
        call = super().visit_call_(call)
        name = getattr(call.op, "name", None)
        if not call.args or _dtype(call.args[0]) not in self.dtypes:
            return call
        if name == "relax.power":
            return _small_power(call)
        if name not in FAST:
            return call
        fast, attrs = FAST[name]
        hint = name.split(".")[-1] + "_fast"
        if name in ("relax.nn.softmax", "relax.nn.log_softmax"):
            return self._along_last(fast, call.args[0], int(call.attrs.axis), hint)
        extra = [int(getattr(call.attrs, a)) for a in attrs]
        return self.builder_.call_te(_widened(fast), call.args[0], *extra, primfunc_name_hint=hint)

    def _along_last(self, fast, x: relax.Expr, axis: int, hint: str) -> relax.Expr:
        """``fast(x, axis)`` (a softmax) as a kernel over ``x``'s last axis. Another axis is
        moved last and back by transposes: the row-reduction schedule vectorises a reduction
        along the last axis only, and a softmax along another one recomputed its max and sum
        for every element (CoaT's softmax over 1025 tokens of 8 channels: 164 ms, 0.1 ms
        transposed; a log-softmax 1.2 s)."""
        rank = x.ty.ndim
        axis = axis % rank
        if axis == rank - 1:
            return self.builder_.call_te(
                _widened(fast),
                x,
                axis,
                primfunc_name_hint=hint,
                primfunc_attrs=_softmax_attrs(x, axis) if fast is not _log_softmax else None,
            )
        order = [a for a in range(rank) if a != axis] + [axis]
        moved = self.builder_.emit(relax.op.permute_dims(x, order))
        out = self.builder_.emit(self._along_last(fast, moved, rank - 1, hint))
        return relax.op.permute_dims(out, [order.index(a) for a in range(rank)])


# ``power(x, n)`` with these constant exponents becomes ``n - 1`` multiplies: TVM lowers power
# to a scalar ``powf`` call per element (GPT-2's tanh GELU, ``x ** 3``: 8.6 ns per element).
SMALL_POWERS = (2, 3, 4)
# Quarter powers ``x ** (k / 4)`` up to this magnitude become multiplies of ``x``, ``sqrt(x)`` and
# ``sqrt(sqrt(x))`` (a reciprocal for negative ones): AlexNet's local response normalisation
# divides by ``(k + a * mean(x^2)) ** 0.75``, 3% of the memory peak with ``powf``.
MAX_QUARTER_POWER = 4.0


def _small_power(call: relax.Call) -> relax.Expr:
    """Multiplies for ``power(x, n)`` with a scalar constant ``n``: ``n`` in SMALL_POWERS, or a
    quarter power (``0.75``, ``-0.5``, ``1.25``) built from square roots (each correctly rounded,
    the result within a few ulp of ``powf``; NaN for a negative ``x``, as ``powf``)."""
    base, exponent = call.args
    value = scalar_constant(exponent)
    if value is None or _dtype(exponent) != _dtype(base):
        return call
    if value in SMALL_POWERS:
        out = base
        for _ in range(int(value) - 1):
            out = relax.op.multiply(out, base)
        return out
    quarters = value * 4
    if quarters != int(quarters) or value == 0 or abs(value) > MAX_QUARTER_POWER:
        return call
    return _quarter_power(base, int(quarters))


def _quarter_power(base: relax.Expr, quarters: int) -> relax.Expr:
    """``base ** (quarters / 4)`` as products of ``base``, ``sqrt(base)``, ``sqrt(sqrt(base))``."""
    whole, rest = divmod(abs(quarters), 4)
    factors = [base] * whole
    if rest:
        root = relax.op.sqrt(base)
        if rest in (1, 3):
            factors.append(relax.op.sqrt(root))
        if rest in (2, 3):
            factors.append(root)
    out = factors[0]
    for factor in factors[1:]:
        out = relax.op.multiply(out, factor)
    if quarters < 0:
        out = relax.op.divide(relax.const(1.0, _dtype(base)), out)
    return out


def _softmax_attrs(x: relax.Expr, axis: int) -> dict | None:
    """The kernel attributes of a softmax of ``x`` along ``axis``: :data:`.gemm_softmax.ROW_SOFTMAX`
    for the last axis (a kernel :class:`.gemm_softmax.FuseGemmSoftmax` may merge)."""
    ty = x.ty
    rank = len(ty.shape) if isinstance(ty, relax.TensorType) and ty.shape is not None else None
    return {ROW_SOFTMAX: True} if rank and axis % rank == rank - 1 else None


def _dtype(expr: relax.Expr) -> str | None:
    ty = expr.ty
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else None


@tvm.transform.module_pass(opt_level=0, name="tvmamp.FastMath")
class FastMath:
    """Rewrite exp, erf, tanh, sigmoid, silu, gelu, gelu_tanh, softmax (with PyTorch's safe
    softmax, which zeroes rows of ``-inf``, as one kernel) and log-softmax on ``dtypes`` to fp32
    kernels built on TVM's fast (polynomial, vectorisable) exp, erf and tanh (a softmax over
    an axis other than the last between transposes that make it the last),
    ``power(x, 2 | 3 | 4)`` to multiplies, and quarter powers (``x ** 0.75``) to square roots
    and multiplies.

    Parameters
    ----------
    dtypes : tuple of str
        The input dtypes whose ops are rewritten, from float32, float16 and bfloat16. With
        float32, an fp32 build also loses its scalar libm calls (``expf``, ``tanhf``, ``erff``:
        3-9 ns per element against 0.5 for a vector polynomial); the approximations are within
        a few fp32 ulps (``tests/relay_passes/test_fast_math.py`` bounds them).
    """

    def __init__(self, dtypes: tuple[str, ...] = ("float32", *LOW_DTYPES)):
        bad = [d for d in dtypes if d not in ("float32", *LOW_DTYPES)]
        if bad:
            raise ValueError(
                f"tvmamp.FastMath: dtypes {bad} are not among float32, float16, bfloat16"
            )
        self.dtypes = tuple(dtypes)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        """Rewrite the calls of every Relax function of ``mod``."""
        rewriter = _Rewriter(mod, self.dtypes)
        for gvar, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.bindings = bound_values(func)
                rewriter.builder_.update_func(gvar, rewriter.visit_expr(func))
        mod = rewriter.builder_.get()
        if rewriter.safe_softmaxes:  # each left its separate softmax and all(-inf) check unused
            mod = relax.transform.DeadCodeElimination()(mod)
        return mod


def LowPrecisionFastMath() -> FastMath:  # noqa: N802 (kept as the pass's former class name)
    """:class:`FastMath` on fp16/bf16 only: fp32 ops keep TVM's exact (libm) functions."""
    return FastMath(LOW_DTYPES)


__all__ = ["FAST", "FastMath", "LowPrecisionFastMath"]
