"""FuseLayerNorm: a written-out LayerNorm over the last axis becomes relax.nn.layer_norm."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tolerances import assert_close, tolerance
from tvm.script import ir as I
from tvm.script import relax as R

import tvmamp
from tvmamp.relay_passes.layer_norm import FuseLayerNorm

W = np.linspace(0.5, 1.5, 8, dtype="float32")
B = np.linspace(-0.2, 0.3, 8, dtype="float32")
EPS12, EPS5 = float(np.float32(1e-12)), float(np.float32(1e-5))


@I.ir_module
class Written:
    """I-BERT's ``(x - u) / sqrt(eps + mean((x - u) ** 2)) * w + b``, and the unweighted
    ``y * rsqrt(mean(y * y) + eps)`` form with its mean over axis 2 of a 3-D tensor."""

    @R.function
    def main(x: R.Tensor((2, 5, 8), "float32")):
        with R.dataflow():
            u = R.mean(x, axis=[-1], keepdims=True)
            y = R.subtract(x, u)
            p = R.power(y, R.const(2.0, "float32"))
            v = R.mean(p, axis=[-1], keepdims=True)
            a = R.add(R.const(1e-12, "float32"), v)
            s = R.sqrt(a)
            d = R.divide(y, s)
            m = R.multiply(d, R.const(W))
            out = R.add(R.const(B), m)
            u2 = R.mean(out, axis=[2], keepdims=True)
            y2 = R.subtract(out, u2)
            q = R.multiply(y2, y2)
            v2 = R.mean(q, axis=[2], keepdims=True)
            r2 = R.rsqrt(R.add(v2, R.const(1e-5, "float32")))
            out2 = R.multiply(r2, y2)
            R.output(out2)
        return out2


@I.ir_module
class Fused:
    @R.function
    def main(x: R.Tensor((2, 5, 8), "float32")):
        with R.dataflow():
            out = R.nn.layer_norm(x, R.const(W), R.const(B), axes=[-1], epsilon=EPS12)
            out2 = R.nn.layer_norm(
                out,
                R.const(np.ones(8, "float32")),
                R.const(np.zeros(8, "float32")),
                axes=[-1],
                epsilon=EPS5,
            )
            R.output(out2)
        return out2


def test_written_out_layer_norms_become_one_op():
    tvm.ir.assert_structural_equal(FuseLayerNorm()(Written), Fused)


@I.ir_module
class WrittenSymbolic:
    """An ONNX export before opset 17 with dynamic batch and sequence axes: only the channels
    are static. It was left written out, and O2 ran the centring and division in bf16 (BERT:
    1.7e-2 against onnxruntime, 2.8e-3 with static shapes)."""

    @R.function
    def main(x: R.Tensor(("n", "s", 8), "float32")):
        with R.dataflow():
            u = R.mean(x, axis=[-1], keepdims=True)
            y = R.subtract(x, u)
            v = R.mean(R.power(y, R.const(2.0, "float32")), axis=[-1], keepdims=True)
            d = R.divide(y, R.sqrt(R.add(v, R.const(1e-12, "float32"))))
            out = R.add(R.multiply(d, R.const(W)), R.const(B))
            R.output(out)
        return out


@I.ir_module
class FusedSymbolic:
    @R.function
    def main(x: R.Tensor(("n", "s", 8), "float32")):
        with R.dataflow():
            out = R.nn.layer_norm(x, R.const(W), R.const(B), axes=[-1], epsilon=EPS12)
            R.output(out)
        return out


def test_a_layer_norm_over_symbolic_rows_becomes_one_op():
    tvm.ir.assert_structural_equal(FuseLayerNorm()(WrittenSymbolic), FusedSymbolic)


@I.ir_module
class NotALayerNorm:
    """Left alone: the centred value read a third time; the means over another axis; a
    per-channel eps; a mean of another tensor subtracted."""

    @R.function
    def main(x: R.Tensor((2, 5, 8), "float32"), e: R.Tensor((8,), "float32")):
        with R.dataflow():
            u = R.mean(x, axis=[-1], keepdims=True)
            y = R.subtract(x, u)
            v = R.mean(R.power(y, R.const(2.0, "float32")), axis=[-1], keepdims=True)
            d = R.divide(y, R.sqrt(R.add(v, R.const(1e-5, "float32"))))
            extra = R.add(y, d)
            u1 = R.mean(x, axis=[1], keepdims=True)
            y1 = R.subtract(x, u1)
            v1 = R.mean(R.power(y1, R.const(2.0, "float32")), axis=[1], keepdims=True)
            d1 = R.divide(y1, R.sqrt(R.add(v1, R.const(1e-5, "float32"))))
            u2 = R.mean(x, axis=[-1], keepdims=True)
            y2 = R.subtract(x, u2)
            v2 = R.mean(R.power(y2, R.const(2.0, "float32")), axis=[-1], keepdims=True)
            d2 = R.divide(y2, R.sqrt(R.add(v2, e)))
            u3 = R.mean(d2, axis=[-1], keepdims=True)
            y3 = R.subtract(x, u3)
            v3 = R.mean(R.power(y3, R.const(2.0, "float32")), axis=[-1], keepdims=True)
            d3 = R.divide(y3, R.sqrt(R.add(v3, R.const(1e-5, "float32"))))
            R.output(extra, d1, d3)
        return (extra, d1, d3)


def test_what_is_not_a_layer_norm_stays():
    tvm.ir.assert_structural_equal(FuseLayerNorm()(NotALayerNorm), NotALayerNorm)


def test_fused_layer_norms_match_the_written_out_ones(rng):
    x = (rng.standard_normal((2, 5, 8)) * 3 + 1).astype("float32")
    ref = tvmamp.build(Written, "O0", "llvm -num-cores=1")
    with tvm.transform.PassContext():
        fused = tvmamp.build(Fused, "O0", "llvm -num-cores=1")
    assert_close(fused(x), ref(x), **tolerance("float32"))
    u = x.mean(-1, keepdims=True)
    first = (x - u) / np.sqrt(((x - u) ** 2).mean(-1, keepdims=True) + 1e-12) * W + B
    u2 = first.mean(-1, keepdims=True)
    expected = (first - u2) / np.sqrt(((first - u2) ** 2).mean(-1, keepdims=True) + 1e-5)
    assert_close(fused(x), expected, **tolerance("float32"))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_ibert_layer_norm_from_torch_keeps_o2_within_autocast(level, rng):
    """I-BERT writes its LayerNorm out (``IntLayerNorm`` without quantisation). At O2 its
    centring, division and affine ran in bf16 and its residual stream could not stay fp32: a
    2-layer I-BERT had 15x torch autocast's error (1.4e-2 against 8.9e-4; 6.8e-4 now)."""
    torch = pytest.importorskip("torch")

    class WrittenLayerNorm(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.rand(d) + 0.5)
            self.bias = torch.nn.Parameter(torch.rand(d) - 0.5)

        def forward(self, x):
            y = x - x.mean(axis=2, keepdim=True)
            var = torch.mean(y**2, axis=2, keepdim=True)
            return y / torch.sqrt(1e-12 + var) * self.weight + self.bias

    class Blocks(torch.nn.Module):
        def __init__(self, d, n):
            super().__init__()
            self.proj = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))
            self.norm = torch.nn.ModuleList(WrittenLayerNorm(d) for _ in range(n))

        def forward(self, x):
            for proj, norm in zip(self.proj, self.norm, strict=True):
                x = norm(x + proj(x))
            return x

    torch.manual_seed(0)
    blocks = Blocks(64, 4).eval()
    x = torch.from_numpy(rng.standard_normal((1, 33, 64)).astype("float32"))
    mod, params = tvmamp.from_torch(blocks, (x,))
    converted = tvmamp.convert(mod, level, "llvm -num-cores=1", params=params)
    assert {n.op for n in converted.report.nodes} >= {"relax.nn.layer_norm"}
    assert "relax.divide" not in {n.op for n in converted.report.nodes}
    exe = tvmamp.build(mod, level=level, target="llvm -num-cores=1", params=params)
    with torch.inference_mode():
        ref = blocks(x).numpy()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = blocks(x).float().numpy()
    error = np.abs(np.asarray(exe(x.numpy())) - ref).max() / np.abs(ref).max()
    assert error <= 2 * np.abs(autocast - ref).max() / np.abs(ref).max()
