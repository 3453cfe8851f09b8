"""AutoMixedPrecision: rewrite a Relax module so each op computes in the dtype a Policy picks.

How it works, binding by binding (one pass, in program order):

- Each float input of an op has a *nominal* dtype: the dtype the value was computed in. A white
  op that ran low but accumulated in fp32 (``out_dtype``) produces an fp32 tensor whose nominal
  dtype is low; consumers that want fp32 take it as it is, consumers that want low cast it once.
- The policy maps (op, nominal input dtypes) to a compute dtype; per-node patterns and the
  constant-overflow guard may override it.
- At O2 a comparison that reads a computed fp32 value compares it in fp32 (reason
  ``"comparison"``): rounding first can flip its bool result.
- At O2 a follow op whose result only feeds fp32 computations (black ops, fp32 casts, or
  follow ops of the same kind), or those and white ops, and that reads a non-constant fp32
  value (an fp32 input, or a white op's fp32 accumulator) runs in fp32: rounding it to low
  would be undone at once, and costs two casts instead of none or one (a white reader casts
  its input to low either way). This keeps residual streams fp32 up to the layer
  norms that read them, as MindSpore's O2 (fp32 LayerNorm/BatchNorm) and torch autocast (type
  promotion) do. A backward pass over each function finds these results
  (:func:`_feeds_fp32_only`) before the rewrite.
- At O2 (with ``keep_io_types``) a concatenation that extends an fp32 input of the function and
  is returned, as a decoder's key-value cache (``present = concat(past, new)``), runs in fp32,
  and so do its views (slices, squeezes, reshapes, permutations) up to their first other
  consumer, which casts what it reads (reason ``"fp32_cache"``; :func:`_extended_inputs`).
  Rounded to low, the caller's cache was narrowed and widened back on every step, and the
  whole of it cast once more for the attention's slices.
- Inputs are cast lazily, each value at most once per dtype and block, and a value made by one
  of our casts is never cast back: the original is used instead, so no f32->low->f32 round trip.
- Values that do not depend on the function's inputs (constants, shapes, generators such as
  ``arange``/``zeros``/``eye``, and everything computed from them only) keep the dtypes they were
  written in, at every level: FoldConstant folds them when their shape is static, and they are
  position and index arithmetic (RoPE angles, interpolation coordinates, masks) that bf16, which
  holds integers exactly only up to 256, would ruin. A consumer that mixes them with an
  activation converts them like constants: they do not decide its dtype, but at O1 (see below).
- Index values: a float computed by ``astype`` from an integer or bool tensor (positions from
  ``cumsum(mask) - 1``, counts, ``(ids > 0).float()``), and what an op computes from such values
  and input-free ones only, keep their written dtypes too (reason ``"index_values"``) until they
  meet an activation; that op follows the policy as for any fp32 activation. Of the white ops
  only those that do not accumulate join in (``outer``, ``prelu``, a ``matmul`` contracting a
  dimension of 1, as in ``inv_freq @ position_ids.float()``): a convolution of an image cast
  from uint8, or a GEMM of integer features, is the model's own compute and runs low.
- Quantization parameters: the scales and zero points of ``quantize``/``dequantize``, and the
  values a model computes only to make them (ONNX DynamicQuantizeLinear's ``min``/``max``,
  ``(max - min) / 255`` and rounded zero point; the scales that dequantize MatMulInteger), are
  computed as written, fp32, at every level (reason ``"quant_params"``;
  :func:`~.amp_quant_params.quantization_params`), as Paddle and MindSpore keep quantization
  fp32: in bf16 the scale moved a tenth of the quantized values by a step. At O2 a quantize's
  data operand, and an input of those ops, is an fp32 use for :func:`_feeds_fp32_only`.
- At O1 (and auto) an fp32 tensor constant or input-free tensor (a bound parameter, a
  position table) is an fp32 input of a follow op, as a parameter is in Paddle's O1 and in torch
  autocast's type promotion: ``h * w + b`` of MobileBERT's NoNorm runs in fp32. A scalar (rank 0:
  a Python number in those frameworks) converts for free and does not decide, at every level.
- Constants (bound params included) are converted at compile time. The overflow guard follows
  each constant through ops that only move, repeat or select its values (permute_dims, reshape,
  broadcast_to, take, strided_slice, float casts, ...): an op that would take such a value in a
  low dtype that cannot hold it computes in fp32 instead, and the report says why.
- Ops with fixed dtypes (``call_tir``, packed calls, builtins, other functions) get their inputs
  in the dtypes they were written for. User ``astype`` calls that became no-ops are dropped.
- Function results, and the branches of ``relax.If``, are cast back to their original dtypes
  (``keep_io_types=True``). With ``keep_io_types=False`` the public functions take and return
  the low dtype; private functions always keep their signatures.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax
from tvm.ir.expr import Constant
from tvm.relax import PyExprMutator

from tvmamp.op_lists import ORDER_STATISTICS, QUANTIZATION
from tvmamp.policy import Category, Policy
from tvmamp.tensors import FLOAT_DTYPES, np_dtype, static_shape, tensor_dtype

from . import low_reductions
from .amp_quant_params import quantization_params
from .amp_report import AmpReport, ForcedNode, NodeDecision
from .bindings import bound_values

_CAST_OPS = ("relax.astype", "relax.wrap_param")
# Ops that make a tensor from attributes and shapes only: their values do not depend on the
# function's inputs (with a static shape FoldConstant computes them at compile time).
_GENERATOR_OPS = (
    "relax.arange",
    "relax.zeros",
    "relax.ones",
    "relax.eye",
    "relax.hamming_window",
    "relax.shape_to_tensor",
)
# White ops that do not accumulate (an outer product, an elementwise scale): when they compute
# on index values only they keep their dtypes as follow ops do; other white ops run low.
_NON_ACCUMULATING_WHITE = ("relax.outer", "relax.nn.prelu")
# Ops that only move data: converting their constant input gives exactly the converted output.
_MOVEMENT_OPS = (
    "relax.permute_dims",
    "relax.reshape",
    "relax.expand_dims",
    "relax.squeeze",
    "relax.flatten",
    "relax.broadcast_to",
)
# Ops whose output holds only values of their first input (moved, repeated or selected), so the
# overflow guard bounds the output by the largest value of a constant first input. For the
# selecting ops (take, slices, split) that bound may be above the values actually selected.
_VALUE_PRESERVING_OPS = (
    *_MOVEMENT_OPS,
    "relax.flip",
    "relax.repeat",
    "relax.tile",
    "relax.take",
    "relax.strided_slice",
    "relax.dynamic_strided_slice",
    "relax.split",
)
# Ops whose output may hold the values of any float input (where's branches, a fill value) or
# values of about their size (adding a finite tensor to a huge mask constant): an overflowing
# constant taints their output, so its consumers stay fp32 too. This is what keeps attention
# masks built as where(mask, 0, finfo(float32).min) from turning into -inf (NaN rows) at O2.
_VALUE_PASSING_OPS = (
    "relax.where",
    "relax.full",
    "relax.full_like",
    "relax.add",
    "relax.subtract",
    "relax.maximum",
    "relax.minimum",
    "relax.negative",
)


def _float32_to(ty, dtype: str):
    """``ty`` with every float32 tensor made ``dtype`` (the result type of a low-I/O function)."""
    if isinstance(ty, relax.TensorType) and str(ty.dtype) == "float32":
        shape = ty.shape if isinstance(ty.shape, relax.ShapeExpr) else None
        return relax.TensorType(shape, dtype, ty.vdevice, ndim=-1 if shape else ty.ndim)
    if isinstance(ty, relax.TupleType):
        return relax.TupleType([_float32_to(f, dtype) for f in ty.fields])
    return ty


def _is_public(func: relax.Function) -> bool:
    return func.attrs is not None and "global_symbol" in func.attrs


@tvm.transform.module_pass(opt_level=0, name="AutoMixedPrecision")
class AutoMixedPrecision:
    """Convert a Relax module to mixed precision.

    Parameters
    ----------
    policy : tvmamp.Policy
        The level, low dtype and op categories.
    keep_io_types : bool
        Keep the inputs and outputs of public functions in their original dtypes.
    constant_names : dict, optional
        Constant -> parameter name, for constants bound from named params, so that
        ``custom_fp32_nodes``/``custom_low_nodes`` can match parameter names.

    After the pass has run, ``self.report`` (an :class:`AmpReport`) says what it did.
    """

    def __init__(self, policy: Policy, keep_io_types: bool = True, constant_names=None):
        if not isinstance(policy, Policy):
            raise TypeError(f"AutoMixedPrecision: policy must be a tvmamp.Policy, got {policy!r}")
        self.policy = policy
        self.keep_io_types = keep_io_types
        self.constant_names = dict(constant_names or {})
        self.report = AmpReport(level=policy.level, low_dtype=policy.low_dtype)

    def transform_module(self, mod: tvm.IRModule, _ctx: tvm.transform.PassContext):
        if self.policy.level == "O0" and not _low_unsupported_calls(mod, self.policy):
            return mod  # O0 changes only a low model's ops that TVM cannot run low
        low_io = {
            gv: not self.keep_io_types and _is_public(func)
            for gv, func in mod.functions_items()
            if isinstance(func, relax.Function)
        }
        rewriter = _Rewriter(mod, self.policy, self.report, self.constant_names, low_io)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                new_func = rewriter.rewrite(func, low_io[gv], gv.name_hint)
                rewriter.builder_.update_func(gv, new_func)
        # bindings the rewrite left unused (an fp32 value whose only consumers now take a
        # converted copy) are dropped, so later phases see only what runs
        # CanonicalizeBindings turns a dataflow block's results that only the result casts read
        # into dataflow vars
        mod = relax.transform.DeadCodeElimination()(rewriter.builder_.get())
        return relax.transform.CanonicalizeBindings()(mod)


@relax.expr_functor.mutator
class _Rewriter(PyExprMutator):
    """The binding-by-binding rewrite described in the module docstring."""

    def __init__(self, mod, policy, report, constant_names, low_io):
        super().__init__(mod)
        self.policy = policy
        self.report = report
        self.constant_names = constant_names
        self.low_io = low_io
        self.mod = mod
        self._nominal = {}  # var -> nominal dtype, where it differs from the var's own dtype
        self._cast_source = {}  # var made by one of our casts -> the value it was cast from
        self._casts = [{}]  # one cache per binding block: (value, dtype) -> cast var
        self._constants = {}  # (constant, dtype) -> converted constant
        self._param_names = {}  # param var -> name
        # vars that do not depend on the inputs: computed from constants, shapes and generators
        # (arange, zeros, ...) only; FoldConstant folds those with a static shape
        self._from_constants = set()
        self._generated = set()  # the input-free vars that a generator op (arange, ...) made
        self._index_values = set()  # floats cast from integer tensors, and what only they make
        self._moved_constants = {}  # var -> data-movement call on a constant that produced it
        self._sources = {}  # var -> (constant, op names) when it holds only that constant's values
        self._peaks = {}  # constant -> largest finite magnitude in it
        self._low_params = False
        self._quant_params = set()  # vars computed only to become quantization parameters
        self._fp32_only = set()  # vars whose every use computes in fp32 (O2 analysis)
        self._fp32_or_result = set()  # the same, counting the function's (fp32) results too
        self._decisions = set()  # vars read only on the way to an order statistic (a router)
        self._caches = set()  # returned extensions of an fp32 input, and their views (O2)
        self._func_name = "main"
        self._seen_names = {}  # name -> count, to make node ids unique as the printer does
        self._unique_name = ""

    # ---- functions, blocks and bindings -------------------------------------------------
    def rewrite(self, func: relax.Function, low_io: bool, name: str = "main") -> relax.Function:
        """Rewrite one function; restore its result dtypes unless ``low_io``."""
        self._low_params = low_io
        self._func_name = name
        self._quant_params = quant = quantization_params(func)
        self._fp32_only = _feeds_fp32_only(func, self.policy, quant_params=quant)
        # with keep_io_types the results are cast back to fp32: a use like an fp32 op's
        self._fp32_or_result = (
            set() if low_io else _feeds_fp32_only(func, self.policy, True, quant_params=quant)
        )
        self._decisions = _feeds_decisions_only(func, self.policy)
        self._caches = set() if low_io else _extended_inputs(func, self.policy)
        self._seen_names = {}
        for param in func.params:  # the TVMScript printer numbers names after the parameters
            self._make_unique(param.name)
        self._param_names.update({p: p.name for p in func.params})
        new = self.visit_expr(func)
        ret_ty = _float32_to(func.ret_ty, self.policy.low_dtype) if low_io else func.ret_ty
        body = self._restore(new.body, ret_ty)
        if body.same_as(new.body):
            return new
        return relax.Function(new.params, body, ret_ty, new.is_pure, new.attrs, new.span)

    def visit_var_def_(self, var):
        if self._low_params and var in self._param_names and tensor_dtype(var) == "float32":
            low = relax.Var(var.name, relax.TensorType(var.ty.shape, self.policy.low_dtype))
            self._param_names[low] = var.name
            return low
        return super().visit_var_def_(var)

    def visit_binding_block_(self, block):
        self._casts.append({})
        try:
            return super().visit_binding_block_(block)
        finally:
            self._casts.pop()

    def visit_dataflow_block_(self, block):
        self._casts.append({})
        try:
            return super().visit_dataflow_block_(block)
        finally:
            self._casts.pop()

    def visit_match_cast_(self, binding):
        value = binding.value
        if isinstance(value, relax.Call):
            # a match_cast of a call, not of a variable (the ONNX importer checks a concat's
            # size at run time so): the call is converted as the value of a binding of its
            # own. Visited as a plain expression, a concat of a low and an fp32 input failed
            # ("Concat expects all input tensors to have the same dtype", optimum's ViT at O2).
            kind = relax.DataflowVar if isinstance(binding.var, relax.DataflowVar) else relax.Var
            temp = kind(f"{binding.var.name}_value", value.ty)
            self.visit_var_binding_(relax.VarBinding(temp, value))
            value = self.visit_expr(temp)
        else:
            value = self.visit_expr(value)
        declared = binding.ty
        if isinstance(declared, relax.TensorType) and str(declared.dtype) in FLOAT_DTYPES:
            value = self._to_dtype(value, str(declared.dtype))
        self.builder_.emit_normalized(relax.MatchCast(binding.var, value, declared))

    def _make_unique(self, name):
        seen = self._seen_names.get(name, 0)
        self._seen_names[name] = seen + 1
        return name if seen == 0 else f"{name}_{seen}"

    def visit_var_binding_(self, binding):
        self._unique_name = self._make_unique(binding.var.name)
        value, nominal, index = binding.value, None, False
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
            if value.op.name in _CAST_OPS:
                value = self._rewrite_cast(value)
                index = self._is_index_cast(value)
            else:
                value, nominal, index = self._rewrite_op_call(binding.var, value)
        elif isinstance(value, relax.Call):
            value = self._rewrite_function_call(value)
        elif isinstance(value, relax.If):
            value = self._rewrite_if(value, binding.var.ty)
        else:
            value = self.visit_expr(value)
        self._bind(binding.var, value, nominal, index)

    def _bind(self, var, value, nominal, index=False):
        if isinstance(value, relax.Var) and (
            isinstance(var, relax.DataflowVar) or not isinstance(value, relax.DataflowVar)
        ):
            self.set_var_remap(var, value)  # an alias (e.g. a dropped cast): no binding needed
            return
        value = self.builder_.normalize(value)
        new_var = self.with_type(var, value.ty)
        self.set_var_remap(var, new_var)
        self.builder_.emit_normalized(relax.VarBinding(new_var, value))
        if nominal is not None and nominal != tensor_dtype(new_var):
            self._nominal[new_var] = nominal
        source = self._source_of_value(value)
        if source is not None:
            self._sources[new_var] = source
        if isinstance(value, relax.Call) and self._input_free(value):
            self._from_constants.add(new_var)
            if self._generator_call(value):
                self._generated.add(new_var)
            op = value.op
            if isinstance(op, tvm.ir.Op) and op.name in _MOVEMENT_OPS:
                if isinstance(value.args[0], Constant):
                    self._moved_constants[new_var] = value
        elif index:
            self._index_values.add(new_var)
        elif isinstance(value, (relax.Var, relax.TupleGetItem)):
            # an output alias, or a part of split(positions): what its source is. A part of a
            # split of constants only is not followed (the overflow guard reports the ops that
            # read it at run time).
            whole = value.tuple_value if isinstance(value, relax.TupleGetItem) else value
            if whole in self._generated or (
                isinstance(value, relax.Var) and whole in self._from_constants
            ):
                self._from_constants.add(new_var)
                if whole in self._generated:
                    self._generated.add(new_var)
            elif whole in self._index_values:
                self._index_values.add(new_var)

    def _input_free(self, call):
        """Whether ``call`` computes only from constants, shapes and generated tensors."""
        if self._all_constant(call.args):
            return True
        return (
            isinstance(call.op, tvm.ir.Op)
            and call.op.name in _GENERATOR_OPS
            and not self._tensor_leaves(call.args)
        )

    def _generator_call(self, call):
        """Whether an input-free ``call`` is a generator op or reads a generated value."""
        if isinstance(call.op, tvm.ir.Op) and call.op.name in _GENERATOR_OPS:
            return True
        return any(a in self._generated for a in self._tensor_leaves(call.args))

    def _is_constant(self, expr):
        """A constant, or a value that does not depend on the inputs (see ``_input_free``)."""
        return isinstance(expr, Constant) or expr in self._from_constants

    @staticmethod
    def _tensor_leaves(args):
        leaves = []
        for arg in args:
            leaves.extend(arg.fields if isinstance(arg, relax.Tuple) else [arg])
        return [a for a in leaves if isinstance(a.ty, (relax.TensorType, relax.TupleType))]

    def _all_constant(self, args):
        tensors = self._tensor_leaves(args)
        return bool(tensors) and all(self._is_constant(a) for a in tensors)

    def _is_index_cast(self, value):
        """Whether a rewritten cast makes an index value: a float cast of an integer tensor.

        A cast of an input-free tensor is input-free instead (``_bind`` checks that first).
        """
        if not isinstance(value, relax.Call) or value.op.name != "relax.astype":
            return False
        if str(value.attrs.dtype) not in FLOAT_DTYPES:
            return False
        source = value.args[0]
        source_dtype = tensor_dtype(source)
        if source_dtype is None:
            return False
        return source_dtype not in FLOAT_DTYPES or source in self._index_values

    def _computes_on_index_values(self, op_name, args):
        """Whether an op computes on index values and input-free values only.

        Every float tensor among its inputs is one of them, and at least one is an index value
        (integer and bool inputs, such as the indices of a take, do not count). White ops join in
        only when they do not accumulate: see the module docstring.
        """
        floats = self._float_inputs(args)
        if not any(e in self._index_values for e in floats):
            return False
        if not all(e in self._index_values or self._is_constant(e) for e in floats):
            return False
        if self.policy.category(op_name) is not Category.WHITE:
            return True
        if op_name in _NON_ACCUMULATING_WHITE:
            return True
        if op_name == "relax.matmul":  # a contraction of length 1 is an outer product
            shape = static_shape(args[0].ty)
            return shape is not None and len(shape) > 0 and shape[-1] == 1
        return False

    # ---- op calls ------------------------------------------------------------------------
    def _rewrite_op_call(self, var, call):
        """The rewritten call, its nominal dtype (or None) and whether it makes index values."""
        op_name = call.op.name
        args = [self.visit_expr(a) for a in call.args]
        if self._all_constant(args):
            # Input-free (FoldConstant computes it at compile time when its shape is static):
            # keep the original dtypes (exact), and let each consumer take the dtype it needs.
            return self._as_written(call, args), None, False
        inputs = self._float_inputs(args)
        dtype = self.policy.compute_dtype(op_name, self._decision_dtypes(inputs))
        if dtype is None:  # fixed dtypes: give the op what it was written for
            return self._as_written(call, args), None, False
        node_id = f"{self._func_name}/{self._unique_name}"
        reason = "policy"
        index = self._computes_on_index_values(op_name, args)
        if index or var in self._quant_params:
            # positions, counts, quantization scales and zero points: computed as written, in
            # fp32 unless the model said else
            written = [tensor_dtype(e) for e in self._float_inputs(call.args)]
            dtype = "float32" if "float32" in written else written[0]
            reason = "index_values" if index else "quant_params"
        elif self._compares_fp32(op_name, inputs, dtype):
            dtype, reason = "float32", "comparison"
        elif self._undone_at_once(var, op_name, inputs, dtype):
            dtype, reason = "float32", "feeds_fp32"
        elif dtype != "float32" and var in self._caches:
            dtype, reason = "float32", "fp32_cache"
        elif dtype != "float32" and var in self._decisions and _few_columns(var):
            dtype, reason = "float32", "decision"
        dtype, reason = self._override(var, node_id, op_name, inputs, dtype, reason)
        category = self.policy.category(op_name).value
        self.report.nodes.append(NodeDecision(node_id, op_name, dtype, category, reason))
        self.report.count_op(op_name, dtype)
        if reason in ("index_values", "quant_params"):
            return self._as_written(call, args), None, reason == "index_values"
        new_args = [self._map_float(a, lambda e, _cur: self._to_dtype(e, dtype)) for a in args]
        attrs, nominal = call.attrs, None
        if dtype != "float32" and _accumulates(op_name, attrs):
            attrs = _replace_attr(attrs, out_dtype=self.policy.accumulate_dtype)
            nominal = dtype
        elif dtype != "float32" and op_name in _SUMMING_REDUCTIONS and new_args:
            # read low, add up in the accumulate dtype (the cast fuses into the reduction)
            acc = self.builder_.emit(relax.op.astype(new_args[0], self.policy.accumulate_dtype))
            new_args[0], nominal = acc, dtype
        return relax.Call(call.op, new_args, attrs, call.ty_args, call.span), nominal, False

    def _as_written(self, call, args):
        """``call`` with its float inputs in the dtypes the program gave them."""
        new_args = [self._match_type(a, old.ty) for a, old in zip(args, call.args)]
        return relax.Call(call.op, new_args, call.attrs, call.ty_args, call.span)

    def _undone_at_once(self, var, op_name, inputs, dtype):
        """O2: a low follow op whose result only feeds fp32 ops and that reads an fp32 value.

        A white op's fp32 accumulator counts: the op reads it unrounded, and no cast is needed.
        A result of the function (cast back to fp32 under ``keep_io_types``) counts as such a
        use when every input was computed in fp32 (:meth:`_computed_in_fp32`): ``mean(x * x) -
        mean(x) ** 2`` at the end of a model was rounded to bf16 before the subtraction (error
        1.85), while a GEMM's logits plus a bias, or an op on the inputs, still run low.
        """
        # the sets are empty unless the policy is O2 with fp32_feeds on
        if dtype == "float32" or self.policy.category(op_name) is not Category.FOLLOW:
            return False
        live = [e for e in inputs if not self._is_constant(e)]
        if var in self._fp32_only:
            return any(tensor_dtype(e) == "float32" for e in live)
        if var in self._fp32_or_result:
            return bool(live) and all(self._computed_in_fp32(e) for e in live)
        return False

    def _compares_fp32(self, op_name, inputs, dtype) -> bool:
        """O2: a comparison that reads a computed fp32 value (an fp32 activation or input, or a
        white op's fp32 accumulator) compares it in fp32.

        Rounding first can flip the result: ``x > 0.5`` is false for an fp32 ``x = 0.50001``
        rounded to bf16, and sdpa's ``scores == -inf`` is true for a finite score below the bf16
        range. The result is bool, so running low saves no bytes either. Off where the target
        turns off fp32 feeds (an fp16-only NPU).
        """
        if dtype == "float32" or op_name not in _COMPARISONS:
            return False
        if self.policy.level != "O2" or not self.policy.fp32_feeds:
            return False
        live = [e for e in inputs if not self._is_constant(e)]
        return any(tensor_dtype(e) == "float32" for e in live)

    def _computed_in_fp32(self, expr) -> bool:
        """An fp32 value an op of the function computed in fp32: not a parameter, a low op's
        accumulator, an index value or an input-free value."""
        return (
            tensor_dtype(expr) == "float32"
            and expr not in self._nominal
            and expr not in self._param_names
            and expr not in self._index_values
            and expr not in self._generated
        )

    def _override(self, var, node_id, op_name, inputs, dtype, reason="policy"):
        """Apply per-node rules and the overflow guard; returns (dtype, reason)."""
        names = [var.name] + [self._name_of(e) for e in inputs]
        forced = self.policy.node_override(names, node_id)
        if forced is not None and forced != dtype:
            if node_id in self.policy.node_dtypes:
                reason = "node_dtypes"
            else:
                reason = "custom_fp32_nodes" if forced == "float32" else "custom_low_nodes"
            self.report.forced.append(ForcedNode(var.name, op_name, forced, reason))
            dtype = forced
        if dtype != "float32" and op_name in self.policy.unsupported:
            why = f"no {dtype} kernel for {op_name} on this target"
            self.report.forced.append(ForcedNode(var.name, op_name, "float32", why))
            dtype, reason = "float32", "unsupported"
        overflowing = [] if dtype == "float32" else self._overflowing_sources(inputs, dtype)
        if overflowing:
            why = f"a constant input exceeds the {dtype} range: " + "; ".join(
                self._describe(const, ops) for const, ops in overflowing
            )
            self.report.forced.append(ForcedNode(var.name, op_name, "float32", why))
            dtype, reason = "float32", "overflow"
        return dtype, reason

    def _rewrite_cast(self, call):
        src = self.visit_expr(call.args[0])
        target = str(call.attrs.dtype)
        origin = self._cast_source.get(src)
        if tensor_dtype(src) == target:
            self.report.casts_removed += 1
            return src
        if origin is not None and tensor_dtype(origin) == target:
            return origin
        return relax.Call(call.op, [src], call.attrs, call.ty_args, call.span)

    def _rewrite_function_call(self, call):
        callee = call.op
        args = [self.visit_expr(a) for a in call.args]
        if isinstance(callee, relax.GlobalVar) and self.low_io.get(callee):
            args = [self._map_float(a, self._low_if_fp32) for a in args]
        else:
            args = [self._match_type(a, old.ty) for a, old in zip(args, call.args)]
        return relax.Call(self.visit_expr(callee), args, call.attrs, call.ty_args, call.span)

    def _rewrite_if(self, node, ty):
        cond = self.visit_expr(node.cond)
        true_branch = self._restore(self.visit_with_new_scope(node.true_branch), ty)
        false_branch = self._restore(self.visit_with_new_scope(node.false_branch), ty)
        return relax.If(cond, true_branch, false_branch, node.span)

    # ---- values and casts ----------------------------------------------------------------
    def _nominal_dtype(self, expr):
        return self._nominal.get(expr) or tensor_dtype(expr)

    def _decision_dtypes(self, inputs):
        """Nominal dtypes that decide follow/promote ops. Constants convert for free and do not
        decide, except at O1 (and auto): there an fp32 tensor constant or input-free tensor (a
        parameter, a position table) is an fp32 input, as a parameter is in Paddle's O1 and
        torch autocast's type promotion; a scalar (rank 0, a number in those) is not."""
        promote = self.policy.level in ("O1", "auto")
        values = [
            e for e in inputs if not self._is_constant(e) or (promote and _rank(e) != 0)
        ] or inputs
        return [self._nominal_dtype(e) for e in values]

    def _name_of(self, expr):
        if isinstance(expr, Constant):
            return self.constant_names.get(expr)
        return self._param_names.get(expr)

    def _float_inputs(self, args):
        found = []
        for arg in args:
            self._map_float(arg, lambda e, _d: found.append(e) or e)
        return found

    def _map_float(self, expr, fn):
        """Apply ``fn(value, dtype)`` to every float tensor inside ``expr`` (tuples included)."""
        ty = expr.ty
        if isinstance(ty, relax.TensorType):
            dtype = str(ty.dtype)
            return fn(expr, dtype) if dtype in FLOAT_DTYPES else expr
        if isinstance(ty, relax.TupleType):
            fields = self._tuple_fields(expr)
            new = [self._map_float(f, fn) for f in fields]
            if all(a.same_as(b) for a, b in zip(new, fields)):
                return expr
            return relax.Tuple(new)
        return expr

    def _tuple_fields(self, expr):
        if isinstance(expr, relax.Tuple):
            return list(expr.fields)
        n = len(expr.ty.fields)
        return [self.builder_.normalize(relax.TupleGetItem(expr, i)) for i in range(n)]

    def _match_type(self, expr, old_ty):
        """Cast the float tensors in ``expr`` to the dtypes of ``old_ty``."""
        if isinstance(old_ty, relax.TensorType):
            dtype = str(old_ty.dtype)
            return self._to_dtype(expr, dtype) if dtype in FLOAT_DTYPES else expr
        if isinstance(old_ty, relax.TupleType) and isinstance(expr.ty, relax.TupleType):
            fields = self._tuple_fields(expr)
            new = [self._match_type(f, t) for f, t in zip(fields, old_ty.fields)]
            if all(a.same_as(b) for a, b in zip(new, fields)):
                return expr
            return relax.Tuple(new)
        return expr

    def _low_if_fp32(self, expr, dtype):
        return self._to_dtype(expr, self.policy.low_dtype) if dtype == "float32" else expr

    def _to_dtype(self, expr, dtype):
        current = tensor_dtype(expr)
        if current is None or current == dtype or current not in FLOAT_DTYPES:
            return expr
        if isinstance(expr, Constant):
            return self._convert_constant(expr, dtype)
        origin = self._cast_source.get(expr)
        if origin is not None and tensor_dtype(origin) == dtype:
            return origin
        if isinstance(expr, relax.TupleGetItem):
            expr = self.builder_.emit(expr)
        cache = self._casts[-1]
        if (expr, dtype) not in cache and expr in self._moved_constants:
            # permute_dims(W) -> permute_dims(W converted): exact, and the pattern stays visible
            call = self._moved_constants[expr]
            args = [self._convert_constant(call.args[0], dtype), *call.args[1:]]
            moved = self.builder_.emit(relax.Call(call.op, args, call.attrs, call.ty_args))
            self._from_constants.add(moved)
            cache[(expr, dtype)] = moved
        if (expr, dtype) not in cache:
            cast = self.builder_.emit(relax.op.astype(expr, dtype))
            self._cast_source[cast] = expr
            cache[(expr, dtype)] = cast
            if expr in self._from_constants:
                self._from_constants.add(cast)
            if expr in self._generated:
                self._generated.add(cast)
            if expr in self._from_constants and static_shape(expr.ty) is not None:
                self.report.constants_converted += 1  # folded at compile time by FoldConstant
            else:
                self.report.casts_inserted += 1
        return cache[(expr, dtype)]

    def _convert_constant(self, const, dtype):
        key = (const, dtype)
        if key not in self._constants:
            data = const.value.numpy().astype(np_dtype(dtype))
            self._constants[key] = relax.const(data, dtype)
            if dtype != "float32":
                self.report.constants_converted += 1
            if const in self.constant_names:
                self.constant_names[self._constants[key]] = self.constant_names[const]
        return self._constants[key]

    # ---- the overflow guard --------------------------------------------------------------
    def _source(self, expr):
        """``(constant, op names)`` when ``expr`` holds only values of one float constant."""
        if isinstance(expr, Constant):
            return (expr, ()) if tensor_dtype(expr) in FLOAT_DTYPES else None
        if expr in self._cast_source:  # one of our casts: the values are those of its input
            return self._source(self._cast_source[expr])
        return self._sources.get(expr)

    def _source_of_value(self, value):
        """The constant source of a bound value that moves, selects or casts a constant."""
        if isinstance(value, Constant):  # lv = R.const(...): the var holds the constant
            return self._source(value)
        if isinstance(value, relax.TupleGetItem):  # a part of split(constant)
            return self._source(value.tuple_value)
        if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
            return None
        name = value.op.name
        if name in _VALUE_PASSING_OPS:
            sources = [s for s in map(self._source, value.args) if s is not None]
            if not sources:
                return None
            const, ops = max(sources, key=lambda s: self._peak(s[0]))
            return const, (*ops, name)
        if (name not in _VALUE_PRESERVING_OPS and name not in _CAST_OPS) or not value.args:
            return None
        source = self._source(value.args[0])
        if source is None:
            return None
        if name in _CAST_OPS:
            # a cast that itself overflows made the values inf: nothing left to guard
            cast_to = str(value.attrs.dtype)
            if cast_to not in FLOAT_DTYPES or self._overflows(source, cast_to):
                return None
        return source[0], (*source[1], name)

    def _overflowing_sources(self, inputs, dtype):
        sources = dict.fromkeys(self._source(e) for e in inputs)  # unique, in input order
        return [s for s in sources if s is not None and self._overflows(s, dtype)]

    def _peak(self, const):
        """Largest finite magnitude in a constant (0.0 when it has none)."""
        if const not in self._peaks:
            data = np.abs(const.value.numpy().astype(np.float32, copy=False))
            self._peaks[const] = float(np.max(data, where=np.isfinite(data), initial=0.0))
        return self._peaks[const]

    def _overflows(self, source, dtype):
        """Whether converting the values of ``source`` to ``dtype`` would give an inf."""
        const, _ops = source
        if dtype == "float32" or tensor_dtype(const) == dtype:
            return False
        with np.errstate(over="ignore"):
            return bool(np.isinf(np.float32(self._peak(const)).astype(np_dtype(dtype))))

    def _describe(self, const, ops):
        name = self.constant_names.get(const, "a constant")
        path = f" through {' -> '.join(ops)}" if ops else ""
        return f"{name}{path} (max |value| {self._peak(const):.4g})"

    def _restore(self, seq, ty):
        """Append casts to ``seq`` so its result has the dtypes of ``ty``."""
        bindings = []
        body = self._restore_value(seq.body, ty, bindings)
        if not bindings:
            return seq
        blocks = list(seq.blocks)
        if blocks and isinstance(blocks[-1], relax.DataflowBlock):
            # in the dataflow block the casts fuse with the kernels before them, and what they
            # read stops being a result (a reshape before them becomes a view; see transform_module)
            blocks[-1] = relax.DataflowBlock(list(blocks[-1].bindings) + bindings)
        else:
            blocks.append(relax.BindingBlock(bindings))
        return self.builder_.normalize(relax.SeqExpr(blocks, body))

    def _restore_value(self, expr, ty, bindings):
        if isinstance(ty, relax.TensorType):
            dtype = str(ty.dtype)
            if dtype not in FLOAT_DTYPES or tensor_dtype(expr) in (None, dtype):
                return expr
            value = self.builder_.normalize(relax.op.astype(expr, dtype))
            return self._append(bindings, "out", value, count=True)
        if isinstance(ty, relax.TupleType) and _dtypes_differ(expr.ty, ty):
            if isinstance(expr, relax.Tuple):
                fields = list(expr.fields)
            else:
                fields = [
                    self._append(
                        bindings, "item", self.builder_.normalize(relax.TupleGetItem(expr, i))
                    )
                    for i in range(len(ty.fields))
                ]
            new = [self._restore_value(f, t, bindings) for f, t in zip(fields, ty.fields)]
            if isinstance(expr, relax.Tuple) and all(a.same_as(b) for a, b in zip(new, fields)):
                return expr
            return self.builder_.normalize(relax.Tuple(new))
        return expr

    def _append(self, bindings, name, value, count=False):
        var = relax.Var(name, value.ty)
        bindings.append(relax.VarBinding(var, value))
        if count:
            self.report.casts_inserted += 1
        return var


def _low_unsupported_calls(mod: tvm.IRModule, policy: Policy) -> bool:
    """Whether ``mod`` calls an op of ``policy.unsupported`` on a ``policy.low_dtype`` tensor
    (a bf16 model's sort or argmax: TVM fails to compile them, or crashes, in bf16)."""
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op):
            if expr.op.name in policy.unsupported and any(
                tensor_dtype(a) == policy.low_dtype for a in expr.args
            ):
                found.append(expr)

    for _, func in mod.functions_items():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return bool(found)


