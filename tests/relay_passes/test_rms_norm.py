"""FuseRMSNorm: a written-out RMSNorm becomes relax.nn.rms_norm (one fp32 op on the black list)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tolerances import assert_close, tolerance
from tvm.script import ir as I
from tvm.script import relax as R

import tvmamp
from tvmamp.relay_passes.rms_norm import FuseRMSNorm


@I.ir_module
class Written:
    """Llama's ``weight * (x * rsqrt(mean(x ** 2) + eps))``, and T5's unweighted ``x * x`` form
    with ``eps`` first."""

    @R.function
    def main(x: R.Tensor((2, 5, 8), "float32"), w: R.Tensor((8,), "float32")):
        with R.dataflow():
            p = R.power(x, R.const(2.0, "float32"))
            m = R.mean(p, axis=[-1], keepdims=True)
            a = R.add(m, R.const(1e-6, "float32"))
            r = R.rsqrt(a)
            h = R.multiply(x, r)
            out = R.multiply(w, h)
            q = R.multiply(out, out)
            m2 = R.mean(q, axis=[2], keepdims=True)
            a2 = R.add(R.const(1e-5, "float32"), m2)
            r2 = R.rsqrt(a2)
            out2 = R.multiply(r2, out)
            R.output(out2)
        return out2


EPS6, EPS5 = float(np.float32(1e-6)), float(np.float32(1e-5))


@I.ir_module
class Fused:
    @R.function
    def main(x: R.Tensor((2, 5, 8), "float32"), w: R.Tensor((8,), "float32")):
        with R.dataflow():
            # eps as the fp32 constant held it
            out = R.nn.rms_norm(x, w, axes=[-1], epsilon=EPS6)
            out2 = R.nn.rms_norm(out, R.const(np.ones(8, "float32")), axes=[-1], epsilon=EPS5)
            R.output(out2)
        return out2


def test_written_out_rms_norms_become_one_op():
    tvm.ir.assert_structural_equal(FuseRMSNorm()(Written), Fused)


@I.ir_module
class NotAnRMSNorm:
    """Left alone: the mean square read twice; the mean over another axis; no keepdims; a
    per-channel eps."""

    @R.function
    def main(x: R.Tensor((2, 5, 8), "float32"), e: R.Tensor((8,), "float32")):
        with R.dataflow():
            p = R.power(x, R.const(2.0, "float32"))
            m = R.mean(p, axis=[-1], keepdims=True)
            a = R.add(m, R.const(1e-6, "float32"))
            r = R.rsqrt(a)
            h = R.multiply(x, r)
            twice = R.add(m, m)
            p2 = R.power(x, R.const(2.0, "float32"))
            m2 = R.mean(p2, axis=[1], keepdims=True)
            h2 = R.multiply(x, R.rsqrt(R.add(m2, R.const(1e-6, "float32"))))
            p3 = R.power(x, R.const(2.0, "float32"))
            m3 = R.mean(p3, axis=[-1], keepdims=False)
            r3 = R.rsqrt(R.add(m3, R.const(1e-6, "float32")))
            p4 = R.power(x, R.const(2.0, "float32"))
            m4 = R.mean(p4, axis=[-1], keepdims=True)
            h4 = R.multiply(x, R.rsqrt(R.add(m4, e)))
            R.output(h, twice, h2, r3, h4)
        return (h, twice, h2, r3, h4)


def test_what_is_not_an_rms_norm_stays():
    after = FuseRMSNorm()(NotAnRMSNorm)
    tvm.ir.assert_structural_equal(after, NotAnRMSNorm)


@pytest.mark.parametrize("level", ["O0", "O2"])
def test_llama_rms_norm_from_torch(level, rng):
    """Llama's RMSNorm module before a Linear, against torch fp32: at O2 the written-out form
    ran its multiplies in bf16 (error 4.6e-3 on this model at d = 1024; now 1.1e-3)."""
    torch = pytest.importorskip("torch")

    class RMSNorm(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(d) + 0.5)

        def forward(self, x):
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
            return self.weight * h.to(x.dtype)

    class Block(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.norm, self.proj = RMSNorm(d), torch.nn.Linear(d, d)

        def forward(self, x):
            return x + self.proj(self.norm(x))

    torch.manual_seed(0)
    block = Block(64).eval()
    x = torch.from_numpy(rng.standard_normal((1, 9, 64)).astype("float32"))
    mod, params = tvmamp.from_torch(block, (x,))
    converted = tvmamp.convert(mod, level, "llvm -num-cores=1", params=params)
    assert "relax.nn.rms_norm" in {n.op for n in converted.report.nodes} or level == "O0"
    assert "R.nn.rms_norm" in converted.mod.script()
    exe = tvmamp.build(mod, level=level, target="llvm -num-cores=1", params=params)
    with torch.inference_mode():
        ref = block(x).numpy()
    tol = tolerance("float32") if level == "O0" else tolerance("bfloat16")
    assert_close(exe(x.numpy()), ref, **tol)
