"""Attention scores and their softmax in one bf16 CPU kernel (``relay_passes/gemm_softmax.py``,
``schedules/cpu/bf16_softmax.py``): which pairs merge, and the merged kernel's numerics."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import tvm
from tolerances import assert_close
from tvm import relax

import tvmamp
from tvmamp.pipeline import run_front_phases
from tvmamp.relay_passes.gemm_softmax import FuseGemmSoftmax
from tvmamp.schedules.cpu import bf16_softmax
from tvmamp.targets.llvm import _host_flags

ZNVER4 = "llvm -mcpu=znver4 -mattr=-sse4a -num-cores=1"
ZNVER4_2 = "llvm -mcpu=znver4 -mattr=-sse4a -num-cores=2"
SAPPHIRE = "llvm -mcpu=sapphirerapids -num-cores=2"


def _attention(batch, heads, rows, cols, dim, mask=False, scores_out=False, axis=-1):
    """``softmax(q @ k^T / sqrt(dim) [+ mask], axis) @ v`` on fp32 inputs (``scores_out``: the
    scores are also an output)."""
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((batch, heads, rows, dim), "float32"))
    k = relax.Var("k", relax.TensorType((batch, heads, cols, dim), "float32"))
    v = relax.Var("v", relax.TensorType((batch, heads, cols, dim), "float32"))
    m = relax.Var("m", relax.TensorType((batch, 1, 1, cols), "float32"))
    with bb.function("main", [q, k, v, m] if mask else [q, k, v]):
        with bb.dataflow():
            s = bb.emit(relax.op.matmul(q, relax.op.permute_dims(k, [0, 1, 3, 2])))
            s = bb.emit(relax.op.multiply(s, relax.const(dim**-0.5, "float32")))
            if mask:
                s = bb.emit(relax.op.add(s, m))
            p = bb.emit(relax.op.nn.softmax(s, axis=axis))
            out = relax.op.matmul(p, v)
            out = bb.emit_output(relax.Tuple([out, s]) if scores_out else out)
        bb.emit_func_output(out)
    return bb.get()


def _inputs(rng, batch, heads, rows, cols, dim, mask=False):
    args = [
        rng.standard_normal((batch, heads, n, dim)).astype("float32") * 2
        for n in (rows, cols, cols)
    ]
    if mask:
        args.append(np.where(rng.random((batch, 1, 1, cols)) < 0.2, -1e4, 0.0).astype("float32"))
    return args


def _reference(q, k, v, m=None):
    """Float64 attention on bf16-rounded inputs, the probabilities rounded to bf16 (as O2)."""
    q, k, v = (a.astype(ml_dtypes.bfloat16).astype(np.float64) for a in (q, k, v))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    if m is not None:
        s = s + m
    p = np.exp(s - s.max(-1, keepdims=True))
    p = (p / p.sum(-1, keepdims=True)).astype(ml_dtypes.bfloat16).astype(np.float64)
    return p @ v


def _kernel_names(mod, target) -> list[str]:
    """The kernels of ``mod`` at O2 bf16; each merged one is checked to take the merged rule."""
    converted = tvmamp.convert(mod, "O2", target, dtype="bfloat16")
    lowered = run_front_phases(converted)
    names = [
        gv.name_hint for gv, f in lowered.functions_items() if isinstance(f, tvm.tirx.PrimFunc)
    ]
    rule = bf16_softmax.CPUGemmSoftmaxBF16()
    with converted.target:
        for name in _merged(names):
            assert rule.apply(lowered[name], converted.target, False) is not None, name
    return names


def _merged(names) -> list[str]:
    return [n for n in names if "matmul" in n and "softmax" in n]


def _needs_bf16_host():
    if "avx512_bf16" not in _host_flags():
        pytest.skip("the host CPU lacks avx512_bf16")


@pytest.mark.parametrize(
    "shape",
    [
        (1, 2, 37, 48, 40),
        (2, 3, 16, 16, 8),
        (1, 1, 130, 2048, 64),
        (2, 4, 128, 128, 64),
    ],
    ids=["odd-rows-48-keys", "tiny", "2048-keys", "bert-like"],
)
@pytest.mark.parametrize("target", [ZNVER4, ZNVER4_2], ids=["1-core", "2-cores"])
@pytest.mark.parametrize("mask", [False, True], ids=["no-mask", "mask"])
def test_merged_scores_and_softmax_match_float64(rng, shape, target, mask):
    """The merged kernel (one per attention) against float64 on the same bf16-rounded inputs."""
    mod = _attention(*shape, mask=mask)
    assert len(_merged(_kernel_names(mod, target))) == 1
    _needs_bf16_host()
    args = _inputs(rng, *shape, mask=mask)
    out = tvmamp.build(mod, "O2", target, dtype="bfloat16")(*args)
    assert_close(np.asarray(out, "float32"), _reference(*args), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("target", [ZNVER4, SAPPHIRE], ids=["vdpbf16ps", "amx"])
def test_one_key_is_declined_without_a_rule_error(rng, caplog, target):
    """MobileViT at 64 x 64 attends over one key: the scores GEMM has no column axis, and the
    rule failed on it ("'NoneType' object has no attribute 'get'", logged as a bug in the
    rule). It declines such a GEMM; the attention still matches float64."""
    import logging

    shape = (8, 4, 1, 1, 16)
    with caplog.at_level(logging.WARNING, logger="tvmamp.schedules"):
        exe = tvmamp.build(_attention(*shape), "O2", target, dtype="bfloat16")
    assert not [r for r in caplog.records if "bug in the rule" in r.getMessage()]
    if target == ZNVER4:
        _needs_bf16_host()
        args = _inputs(rng, *shape)
        assert_close(np.asarray(exe(*args), "float32"), _reference(*args), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "what, kwargs, shape",
    [
        ("the scores are also an output", {"scores_out": True}, (1, 2, 32, 32, 16)),
        ("softmax over the rows", {"axis": -2}, (1, 2, 32, 32, 16)),
        ("keys not whole vectors (ViT's 197)", {}, (1, 2, 32, 197, 16)),
        ("more keys than MAX_COLUMNS", {}, (1, 1, 16, bf16_softmax.MAX_COLUMNS + 16, 16)),
        ("AMX: more keys than AMX_MAX_COLUMNS", {}, (1, 1, 64, 1040, 16)),
    ],
)
def test_pairs_that_stay_two_kernels(what, kwargs, shape):
    """No merge where another op reads the scores, the softmax is not over the GEMM's columns,
    or the rule would not schedule it (the unmerged kernels' numerics are tested elsewhere)."""
    target = SAPPHIRE if what.startswith("AMX") else ZNVER4
    names = _kernel_names(_attention(*shape, **kwargs), target)
    assert not _merged(names), what
    assert any("softmax" in n for n in names)


@pytest.mark.parametrize("causal", [False, True], ids=["boolean-mask", "causal"])
def test_torch_attention_masks_merge_and_a_fully_masked_query_gives_zeros(rng, causal):
    """``scaled_dot_product_attention`` with a boolean mask (a query that may attend to nothing
    gives 0, as in torch) or ``is_causal`` (its mask built from ``arange`` in the scores
    kernel): the mask joins the scores kernel, the safe softmax the merged kernel."""
    import torch
    import torch.nn.functional as F

    class Attention(torch.nn.Module):
        def forward(self, q, k, v, *mask):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask[0] if mask else None, is_causal=causal
            )

    rows = 32 if causal else 24
    q, k, v = (rng.standard_normal((2, 4, n, 32)).astype("float32") for n in (rows, 32, 32))
    mask = np.tril(np.ones((rows, 32), bool))
    mask[7] = False
    args = [q, k, v] if causal else [q, k, v, mask]
    with torch.inference_mode():
        ref = Attention()(*(torch.from_numpy(a) for a in args)).numpy()
    mod, _ = tvmamp.from_torch(Attention(), tuple(torch.from_numpy(a) for a in args))
    assert len(_merged(_kernel_names(mod, ZNVER4))) == 1
    _needs_bf16_host()
    out = np.asarray(tvmamp.build(mod, "O2", ZNVER4, dtype="bfloat16")(*args), "float32")
    if not causal:
        assert np.all(out[:, :, 7] == 0)
    assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_fuse_gemm_softmax_leaves_a_module_without_pairs_unchanged():
    """IR before/after: where the schedule declines the merged kernel nothing changes."""
    converted = tvmamp.convert(_attention(1, 2, 32, 32, 16), "O2", ZNVER4, dtype="bfloat16")
    passes = [*tvmamp.pipeline.library_dispatch_passes(ZNVER4_T, converted.entry, converted.policy)]
    with ZNVER4_T:
        grouped = tvm.transform.Sequential([*passes, *_grouping()])(converted.mod)
        after = FuseGemmSoftmax(lambda kernel: False)(grouped)
        merged = FuseGemmSoftmax(lambda kernel: True)(grouped)
    tvm.ir.assert_structural_equal(after, grouped)
    calls = _called_prim_funcs(merged)
    assert ["matmul", "multiply", "softmax_fast", "cast"] in calls


