"""The CUDA tensor-core rule: which kernels it takes, and mma.sync in their PTX (no GPU needed)."""

import pytest
import tvm
from tvm import te, tirx
from tvm.s_tir import dlight as dl

from tvmamp.schedules.cuda import default_cuda_rules
from tvmamp.schedules.cuda.matmul import Config, CUDATensorCoreMatmul, config_for
from tvmamp.targets.ptx import kernel_reports

SM80 = tvm.target.Target({"kind": "cuda", "arch": "sm_80", "host": {"kind": "llvm"}})


def gemm(name, m, n, k, dtype, a_trans=False, b_trans=False, batch=None, out="float32"):
    """C = A @ B with A as [k, m] when a_trans, B as [n, k] when b_trans, fp32 accumulation."""
    lead = () if batch is None else (batch,)
    a = te.placeholder((*lead, k, m) if a_trans else (*lead, m, k), dtype, "A")
    b = te.placeholder((*lead, n, k) if b_trans else (*lead, k, n), dtype, "B")
    r = te.reduce_axis((0, k), "k")

    def body(*idx):
        *s, i, j = idx
        av = a[(*s, r, i)] if a_trans else a[(*s, i, r)]
        bv = b[(*s, j, r)] if b_trans else b[(*s, r, j)]
        return te.sum(av.astype(out) * bv.astype(out), axis=r)

    c = te.compute((*lead, m, n), body, "C")
    return te.create_prim_func([a, b, c]).with_attr("global_symbol", name)


def conv2d_nhwc(name, dtype, n=1, hw=16, c_in=16, c_out=32):
    """A 3x3 NHWC/OHWI conv2d with zero padding 1 and fp32 accumulation."""
    x = te.placeholder((n, hw, hw, c_in), dtype, "x")
    w = te.placeholder((c_out, 3, 3, c_in), dtype, "w")
    pad = te.compute(
        (n, hw + 2, hw + 2, c_in),
        lambda b, h, v, c: tirx.if_then_else(
            tirx.all(h >= 1, h <= hw, v >= 1, v <= hw), x[b, h - 1, v - 1, c], tirx.const(0, dtype)
        ),
        "pad",
    )
    rh, rw, rc = (te.reduce_axis((0, e), nm) for e, nm in ((3, "rh"), (3, "rw"), (c_in, "rc")))
    y = te.compute(
        (n, hw, hw, c_out),
        lambda b, h, v, o: te.sum(
            pad[b, h + rh, v + rw, rc].astype("float32") * w[o, rh, rw, rc].astype("float32"),
            axis=[rh, rw, rc],
        ),
        "conv",
    )
    return te.create_prim_func([x, w, y]).with_attr("global_symbol", name)


def relu():
    x = te.placeholder((64, 64), "float16", "x")
    y = te.compute((64, 64), lambda i, j: tirx.max(x[i, j], tirx.const(0, "float16")), "y")
    return te.create_prim_func([x, y])


CASES = {
    "matmul_nn": lambda dt: gemm("matmul_nn", 256, 128, 64, dt),
    "dense_nt": lambda dt: gemm("dense_nt", 64, 96, 128, dt, b_trans=True),
    "matmul_tn": lambda dt: gemm("matmul_tn", 64, 64, 64, dt, a_trans=True),
    "batch_matmul": lambda dt: gemm("batch_matmul", 16, 16, 16, dt, batch=8),
    "matmul_odd": lambda dt: gemm("matmul_odd", 100, 70, 30, dt),
    "conv2d_nhwc": lambda dt: conv2d_nhwc("conv2d_nhwc", dt),
}


def schedule(func, target=SM80, rules=None):
    mod = tvm.IRModule({func.attrs["global_symbol"]: func})
    with target:
        return dl.ApplyDefaultSchedule(*(rules or default_cuda_rules(target)))(mod)


@pytest.mark.parametrize(
    "extents,want",
    [
        ((4096, 4096, 4096), Config(2, 2, 4, 4, 2)),
        ((None, None, None), Config(2, 2, 4, 4, 2)),
        ((16, 16, 16), Config(1, 1, 1, 1, 1)),
        ((32, 64, 64), Config(2, 2, 1, 2, 2)),
        ((100, 70, 30), Config(2, 2, 4, 2, 2)),
    ],
)
def test_config_fits_the_problem(extents, want):
    assert config_for(*extents) == want


@pytest.mark.parametrize(
    "func",
    [
        gemm("f32", 64, 64, 64, "float32"),  # fp32 inputs: not for tensor cores here
        gemm("f16_acc", 64, 64, 64, "float16", out="float16"),  # fp16 accumulation
        relu(),  # no reduction
    ],
)
def test_rule_leaves_other_kernels_alone(func):
    assert CUDATensorCoreMatmul().apply(func, SM80, False) is None


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_every_gemm_form_gets_mma_sync_in_ptx(dtype):
    """One module per dtype (one nvcc run): NN, NT, TN, batched, odd shapes, implicit GEMM."""
    from tvm.support import nvcc

    funcs = {name: make(dtype) for name, make in CASES.items()}
    for name, func in funcs.items():
        assert CUDATensorCoreMatmul().apply(func, SM80, False) is not None, name
    mod = tvm.IRModule(funcs)
    with SM80:
        mod = dl.ApplyDefaultSchedule(CUDATensorCoreMatmul())(mod)
    lib = tvm.compile(mod, target=SM80)
    source = "\n".join(m.inspect_source() for m in lib.mod.imports if m.kind == "cuda")
    with SM80:
        ptx = nvcc.compile_cuda(source, "ptx", "sm_80", compiler="nvcc")
    reports = {r.name.removesuffix("_kernel"): r for r in kernel_reports(bytes(ptx).decode())}
    short = {"float16": "f16", "bfloat16": "bf16"}[dtype]
    for name in CASES:
        ops = {op.instruction for op in reports[name].tensor_core_ops}
        assert ops == {f"mma.sync.aligned.m16n8k16.row.col.f32.{short}.{short}.f32"}, name
        assert reports[name].ldmatrix, name


def test_default_rules_fall_back_below_sm_80():
    sm75 = tvm.target.Target({"kind": "cuda", "arch": "sm_75", "host": {"kind": "llvm"}})
    names = [type(getattr(r, "rule", r)).__name__ for r in default_cuda_rules(sm75)]
    assert names[0] == "WmmaFp16Matmul" and "CUDATensorCoreMatmul" not in names
    sm60 = tvm.target.Target({"kind": "cuda", "arch": "sm_60", "host": {"kind": "llvm"}})
    assert "WmmaFp16Matmul" not in [
        type(getattr(r, "rule", r)).__name__ for r in default_cuda_rules(sm60)
    ]


def test_default_rules_reject_other_targets():
    with pytest.raises(ValueError, match="target kind 'llvm' is not 'cuda'"):
        default_cuda_rules(tvm.target.Target({"kind": "llvm"}))


def test_cp_async_when_the_build_enables_async_copy():
    """With ``tirx.use_async_copy`` the shared-memory copies become cp.async (sm_80+)."""
    func = CASES["matmul_nn"]("float16")
    with tvm.transform.PassContext(config={"tirx.use_async_copy": True}):
        mod = schedule(func)
        lib = tvm.compile(mod, target=SM80)
    source = "\n".join(m.inspect_source() for m in lib.mod.imports if m.kind == "cuda")
    assert "cp.async" in source and "mma.sync.aligned.m16n8k16" in source
