"""Tensor-type helpers shared by the passes, the executable and the trainer: dtypes and shapes."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import tvm
from tvm import relax

# The float dtypes the AMP pass converts between (fp32 and the two low dtypes).
FLOAT_DTYPES = ("float32", "float16", "bfloat16")


def np_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a TVM dtype name (bfloat16 and the float8 types via ml_dtypes)."""
    extra = getattr(ml_dtypes, dtype, None) if not hasattr(np, dtype) else None
    return np.dtype(extra if extra is not None else dtype)


def type_dtype(ty) -> str | None:
    """The dtype of a ``relax.TensorType``, or None for any other type."""
    return str(ty.dtype) if isinstance(ty, relax.TensorType) else None


def tensor_dtype(expr: relax.Expr) -> str | None:
    """The dtype of a tensor-typed expression, or None."""
    return type_dtype(getattr(expr, "ty", None))


def out_dtype(call: relax.Call, default: str) -> str:
    """The ``out_dtype`` attribute of a conv or matmul ``call``, or ``default`` when unset.

    An unset ``out_dtype`` is ``None`` (``str()`` of it is the truthy ``"None"``) or ``""``.
    """
    value = call.attrs.out_dtype
    text = "" if value is None else str(value)
    return text if text not in ("", "None", "void") else default


def dim_texts(shape) -> list[str]:
    """A shape's sizes as text: static ones as numbers, symbolic ones by name."""
    return [str(int(d)) if isinstance(d, tvm.tirx.IntImm) else str(d) for d in shape]


def static_shape(ty) -> tuple[int, ...] | None:
    """The shape of a ``relax.TensorType`` when every dimension is a constant, else None."""
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    dims = ty.shape.values
    if not all(isinstance(d, tvm.tirx.IntImm) for d in dims):
        return None
    return tuple(int(d) for d in dims)


def static_shape_but_batch(ty) -> tuple | None:
    """The shape of a ``relax.TensorType`` whose dimensions are constants (ints) but for the
    leading one, which may be symbolic (a PrimExpr: a dynamic batch); else None."""
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    dims = ty.shape.values
    if not dims or not all(isinstance(d, tvm.tirx.IntImm) for d in dims[1:]):
        return None
    first = int(dims[0]) if isinstance(dims[0], tvm.tirx.IntImm) else dims[0]
    return (first, *(int(d) for d in dims[1:]))


def int_or_expr(dim):
    """A dimension (an int, an IntImm or a PrimExpr) as an int where it is a constant, else
    the PrimExpr."""
    return int(dim) if isinstance(dim, tvm.tirx.IntImm) else dim


def shape_dims(ty) -> tuple | None:
    """The shape of a ``relax.TensorType`` as ints where its dimensions are constants and
    PrimExprs where they are symbolic; None where the shape is unknown."""
    if not isinstance(ty, relax.TensorType) or not isinstance(ty.shape, relax.ShapeExpr):
        return None
    return tuple(int_or_expr(d) for d in ty.shape.values)


def check_array(array, name: str, ty, component: str) -> np.ndarray:
    """``array`` as numpy, checked against the dtype and static shape of the type ``ty``.

    Parameters
    ----------
    array : array-like or tvm.runtime.Tensor
        The value given for a model input or parameter.
    name : str
        How the message names the value (the input's or parameter's name).
    ty : relax type
        The type declared for it; only a ``relax.TensorType`` is checked (dynamic dimensions
        match any size).
    component : str
        The component named in the message ("tvmamp", "tvmamp.training", ...).

    Raises
    ------
    TypeError
        The dtype differs from the declared one.
    ValueError
        A static dimension differs.
    """
    array = array.numpy() if isinstance(array, tvm.runtime.Tensor) else np.asarray(array)
    want = type_dtype(ty)
    if want is not None and array.dtype != np_dtype(want):
        raise TypeError(
            f"{component}: {name!r} has dtype {array.dtype}, but the model expects {want}"
        )
    shape = static_shape(ty)
    if shape is not None and tuple(array.shape) != shape:
        raise ValueError(
            f"{component}: {name!r} has shape {array.shape}, but the model expects {shape}"
        )
    return array