_TUPLE_FIELD = object()  # a use as a field of a tuple binding (in _feeds_fp32_only)
# Ops that read floats and give booleans: they compute nothing a low input would speed up, so
# for _feeds_fp32_only they are fp32 uses (sdpa's "all scores -inf" check beside its softmax).
_COMPARISONS = frozenset(
    f"relax.{name}"
    for name in "equal not_equal less less_equal greater greater_equal isnan isinf isfinite".split()
)


def _feeds_fp32_only(
    func: relax.Function, policy: Policy, results: bool = False, quant_params=frozenset()
) -> set:
    """Vars of ``func`` whose every use computes in fp32 whatever the dtype of the var.

    A use counts when it is a direct argument of an op that computes in fp32 even from low
    inputs (the black list, ops the target cannot run low), of a comparison, of a promote-list
    op (which computes in fp32 when the var is fp32), of ``astype(..., "float32")``, of a
    follow op whose own result is in the set, or, for a var written in fp32, of a quantize or
    dequantize or an op of ``quant_params`` (they compute as written: the tensor a
    DynamicQuantizeLinear quantizes and measures is not rounded to bf16 first). A use by a
    white op that runs low is neutral: it reads a low copy whatever the var's dtype, so a var
    whose other uses all count is in the set too (DebertaV2 multiplies its embedding LayerNorm
    by the mask, and the product feeds both the Q/K/V GEMMs and the fp32 residual stream; run
    low, it rounded that stream to bf16: 20x torch autocast's error). A var read only by white
    ops is not in the set. Function
    results do not count: the cast back to the caller's dtype is I/O, not a computation (and a
    GEMM that wrote fp32 logits instead of bf16 ones would be slower), unless ``results``: then
    a use as the function's result counts too (see :meth:`_undone_at_once` for when it
    decides). Any other use (tuples, other functions, nested blocks) keeps the var out of the
    set.
    """
    if policy.level != "O2" or not policy.fp32_feeds or not isinstance(func.body, relax.SeqExpr):
        return set()
    bindings = [b for block in func.body.blocks for b in block.bindings]
    uses = _uses(func, bindings)
    low = policy.low_dtype

    # with ``results``, a follow consumer counts only when it is fp32 without them: the rule
    # for results decides from the op's own inputs, so it does not carry over to producers
    strict = _feeds_fp32_only(func, policy, quant_params=quant_params) if results else None

    def fp32_use(var, use, found) -> bool | None:
        """True: the use computes in fp32; None: a low white op; False: any other use."""
        value, consumer = use
        if results and value is None and consumer is None:
            return True  # the function's result, cast back to fp32
        if isinstance(value, relax.Var):  # an alias binding: its own uses decide
            return consumer in found
        if value is _TUPLE_FIELD:
            return results and consumer in found
        if strict is not None:
            found = strict
        if not isinstance(value, relax.Call):
            return False
        name = value.op.name
        if name in _CAST_OPS:
            return name == "relax.astype" and str(value.attrs.dtype) == "float32"
        if name in QUANTIZATION or consumer in quant_params:
            return tensor_dtype(var) == "float32"  # it reads the var as written
        if policy.compute_dtype(name, [low]) == "float32" or name in _COMPARISONS:
            return True
        if policy.category(name) is Category.PROMOTE:
            # it computes in fp32 when any input is fp32: kept fp32, this var makes it so (two
            # grid_samples of one fp32 grid read it rounded to bf16, 1.4 px off at 512 px)
            return True
        if policy.category(name) is Category.WHITE:
            return None
        return policy.category(name) is Category.FOLLOW and consumer in found

    found = set()
    for binding in reversed(bindings):
        kinds = [fp32_use(binding.var, u, found) for u in uses.get(binding.var, [])]
        if True in kinds and False not in kinds:
            found.add(binding.var)
    return found


