"""The reference NPU codegen: partitioned Relax functions -> C++ calling the NPU runtime library."""

from __future__ import annotations

import functools
import math
import pathlib

import tvm
from tvm import relax

from tvmamp.tensors import tensor_dtype

from .checks import shape_of
from .patterns import SPECS

RUNTIME_DIR = pathlib.Path(__file__).parent / "runtime"
C_TYPES = {"float16": "tvmamp_npu::half", "float32": "float"}
ACTS = {None: "kNone", "relax.nn.relu": "kRelu", "relax.nn.gelu": "kGelu"}

PRELUDE = """\
#include <tvm/ffi/c_api.h>

#include <cstring>
#include <exception>
#include <vector>
"""

# The glue speaks tvm-ffi's C ABI directly (c_api.h only), which compiles in a fraction of the
# time the C++ headers behind TVM_FFI_DLL_EXPORT_TYPED_FUNC take; the exported symbol is the same.
GLUE = """\
namespace {
DLTensor* Arg(const TVMFFIAny* args, int i) {
  if (args[i].type_index == kTVMFFIDLTensorPtr) return static_cast<DLTensor*>(args[i].v_ptr);
  if (args[i].type_index == kTVMFFITensor) return TVMFFITensorGetDLTensorPtr(args[i].v_obj);
  return nullptr;
}

bool Compact(const DLTensor* t) {
  if (t->strides == nullptr) return true;
  for (int64_t d = t->ndim - 1, expect = 1; d >= 0; expect *= t->shape[d], --d) {
    if (t->shape[d] != 1 && t->strides[d] != expect) return false;
  }
  return true;
}

int Fail(const char* symbol, const char* message) {
  const char* parts[] = {symbol, ": ", message};
  TVMFFIErrorSetRaisedFromCStrParts("ValueError", parts, 3);
  return -1;
}

template <typename T>
T* Data(DLTensor* t) {
  return reinterpret_cast<T*>(static_cast<char*>(t->data) + t->byte_offset);
}
}  // namespace
"""

ENTRY = """\
extern "C" TVM_FFI_DLL_EXPORT int __tvm_ffi_{symbol}(void*, const TVMFFIAny* args, int32_t num_args,
                                                  TVMFFIAny* result) {{
  if (num_args != {num_args}) return Fail("{symbol}", "wrong number of arguments");
  DLTensor* t[{num_args}];
  for (int i = 0; i < {num_args}; ++i) {{
    t[i] = Arg(args, i);
    if (t[i] == nullptr) return Fail("{symbol}", "arguments must be tensors");
    if (!Compact(t[i])) return Fail("{symbol}", "tensors must be compact");
  }}
  try {{
    {symbol}_impl({arg_list});
  }} catch (const std::exception& err) {{
    return Fail("{symbol}", err.what());
  }}
  result->type_index = kTVMFFINone;
  result->zero_padding = 0;
  result->v_int64 = 0;
  return 0;
}}
"""


@functools.lru_cache(maxsize=1)
def runtime_source() -> str:
    """The NPU runtime library (header and kernels) as one translation-unit fragment."""
    header = (RUNTIME_DIR / "npu_runtime.h").read_text()
    body = (RUNTIME_DIR / "npu_runtime.cc").read_text().replace('#include "npu_runtime.h"\n', "")
    return header + "\n" + body


def _ints(values) -> str:
    return "{" + ", ".join(str(int(v)) for v in values) + "}"


