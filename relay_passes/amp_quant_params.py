"""Quantization parameters: the values a Relax function computes only to scale and shift its
quantization, which the AMP pass computes as written (fp32) at every level.

ONNX's ``DynamicQuantizeLinear`` imports as ``max``/``min`` reductions of its input,
``(max - min) / 255``, and a zero point ``round(clip(-min / scale, 0, 255))`` cast to uint8,
then ``relax.quantize(x, scale, zero_point)``. Those are follow ops: O2 and O3 ran them in bf16,
so the scale came out up to 0.4 % off onnxruntime's and up to 72 of 512 quantized values (a
random 8 x 64 input) moved by a step. Paddle and MindSpore keep quantization ops fp32; here the
scale and zero-point operands of :data:`tvmamp.op_lists.QUANTIZATION` ops mark what must stay
as written, and :func:`quantization_params` follows them back to the ops that make them.
"""

from __future__ import annotations

import tvm
from tvm import relax

from tvmamp.op_lists import QUANTIZATION, WHITE
from tvmamp.tensors import FLOAT_DTYPES, tensor_dtype

_ARG, _PASS, _OTHER, _RESULT = "arg", "pass", "other", "result"


def quantization_params(func: relax.Function) -> set:
    """Vars of ``func`` computed only to become quantization parameters.

    A read of a var counts when it is a scale or zero-point operand of a ``QUANTIZATION`` op,
    the scale of a dequantizing multiply (its other operand is the float cast of an integer
    GEMM's or conv's result: ``Cast(MatMulInteger(...)) * (x_scale * w_scale)`` of onnxruntime's
    ``quantize_dynamic``), or an argument of an op (a cast included) whose own result is in the
    set. Being the function's result, directly or in a returned tuple, is neutral
    (``DynamicQuantizeLinear`` returns its scale and zero point). A float tensor joins when one
    read counts and every other read is neutral, so the tensor being quantized, which the
    ``min`` and ``max`` also read, stays out (it is the quantize's data operand), and the set
    never reaches the model's activations. An integer tensor (a zero point that integer
    arithmetic also reads) joins when one read counts: it has no float dtype to choose. Only
    the bindings of the function's own blocks are followed.
    """
    if not isinstance(func.body, relax.SeqExpr):
        return set()
    bindings = [b for block in func.body.blocks for b in block.bindings]
    reads = _reads(func, bindings)
    returned = {v for v, rs in reads.items() if all(r[0] == _RESULT for r in rs)}
    dequantizing = _integer_gemm_casts(bindings)

    def counts(read, found) -> bool | None:
        """True: the read makes a quantization parameter; None: neutral; False: other."""
        how, consumer, call, index = read
        if how == _RESULT or (how == _PASS and consumer in returned):
            return None
        if how != _ARG:
            return False
        if consumer in found or (call.op.name in QUANTIZATION and index > 0):
            return True
        if call.op.name == "relax.multiply" and len(call.args) == 2:
            return call.args[1 - index] in dequantizing
        return False

    found = set()
    for binding in reversed(bindings):
        dtype = tensor_dtype(binding.var)
        kinds = [counts(r, found) for r in reads.get(binding.var, [])]
        if dtype is None or True not in kinds:
            continue
        if dtype not in FLOAT_DTYPES or False not in kinds:
            found.add(binding.var)
    return found


def _reads(func: relax.Function, bindings: list) -> dict:
    """Var -> ``(how, consumer, call, index)`` for each read of it: ``_ARG`` as argument
    ``index`` of the op ``call`` bound to ``consumer``, ``_PASS`` as an alias or a field of a
    tuple of vars, ``_RESULT`` as the function's result, ``_OTHER`` for anything else."""
    reads = {}

    def add(var, *read):
        reads.setdefault(var, []).append(read)

    for binding in bindings:
        value, var = binding.value, binding.var
        if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
            for index, arg in enumerate(value.args):
                if isinstance(arg, relax.Var):
                    add(arg, _ARG, var, value, index)
                else:
                    for free in relax.analysis.free_vars(arg):
                        add(free, _OTHER, var, None, None)
        elif isinstance(value, relax.Var):
            add(value, _PASS, var, None, None)
        elif isinstance(value, relax.Tuple) and all(isinstance(f, relax.Var) for f in value.fields):
            for field in value.fields:
                add(field, _PASS, var, None, None)
        else:
            for free in relax.analysis.free_vars(value):
                add(free, _OTHER, var, None, None)
    for free in relax.analysis.free_vars(func.body.body):
        add(free, _RESULT, None, None, None)
    return reads


def _integer_gemm_casts(bindings: list) -> set:
    """Vars bound to a float cast of an integer result of a ``WHITE`` op (an int32 matmul or
    conv: MatMulInteger and ConvInteger as TVM imports them)."""
    integer_gemms, casts = set(), set()
    for binding in bindings:
        value = binding.value
        if not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op):
            continue
        dtype = tensor_dtype(binding.var)
        if value.op.name in WHITE and dtype is not None and dtype not in FLOAT_DTYPES:
            integer_gemms.add(binding.var)
        elif value.op.name == "relax.astype" and value.args[0] in integer_gemms:
            if dtype in FLOAT_DTYPES:
                casts.add(binding.var)
    return casts