# Ops that join tensors along an axis: a key-value cache is extended by one of them.
_JOINS = ("relax.concat", "relax.stack")
# Ops that give a view of their first input's values (kept fp32 with an fp32 cache).
_VIEWS = (
    "relax.permute_dims",
    "relax.reshape",
    "relax.expand_dims",
    "relax.squeeze",
    "relax.flatten",
    "relax.strided_slice",
    "relax.split",
)


def _extended_inputs(func: relax.Function, policy: Policy) -> set:
    """O2: the joins that extend an fp32 input of ``func`` and are returned, and their views.

    A decoder exported with an fp32 key-value cache (onnxruntime's GPT-2 form, optimum's
    ``past_key_values``) returns ``present = concat(past, new)`` and reads its keys and values
    through slices. Run low, the concatenation rounded the caller's fp32 cache to low, and the
    function widened the result back to return it: a GPT-2-sized decoder over 2048 cached
    positions spent 4.1 of its 10.4 ms a step on the two. In fp32 the cache is copied once, the
    value returned is the caller's exactly, and the attention reads low copies of its slices,
    each cast where it is read (the same values as before: rounding commutes with a view).

    A join is in the set when one of its inputs is an fp32 parameter of ``func`` that is not a
    weight (one of its first ``num_input`` parameters, where the function says) and its result
    reaches the function's result through views only (reshapes, slices, ...). Its views are in
    the set too, up to their first consumer of another kind. Empty but at O2 with fp32 feeds.
    """
    if policy.level != "O2" or not policy.fp32_feeds or not isinstance(func.body, relax.SeqExpr):
        return set()
    count = func.attrs.get("num_input") if func.attrs is not None else None
    inputs = func.params if count is None else func.params[: int(count)]
    fp32_inputs = {p for p in inputs if tensor_dtype(p) == "float32"}
    if not fp32_inputs:
        return set()
    values = bound_values(func)

    def is_view(value) -> bool:
        return (
            isinstance(value, relax.Call)
            and isinstance(value.op, tvm.ir.Op)
            and value.op.name in _VIEWS
            and isinstance(value.args[0], relax.Var)
        )

    # vars the function returns, and what they view (walking back through views and tuples)
    returned, stack = set(), list(relax.analysis.free_vars(func.body.body))
    while stack:
        var = stack.pop()
        if var in returned:
            continue
        returned.add(var)
        value = values.get(var)
        if isinstance(value, relax.Tuple):
            stack.extend(f for f in value.fields if isinstance(f, relax.Var))
        elif is_view(value) or isinstance(value, relax.Var):
            stack.append(value.args[0] if is_view(value) else value)

    found = set()
    for var, value in values.items():
        if var not in returned or not isinstance(value, relax.Call):
            continue
        if not isinstance(value.op, tvm.ir.Op) or value.op.name not in _JOINS:
            continue
        joined = value.args[0]
        fields = joined.fields if isinstance(joined, relax.Tuple) else []
        if any(f in fp32_inputs for f in fields):
            found.add(var)
    # the views of what was found, in program order
    for var, value in values.items():
        if is_view(value) and value.args[0] in found:
            found.add(var)
    return found