class _Region:
    """Emits one exported C++ function for one partitioned Relax function."""

    def __init__(self, func: relax.Function, symbol: str):
        self.symbol = symbol
        self.lines: list[str] = []
        self.names: dict = {}  # relax var -> (C pointer expression, dtype)
        self.composites: dict = {}
        self.params = [f"DLTensor* in{i}" for i in range(len(func.params))]
        for i, param in enumerate(func.params):
            self.names[param] = (
                f"Data<{C_TYPES[tensor_dtype(param)]}>(in{i})",
                tensor_dtype(param),
            )
        body = func.body
        values = {b.var: b.value for block in body.blocks for b in block.bindings}
        results = body.body.fields if isinstance(body.body, relax.Tuple) else [body.body]
        outputs = [_resolve(var, values) for var in results]
        self.outputs = {}
        for i, var in enumerate(outputs):
            self.params.append(f"DLTensor* out{i}")
            if var not in self.names:  # computed here, not a parameter passed through
                self.outputs.setdefault(var, i)
        self.copies = [(i, var) for i, var in enumerate(outputs) if self.outputs.get(var) != i]
        for block in body.blocks:
            for binding in block.bindings:
                self._binding(binding.var, binding.value)

    def _binding(self, var, value):
        if isinstance(value, relax.Function):
            self.composites[var] = value
        elif isinstance(value, relax.Var):
            self.names[var] = self.names[value]
        elif isinstance(value, relax.Call) and value.op in self.composites:
            self._storage(var)
            args = [self.names[a][0] for a in value.args]
            self._composite(self.composites[value.op], args, self.names[var][0])
        else:
            raise ValueError(
                f"tvmamp.targets.npu codegen: unexpected binding {value} in {self.symbol}; only "
                "calls of composite functions can be offloaded"
            )

    def _storage(self, var):
        dtype = tensor_dtype(var)
        ctype = C_TYPES[dtype]
        if var in self.outputs:
            self.names[var] = (f"Data<{ctype}>(out{self.outputs[var]})", dtype)
            return
        name = f"t{len(self.names)}"
        self.lines.append(f"  std::vector<{ctype}> {name}({math.prod(shape_of(var))});")
        self.names[var] = (f"{name}.data()", dtype)

    def _composite(self, func: relax.Function, args: list[str], out: str):
        pattern = str(func.attrs["Composite"]).split(".", 1)[1]
        spec = SPECS[pattern]
        params = {p: a for p, a in zip(func.params, args)}
        values = {b.var: b.value for blk in func.body.blocks for b in blk.bindings}
        calls = {v.op.name: v for v in values.values() if isinstance(v, relax.Call)}
        core = calls[spec.core]
        emit = {"relax.matmul": _matmul, "relax.nn.conv2d": _conv2d}.get(spec.core, _simple)
        self.lines.append(emit(spec, core, calls, params, values, out, func))

    def source(self) -> str:
        copies = [
            f"  std::memcpy(Data<char>(out{i}), {self.names[var][0]}, "
            f"{math.prod(shape_of(var))} * sizeof(*{self.names[var][0]}));"
            for i, var in self.copies
        ]
        return "\n".join(
            [
                f"void {self.symbol}_impl({', '.join(self.params)}) {{",
                *self.lines,
                *copies,
                "}",
            ]
        )


def _resolve(var, values):
    """Follow ``a = b`` aliases to the var that holds the value."""
    while isinstance(values.get(var), relax.Var):
        var = values[var]
    return var


def _operand(expr, params, values):
    """The C pointer of a composite operand, looking through permute_dims and astype."""
    while expr not in params:
        expr = values[expr].args[0]
    return params[expr]


def _bias(spec, calls, params, values, core_var_names):
    if spec.bias_axis is None:
        return "nullptr"
    add = calls["relax.add"]
    other = [a for a in add.args if a not in core_var_names]
    return _operand(other[0], params, values)


def _chain_vars(values, core):
    """Vars bound to the core call and to casts of it (they are not the bias operand)."""
    names = {v for v, val in values.items() if val.same_as(core)}
    return names | {v for v, val in values.items() if getattr(val, "args", [None])[0] in names}


def _out_type(func) -> str:
    return C_TYPES[str(func.ret_ty.dtype)]


