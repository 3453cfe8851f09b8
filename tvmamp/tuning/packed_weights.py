"""Time kernels as builds run them: weight-packing blocks done beforehand, not in the timing."""

from __future__ import annotations

import tvm
from tvm import relax, s_tir, tirx
from tvm.s_tir.dlight.analysis import get_root_block
from tvm.s_tir.meta_schedule.arg_info import ArgInfo

# The block annotation meta_schedule's builder and runner strip (the weight is passed packed).
PREPROC = "meta_schedule.layout_rewrite_preproc"


def measured_args(mod: tvm.IRModule) -> list:
    """The arguments the kernel is timed with: its weights already packed (as at run time)."""
    return ArgInfo.from_entry_func(for_measuring(mod), remove_preproc=True)


def for_measuring(mod: tvm.IRModule) -> tvm.IRModule:
    """``mod`` with its padded weight packing split out, else ``mod`` itself.

    meta_schedule's builder and runner drop the weight-packing blocks and pass the packed
    weight instead, but TVM's RemoveWeightLayoutRewriteBlock only accepts a block that copies
    from bare iterators (it fails on the guarded copy that pads a ragged weight, and aborts on
    a packing that reads through layout ops, ``qkv[s, b, h * 64 + d]``: see
    :mod:`tvmamp.relay_passes.gemm_layout`). The build splits such blocks out with Relax's
    ``SplitLayoutRewritePreproc``, so the kernel is timed as the build runs it.
    """
    if not _has_unplain_preproc(mod):
        return mod
    func = mod["main"]
    *inputs, output = func.params
    bb = relax.BlockBuilder()
    args = [relax.Var(f"arg{i}", _tensor_type(b)) for i, b in enumerate(inputs)]
    with bb.function("main", args):
        kernel = bb.add_func(func.with_attr("global_symbol", "main"), "main_kernel")
        with bb.dataflow():
            out = bb.emit_output(relax.call_tir(kernel, args, _tensor_type(output)))
        bb.emit_func_output(out)
    split = relax.transform.SplitLayoutRewritePreproc()(bb.get())
    (name,) = [gv for gv, f in split.functions_items() if gv.name_hint.endswith("_prepacked")]
    return tvm.IRModule({"main": split[name].with_attr("global_symbol", "main")})


def _tensor_type(buffer) -> relax.TensorType:
    return relax.TensorType([int(x) for x in buffer.shape], str(buffer.dtype))


def _has_unplain_preproc(mod: tvm.IRModule) -> bool:
    """Whether a weight-packing block of ``mod`` is more than a copy from bare iterators."""
    sch = s_tir.Schedule(mod)
    for block_rv in sch.get_child_blocks(get_root_block(sch)):
        block = sch.get(block_rv)
        body = block.body
        plain = (
            isinstance(body, tirx.BufferStore)
            and isinstance(body.value, tvm.ir.expr.TensorLoad)
            and all(isinstance(i, tirx.Var) for i in body.value.indices)
        )
        if PREPROC in block.annotations and not plain:
            return True
    return False