def _uses(func: relax.Function, bindings: list) -> dict:
    """Var -> list of ``(how, consumer)`` for each read of it in ``func``: ``how`` is the
    consuming op call when the var is one of its arguments, the var itself for an alias
    binding, :data:`_TUPLE_FIELD` for a field of a tuple of vars, else None (the function's
    result, or any other use); ``consumer`` is the binding var (None for the result)."""
    uses = {}
    for binding in bindings:
        value = binding.value
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
            for arg in value.args:
                if isinstance(arg, relax.Var):
                    uses.setdefault(arg, []).append((value, binding.var))
                else:
                    for free in relax.analysis.free_vars(arg):
                        uses.setdefault(free, []).append((None, binding.var))
        elif isinstance(value, relax.Var):
            uses.setdefault(value, []).append((value, binding.var))  # an alias
        elif isinstance(value, relax.Tuple) and all(isinstance(f, relax.Var) for f in value.fields):
            for field in value.fields:  # a tuple of results: its own uses decide (``results``)
                uses.setdefault(field, []).append((_TUPLE_FIELD, binding.var))
        else:
            for free in relax.analysis.free_vars(value):
                uses.setdefault(free, []).append((None, binding.var))
    for free in relax.analysis.free_vars(func.body.body):
        uses.setdefault(free, []).append((None, None))
    return uses


