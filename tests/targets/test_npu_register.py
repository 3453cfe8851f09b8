"""A second, toy NPU registered from a test through register_npu, without touching the core."""

import pytest
from tolerances import assert_close, tolerance

import tvmamp
import tvmamp.targets.npu as npu
from tvmamp import models, targets

# An 8-wide matrix engine that runs fp16 matmuls and dense+bias+relu, nothing else; one NPU
# function per pattern (FuseOpsByPattern(annotate_codegen=True), no MergeCompositeFunctions).
TOY = npu.NpuDescriptor(
    name="toy_npu",
    ops=("relax.matmul",),
    fused=("dense_bias_relu",),
    channel_multiple=8,
    vector_multiple=8,
    merge_regions=False,
)


@pytest.fixture
def toy():
    calls = []
    reference = npu.make_codegen("toy_npu")

    def codegen(functions, options, constant_names):
        calls.append([str(f.attrs["global_symbol"]) for f in functions])
        return reference(functions, options, constant_names)

    entry = npu.register_npu("toy", TOY, codegen=codegen)
    yield entry, calls
    del targets.REGISTRY["toy"]
    del npu.NPUS["toy_npu"]


def test_toy_npu_builds_runs_and_reports(toy):
    entry, calls = toy
    mod, params = models.simple_net(batch=8, hidden=24, layers=3)
    exe = tvmamp.build(mod, "O2", "toy -num-cores=1", params=params)
    rep = npu.partition_report(exe)
    assert rep.npu == "toy_npu" and rep.patterns() == {"dense_bias_relu": 2, "dense": 1}
    assert [(p.op, p.dtype) for p in rep.on_host] == [("relax.add", "float32")]
    assert rep.on_host[0].reason == "relax.add runs on toy_npu only inside a fused pattern"
    # one NPU function per pattern; the two identical dense_bias_relu layers share one
    assert len(calls) == 1 and len(calls[0]) == 2
    x = models.example_inputs(mod)
    ref = tvmamp.build(mod, "O0", "llvm -num-cores=1", params=params)(*x)
    assert_close(exe(*x), ref, **tolerance(exe.policy.low_dtype))


def test_the_reference_npu_rejects_what_the_toy_accepts(toy):
    mod, params = models.simple_net(batch=8, hidden=24, layers=3)
    toy_report = npu.partition_report(tvmamp.convert(mod, "O2", "toy", params=params))
    ref_report = npu.partition_report(tvmamp.convert(mod, "O2", "npu", params=params))
    assert len(toy_report.on_npu) == 3 and ref_report.on_npu == ()


def test_registering_twice_needs_override(toy):
    with pytest.raises(ValueError, match="target 'toy' is already registered"):
        npu.register_npu("toy", TOY)


def test_reference_codegen_needs_an_fp16_descriptor():
    bf16 = npu.NpuDescriptor(name="bf16_npu", dtypes=("bfloat16",))
    with pytest.raises(ValueError, match="reference codegen runs float16 only"):
        npu.register_npu("bf16_npu", bf16)