def _matmul(spec, core, calls, params, values, out, func) -> str:
    a, b = shape_of(core.args[0]), shape_of(core.args[1])
    lhs = _operand(core.args[0], params, values)
    rhs = _operand(core.args[1], params, values)
    bias = _bias(spec, calls, params, values, _chain_vars(values, core))
    batch = math.prod(a[:-2])
    return (
        f"  tvmamp_npu::Matmul<{_out_type(func)}>({lhs}, {rhs}, {bias}, {out}, {batch}, "
        f"{a[-2]}, {b[-1]}, {a[-1]}, {str(spec.dense).lower()}, {str(len(b) > 2).lower()}, "
        f"tvmamp_npu::Act::{ACTS[spec.act]});"
    )


def _conv2d(spec, core, calls, params, values, out, func) -> str:
    attrs = core.attrs
    data = _operand(core.args[0], params, values)
    weight = _operand(core.args[1], params, values)
    bias = _bias(spec, calls, params, values, _chain_vars(values, core))
    shapes = [_ints(shape_of(e)) for e in (core.args[0], core.args[1], core)]
    return (
        f"  {{ const int64_t ds[4] = {shapes[0]}, ws[4] = {shapes[1]}, os[4] = {shapes[2]}, "
        f"st[2] = {_ints(attrs.strides)}, pd[4] = {_ints(attrs.padding)};\n"
        f"    tvmamp_npu::Conv2d<{_out_type(func)}>({data}, {weight}, {bias}, {out}, ds, ws, os, "
        f"st, pd, tvmamp_npu::Act::{ACTS[spec.act]}); }}"
    )


def _simple(spec, core, calls, params, values, out, func) -> str:
    ins = [_operand(a, params, values) for a in core.args]
    if spec.core == "relax.nn.relu":
        return f"  tvmamp_npu::Relu({ins[0]}, {out}, {math.prod(shape_of(core))});"
    if spec.core == "relax.nn.max_pool2d":
        attrs = core.attrs
        return (
            f"  {{ const int64_t ds[4] = {_ints(shape_of(core.args[0]))}, "
            f"os[4] = {_ints(shape_of(core))}, pl[2] = {_ints(attrs.pool_size)}, "
            f"st[2] = {_ints(attrs.strides)}, pd[4] = {_ints(attrs.padding)};\n"
            f"    tvmamp_npu::MaxPool2d({ins[0]}, {out}, ds, os, pl, st, pd); }}"
        )
    out_shape = shape_of(core)
    rank = len(out_shape)
    aligned = [(1,) * (rank - len(shape_of(a))) + shape_of(a) for a in core.args]
    kind = "kAdd" if spec.core == "relax.add" else "kMultiply"
    return (
        f"  {{ const tvmamp_npu::BroadcastShape bs = {{{rank}, {_ints(out_shape)}, "
        f"{_ints(aligned[0])}, {_ints(aligned[1])}}};\n"
        f"    tvmamp_npu::BinaryOp(tvmamp_npu::Binary::{kind}, {ins[0]}, {ins[1]}, {out}, bs); }}"
    )


def generate_source(functions, header: str = "") -> tuple[str, list[str]]:
    """C++ for the partitioned functions, and the exported symbols."""
    regions = [_Region(f, str(f.attrs["global_symbol"])) for f in functions]
    exports = [
        ENTRY.format(
            symbol=r.symbol,
            num_args=len(r.params),
            arg_list=", ".join(f"t[{i}]" for i in range(len(r.params))),
        )
        for r in regions
    ]
    parts = [header, PRELUDE, runtime_source(), GLUE, "namespace {"]
    parts += [r.source() for r in regions] + ["}  // namespace", *exports, ""]
    return "\n".join(parts), [r.symbol for r in regions]


def make_codegen(name: str):
    """The ``relax.ext.<name>`` function: partitioned functions -> one C++ source module."""

    def codegen(functions, options, constant_names):
        code, symbols = generate_source(functions, f"// Generated by tvmamp for NPU {name}\n")
        create = tvm.get_global_func("runtime.CSourceModuleCreate")
        return [create(code, "cc", symbols, [])]

    return codegen