# Most columns of a choosing GEMM run in fp32 (:func:`_feeds_decisions_only`): a router's
# experts (8 to 256), not a language model head's vocabulary, whose argmax stays low.
DECISION_MAX_COLUMNS = 1024


def _few_columns(var) -> bool:
    """Whether ``var`` is a tensor of at most :data:`DECISION_MAX_COLUMNS` static columns."""
    ty = var.ty
    if not isinstance(ty, relax.TensorType) or ty.shape is None or ty.ndim < 1:
        return False
    columns = list(ty.shape)[-1]
    return isinstance(columns, tvm.tirx.IntImm) and int(columns) <= DECISION_MAX_COLUMNS


def _feeds_decisions_only(func: relax.Function, policy: Policy) -> set:
    """White-op results of ``func`` that only choose: every use leads, through float ops that
    are not white (softmax, a bias, a cast), to an order statistic (topk, argmax, sort).

    A mixture-of-experts router is such a GEMM: its logits pick each token's experts with a
    topk. Rounded to the low dtype, near-equal logits swap places and a token goes to another
    expert (a tiny Mixtral at O1: one token of 128 rerouted, its output 36x torch autocast's
    error). Such a GEMM is small (hidden x experts), so O1 and O2 run it in fp32, where it has
    at most :data:`DECISION_MAX_COLUMNS` columns, and the choices follow the fp32 scores. A
    result that is also used otherwise (returned logits beside their argmax) is not in the
    set. Empty at O0 and O3.
    """
    if policy.level not in ("O1", "O2") or not isinstance(func.body, relax.SeqExpr):
        return set()
    bindings = [b for block in func.body.blocks for b in block.bindings]
    uses = _uses(func, bindings)

    def decides(use, found) -> bool:
        how, consumer = use
        if not isinstance(how, relax.Call):  # not an op's argument: a result, an alias, ...
            return False
        name = how.op.name
        if name in ORDER_STATISTICS:
            return True
        if name in _CAST_OPS or policy.category(name) is not Category.WHITE:
            return consumer in found
        return False

    found = set()
    for binding in reversed(bindings):
        reads = uses.get(binding.var, [])
        if reads and all(decides(u, found) for u in reads):
            found.add(binding.var)
    return found