ZNVER4_T = tvm.target.Target(
    {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": 1}
)


def _grouping() -> list:
    """Phase 2 up to and with ``FuseOps``: the module ``FuseGemmSoftmax`` runs on."""
    passes = tvmamp.pipeline.legalize_passes()
    return passes[: passes.index(next(p for p in passes if p.info.name == "FuseOps")) + 1]


def _called_prim_funcs(mod) -> list[list[str]]:
    """For each primitive Relax function: the PrimFuncs it calls, in order, digits dropped."""
    out = []
    for _, func in mod.functions_items():
        if isinstance(func, relax.Function) and func.attrs and func.attrs.get("Primitive"):
            names = [b.value.args[0].name_hint for b in func.body.blocks[0].bindings]
            out.append([n.rstrip("0123456789") for n in names])
    return out


def test_amx_loop_nest_matches_float64(rng, monkeypatch):
    """The AMX variant's row blocks, padding, packing and softmax, with the intrinsic's own
    description in place of ``tdpbf16ps`` (so that it runs on any avx512_bf16 host); the
    intrinsic itself is checked on AMX hosts by the test below and tests/schedules/
    test_cpu_amx_blocking.py."""
    _needs_bf16_host()
    tiled = []
    monkeypatch.setattr(bf16_softmax, "_tensorize_amx", lambda *args: tiled.append(args))
    shape = (1, 2, 37, 48, 40)
    mod = _attention(*shape, mask=True)
    converted = tvmamp.convert(mod, "O2", SAPPHIRE, dtype="bfloat16")
    target = converted.target
    lowered = run_front_phases(converted)
    (name,) = _merged(gv.name_hint for gv, _ in lowered.functions_items())
    func = lowered[name]
    with target:
        sch = bf16_softmax.CPUGemmSoftmaxBF16().apply(func, target, False)
    assert sch is not None and tiled, "the AMX variant was not chosen"
    scheduled = sch.mod["main"].with_attr("global_symbol", "main")
    kernel = tvm.compile(tvm.IRModule({"main": scheduled}), target=ZNVER4_T)
    args = _inputs(rng, *shape, mask=True)
    q, k, m = args[0], args[1], args[3]
    qb = tvm.runtime.tensor(q.astype(ml_dtypes.bfloat16))
    kb = tvm.runtime.tensor(
        np.ascontiguousarray(k.transpose(0, 1, 3, 2)).astype(ml_dtypes.bfloat16)
    )
    extra = [tvm.runtime.tensor(m)] if len(func.params) == 4 else []
    out = tvm.runtime.empty((1, 2, 37, 48), "bfloat16")
    kernel(qb, kb, *extra, out)
    qd, kd = (a.astype(ml_dtypes.bfloat16).astype(np.float64) for a in (q, k))
    s = qd @ kd.transpose(0, 1, 3, 2) / np.sqrt(40) + m
    p = np.exp(s - s.max(-1, keepdims=True))
    assert_close(
        np.asarray(out.numpy(), "float32"), p / p.sum(-1, keepdims=True), rtol=1e-2, atol=1e-3
    )


def test_amx_merged_kernel_matches_float64_on_amx_hosts(rng):
    """The merged kernel with ``tdpbf16ps``: built here, run where the host has AMX."""
    shape = (2, 4, 37, 64, 64)
    mod = _attention(*shape, mask=True)
    exe = tvmamp.build(mod, "O2", SAPPHIRE, dtype="bfloat16")
    text = exe.get_source("asm")
    assert "tdpbf16ps" in text
    if "amx_bf16" not in _host_flags():
        pytest.skip("the host CPU lacks amx_bf16")
    args = _inputs(rng, *shape, mask=True)
    assert_close(np.asarray(exe(*args), "float32"), _reference(*args), rtol=2e-2, atol=2e-2)
