"""Built-in models at O2 on CUDA: every matmul/conv kernel's PTX uses tensor cores (no GPU).

Each case builds a model with ``tvmamp.build``, compiles its CUDA source to PTX with nvcc and
reads each kernel's instructions: a kernel TVM named after a matmul or conv2d must contain
``mma.sync`` (or ``wmma.mma.sync``) on the low dtype with fp32 accumulation. Three cases run by
default (sm_80 fp16, sm_80 bf16, sm_90 bf16); the whole matrix is marked slow.
"""

import argparse

import pytest

import tvmamp
from tvmamp import models
from tvmamp.targets.ptx import gemm_kernels_without_tensor_cores, kernel_reports

DEFAULT = {
    ("simplenet", "float16", "sm_80"),
    ("convnet", "bfloat16", "sm_80"),
    ("transformer", "bfloat16", "sm_90"),
}
# The GEMM kernels each model must have after fusion (conv2d, linear layers, attention).
MIN_GEMM_KERNELS = {"simplenet": 2, "convnet": 2, "transformer": 6}


def small(name):
    """The models at sizes that compile quickly but keep their odd shapes (3 input channels,
    a 10-way head, 16-token attention)."""
    if name == "simplenet":
        return models.simple_net(batch=64, hidden=256, layers=3)
    return models.get_model(name)


def matrix():
    for name in ("simplenet", "convnet", "transformer"):
        for dtype in ("float16", "bfloat16"):
            for arch in ("sm_80", "sm_90"):
                marks = () if (name, dtype, arch) in DEFAULT else (pytest.mark.slow,)
                yield pytest.param(name, dtype, arch, marks=marks, id=f"{name}-{dtype}-{arch}")


@pytest.mark.parametrize("name,dtype,arch", list(matrix()))
def test_gemm_kernels_use_tensor_cores(name, dtype, arch):
    mod, params = small(name)
    exe = tvmamp.build(mod, "O2", f"cuda -arch={arch}", dtype, params=params)
    ptx = exe.get_source("ptx")
    assert f".target {arch}" in ptx
    gemms = [r for r in kernel_reports(ptx) if r.is_gemm]
    assert len(gemms) >= MIN_GEMM_KERNELS[name], [r.name for r in gemms]
    assert gemm_kernels_without_tensor_cores(ptx, dtype) == []
    assert all(r.ldmatrix for r in gemms)


@pytest.mark.slow
def test_fp16_below_sm_80_uses_wmma():
    """sm_75 has no m16n8k16 mma: TVM's wmma rule (its intrinsics take ~14 s to import)."""
    mod, params = models.transformer_layer()
    exe = tvmamp.build(mod, "O2", "cuda -arch=sm_75", "float16", params=params)
    ptx = exe.get_source("ptx")
    assert gemm_kernels_without_tensor_cores(ptx, "float16") == []
    ops = {op.instruction for r in kernel_reports(ptx) for op in r.tensor_core_ops}
    assert ops == {"wmma.mma.sync.aligned.row.col.m16n16k16.f32.f32"}


def test_fp32_model_gets_no_tensor_cores():
    """O0 keeps the model fp32: the rule must leave fp32 GEMMs to the generic schedules."""
    mod, params = small("simplenet")
    exe = tvmamp.build(mod, "O0", "cuda -arch=sm_80", "float16", params=params)
    source = exe.get_source("cuda")
    assert [r for r in kernel_reports(source) if r.is_gemm]
    assert all(not r.tensor_core_ops for r in kernel_reports(source))


def test_inspect_command_prints_the_tensor_core_table(capsys):
    from tvmamp.commands import inspect

    parser = argparse.ArgumentParser()
    inspect.register(parser.add_subparsers())
    args = parser.parse_args(
        ["inspect", "convnet", "--level", "O2", "--target", "cuda", "-arch=sm_80"]
        + ["--dtype", "bfloat16"]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 [ldmatrix]" in out
    # both convs (batch norms folded in) and the head matmul
    assert "3 of 3 matmul/conv kernels use bfloat16 tensor cores" in out


def test_inspect_rejects_ptx_for_cpu_targets():
    from tvmamp.commands import inspect

    parser = argparse.ArgumentParser()
    inspect.register(parser.add_subparsers())
    args = parser.parse_args(["inspect", "simplenet", "--target", "llvm", "--ptx"])
    with pytest.raises(ValueError, match="--ptx needs a CUDA target, got 'llvm'"):
        args.func(args)