def _dtypes_differ(have, want) -> bool:
    """Whether two (tuple) types differ in the dtype of some float tensor."""
    if isinstance(want, relax.TensorType) and isinstance(have, relax.TensorType):
        return str(want.dtype) in FLOAT_DTYPES and str(have.dtype) != str(want.dtype)
    if isinstance(want, relax.TupleType) and isinstance(have, relax.TupleType):
        return any(_dtypes_differ(h, w) for h, w in zip(have.fields, want.fields))
    return False


# Reductions that add up many values and have no ``out_dtype``: run low (O3, or white-listed),
# they read the low input but add up in the accumulate dtype. In bf16 a running sum stops
# growing at 256 times the step it adds (O3 ``x.sum(-1)`` of 4096 values near 0.8 gave 1024,
# not 3284); frameworks' low reductions also keep an fp32 accumulator.
_SUMMING_REDUCTIONS = frozenset(
    "relax." + name for name in (*low_reductions.REDUCTIONS, "cumsum", "cumprod")
)

# Ops with an ``out_dtype`` that is not an accumulator: TVM's legalization of resize ignores
# it, so a float32 ``out_dtype`` would annotate a result that is computed, and returned, low.
_OUT_DTYPE_NOT_ACCUMULATOR = ("relax.image.resize2d", "relax.image.resize3d")


def _accumulates(op_name: str, attrs) -> bool:
    """Whether the op accumulates in its ``out_dtype`` (matmul, convs), which the low ops of
    the pass set to the accumulate dtype."""
    return op_name not in _OUT_DTYPE_NOT_ACCUMULATOR and _has_field(attrs, "out_dtype")


def _has_field(attrs, name: str) -> bool:
    if attrs is None:
        return False
    fields = type(attrs).__tvm_ffi_type_info__.fields
    return any(f.name == name for f in fields)


def _replace_attr(attrs, **changes):
    """A copy of an op's attrs with some fields replaced."""
    info = type(attrs).__tvm_ffi_type_info__
    values = {f.name: getattr(attrs, f.name) for f in info.fields}
    values.update(changes)
    return tvm.ir.make_node(info.type_key, **values)


def _rank(expr) -> int | None:
    """The rank of a tensor value (None: unknown)."""
    ty = expr.ty
    return ty.ndim if isinstance(ty, relax.TensorType) and ty.ndim >= 0 else None
