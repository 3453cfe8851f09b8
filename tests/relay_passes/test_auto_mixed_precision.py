"""AutoMixedPrecision: IR before/after for each level and category, and the pass's guarantees."""

import numpy as np
import pytest
import tvm
from tvm import relax
from tvm.script import ir as I
from tvm.script import relax as R
from tvm.script import tirx as T

from tvmamp.policy import Policy
from tvmamp.relay_passes import AutoMixedPrecision


def run(mod, level="O1", dtype="float16", keep_io_types=True, **custom):
    amp = AutoMixedPrecision(Policy.for_level(level, dtype, **custom), keep_io_types)
    out = amp(mod)
    relax.analysis.well_formed(out)
    return out, amp.report


@I.ir_module
class MLP:
    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 16), "float32")):
        with R.dataflow():
            y = R.matmul(x, w)
            z = R.nn.relu(y)
            s = R.nn.softmax(z, axis=-1)
            R.output(s)
        return s


def test_o1_white_low_black_fp32_follow_low_after_low_inputs():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 16), "float32")):
            with R.dataflow():
                x16 = R.astype(x, "float16")
                w16 = R.astype(w, "float16")
                y = R.matmul(x16, w16, out_dtype="float32")
                y16 = R.astype(y, "float16")  # noqa: F841 (emitted, unused at auto)
                z = R.nn.relu(y16)
                z32 = R.astype(z, "float32")
                s = R.nn.softmax(z32, axis=-1)
                R.output(s)
            return s

    out, report = run(MLP, "O1")
    tvm.ir.assert_structural_equal(out, Expected)
    assert report.casts_inserted == 4
    assert dict(report.ops["relax.matmul"]) == {"float16": 1}
    assert dict(report.ops["relax.nn.softmax"]) == {"float32": 1}


def test_od_keeps_everything_but_white_fp32_without_round_trip():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 16), "float32")):
            with R.dataflow():
                x16 = R.astype(x, "float16")
                w16 = R.astype(w, "float16")
                y = R.matmul(x16, w16, out_dtype="float32")
                z = R.nn.relu(y)  # the fp32 accumulator is used as it is: no cast
                s = R.nn.softmax(z, axis=-1)
                R.output(s)
            return s

    out, _ = run(MLP, "OD")
    tvm.ir.assert_structural_equal(out, Expected)


def test_o3_everything_low_and_output_restored():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 16), "float32")):
            with R.dataflow():
                x16 = R.astype(x, "bfloat16")
                w16 = R.astype(w, "bfloat16")
                y = R.matmul(x16, w16, out_dtype="float32")
                y16 = R.astype(y, "bfloat16")
                z = R.nn.relu(y16)
                s = R.nn.softmax(z, axis=-1)
                out = R.astype(s, "float32")
                R.output(out)
            return out

    out, _ = run(MLP, "O3", "bfloat16")
    tvm.ir.assert_structural_equal(out, Expected)


def test_keep_io_types_false_takes_and_returns_low():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float16"), w: R.Tensor((8, 16), "float16")):
            with R.dataflow():
                y = R.matmul(x, w, out_dtype="float32")
                y16 = R.astype(y, "float16")  # noqa: F841 (emitted, unused at auto)
                z = R.nn.relu(y16)
                s = R.nn.softmax(z, axis=-1)
                R.output(s)
            return s

    out, _ = run(MLP, "O3", keep_io_types=False)
    tvm.ir.assert_structural_equal(out, Expected)


@I.ir_module
class Mixed:
    @R.function
    def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32")):
        with R.dataflow():
            y = R.matmul(x, w)
            a = R.add(y, x)
            e = R.exp(a)
            p = R.atan2(e, y)
            R.output(p)
        return p


def test_o2_black_fp32_promote_widest_and_no_round_trip_into_fp32_ops():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32")):
            with R.dataflow():
                x16 = R.astype(x, "float16")
                w16 = R.astype(w, "float16")
                y = R.matmul(x16, w16, out_dtype="float32")
                # a follow op that only feeds fp32 ops and reads an fp32 value stays fp32:
                # y's fp32 accumulator and x are used as they are, no cast down and back up
                a = R.add(y, x)
                e = R.exp(a)  # black
                p = R.atan2(e, y)  # promote: widest input is fp32; y's fp32 accumulator is used
                R.output(p)
            return p

    out, report = run(Mixed, "O2")
    tvm.ir.assert_structural_equal(out, Expected)
    assert report.casts_inserted == 2


def test_o2_follow_low_except_residual_add_into_layer_norm():
    @I.ir_module
    class Before:
        @R.function
        def main(
            x: R.Tensor((4, 8), "float32"),
            w: R.Tensor((8, 8), "float32"),
            g: R.Tensor((8,), "float32"),
            b: R.Tensor((8,), "float32"),
        ):
            with R.dataflow():
                y = R.matmul(x, w)
                r = R.nn.relu(y)
                z = R.matmul(r, w)
                h = R.add(z, x)
                o = R.nn.layer_norm(h, g, b, axes=[-1])
                R.output(o)
            return o

    @I.ir_module
    class Expected:
        @R.function
        def main(
            x: R.Tensor((4, 8), "float32"),
            w: R.Tensor((8, 8), "float32"),
            g: R.Tensor((8,), "float32"),
            b: R.Tensor((8,), "float32"),
        ):
            with R.dataflow():
                x16 = R.astype(x, "float16")
                w16 = R.astype(w, "float16")
                y = R.matmul(x16, w16, out_dtype="float32")
                y16 = R.astype(y, "float16")
                r = R.nn.relu(y16)  # follow op feeding a white op: low at O2
                z = R.matmul(r, w16, out_dtype="float32")
                h = R.add(z, x)  # the residual add feeds only the fp32 layer norm: fp32
                o = R.nn.layer_norm(h, g, b, axes=[-1])
                R.output(o)
            return o

    out, report = run(Before, "O2")
    tvm.ir.assert_structural_equal(out, Expected)
    decided = {n.node: (n.dtype, n.reason) for n in report.nodes}
    assert decided["main/r"] == ("float16", "policy")
    assert decided["main/h"] == ("float32", "feeds_fp32")
    # O3 keeps every op low, the residual add included
    _, o3 = run(Before, "O3")
    assert {n.node: n.dtype for n in o3.nodes}["main/h"] == "float16"
    # so does O2 on a target that turns the rule off (an fp16-only NPU)
    _, npu = run(Before, "O2", fp32_feeds=False)
    assert {n.node: n.dtype for n in npu.nodes}["main/h"] == "float16"


def test_auto_keeps_input_dtype_and_promotes():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32")):
            with R.dataflow():
                x16 = R.astype(x, "float16")
                w16 = R.astype(w, "float16")
                y = R.matmul(x16, w16, out_dtype="float32")
                y16 = R.astype(y, "float16")  # noqa: F841 (emitted, unused at auto)
                a = R.add(y, x)  # inputs f16 (nominal) and f32: widest is f32
                e = R.exp(a)
                p = R.atan2(e, y)
                R.output(p)
            return p

    out, _ = run(Mixed, "auto")
    # y16 is never used: DCE-free comparison would differ, so compare after removing it
    out = relax.transform.DeadCodeElimination()(out)
    tvm.ir.assert_structural_equal(out, relax.transform.DeadCodeElimination()(Expected))


def test_custom_lists_with_aliases():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 16), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)  # "linear" (PyTorch) on the black list
                z = R.nn.relu(y)
                z16 = R.astype(z, "float16")
                s = R.nn.softmax(z16, axis=-1)  # "Softmax" (MindSpore) on the white list
                out = R.astype(s, "float32")
                R.output(out)
            return out

    out, _ = run(MLP, "O1", custom_white_list=["Softmax"], custom_black_list=["linear"])
    tvm.ir.assert_structural_equal(out, Expected)


@I.ir_module
class TwoLayers:
    @R.function
    def main(
        x: R.Tensor((4, 8), "float32"),
        w1: R.Tensor((8, 8), "float32"),
        head_w: R.Tensor((8, 8), "float32"),
    ):
        with R.dataflow():
            h = R.matmul(x, w1)
            head = R.matmul(h, head_w)
            R.output(head)
        return head


def test_per_node_rules_by_binding_and_param_name():
    @I.ir_module
    class Expected:
        @R.function
        def main(
            x: R.Tensor((4, 8), "float32"),
            w1: R.Tensor((8, 8), "float32"),
            head_w: R.Tensor((8, 8), "float32"),
        ):
            with R.dataflow():
                x16 = R.astype(x, "float16")
                w16 = R.astype(w1, "float16")
                h = R.matmul(x16, w16, out_dtype="float32")
                head = R.matmul(h, head_w)
                R.output(head)
            return head

    for patterns in (["head"], ["head_*"]):  # binding name, then parameter name
        out, report = run(TwoLayers, "O2", custom_fp32_nodes=patterns)
        tvm.ir.assert_structural_equal(out, Expected)
        assert [(f.name, f.dtype, f.reason) for f in report.forced] == [
            ("head", "float32", "custom_fp32_nodes")
        ]


def test_per_node_low_rule_at_od():
    out, report = run(TwoLayers, "OD", custom_low_nodes=["h"])
    assert report.forced == []  # matmul is white: already low, nothing forced
    out, report = run(MLP, "OD", custom_low_nodes=["z"])
    assert [(f.name, f.op, f.dtype) for f in report.forced] == [("z", "relax.nn.relu", "float16")]


@I.ir_module
class UserCasts:
    @R.function
    def main(x: R.Tensor((4, 8), "float32")):
        with R.dataflow():
            a = R.nn.relu(x)
            b = R.astype(a, "float16")
            c = R.astype(b, "float32")
            R.output(c)
        return c


def test_user_casts_that_became_no_ops_are_dropped():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                x16 = R.astype(x, "float16")
                a = R.nn.relu(x16)
                c = R.astype(a, "float32")
                R.output(c)
            return c

    out, report = run(UserCasts, "O2")
    tvm.ir.assert_structural_equal(out, Expected)
    assert report.casts_removed == 1


def test_no_round_trips_and_one_cast_per_value():
    out, _ = run(Mixed, "O1")
    casts = {}
    for binding in out["main"].body.blocks[0].bindings:
        value = binding.value
        if isinstance(value, relax.Call) and value.op.name == "relax.astype":
            key = (value.args[0], str(value.attrs.dtype))
            assert key not in casts, "the same value cast twice to the same dtype"
            casts[key] = binding.var
    for (src, _), var in casts.items():
        for src2, dtype2 in casts:
            if src2.same_as(var):
                assert dtype2 != src.ty.dtype, "round trip f32 -> low -> f32"


def test_constants_are_converted_at_compile_time_with_overflow_guard():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 2), "float32")):
            with R.dataflow():
                a = R.add(x, R.const(np.full((2, 2), 3.0, "float32")))
                b = R.multiply(a, R.const(np.full((2, 2), 1e6, "float32")))
                R.output(b)
            return b

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 2), "float32")):
            with R.dataflow():
                x16 = R.astype(x, "float16")
                a = R.add(x16, R.const(np.full((2, 2), 3.0, "float16")))
                a32 = R.astype(a, "float32")
                b = R.multiply(a32, R.const(np.full((2, 2), 1e6, "float32")))
                R.output(b)
            return b

    out, report = run(Before, "O2")
    tvm.ir.assert_structural_equal(out, Expected)
    assert report.constants_converted == 1
    assert [(f.op, f.dtype) for f in report.forced] == [("relax.multiply", "float32")]
    assert "exceeds the float16 range" in report.forced[0].reason
    out, report = run(Before, "O2", "bfloat16")  # 1e6 fits bf16
    assert report.forced == [] and report.constants_converted == 2


def test_call_tir_gets_the_dtypes_it_was_written_for():
    @I.ir_module
    class Clip:
        @R.function
        def main(x: R.Tensor((4, 8), "float32")):
            with R.dataflow():
                c = R.clip(x, 0.0, 6.0)
                R.output(c)
            return c

    legalized = relax.transform.LegalizeOps()(Clip)  # clip becomes call_tir of a PrimFunc
    prim = tvm.IRModule({legalized.get_global_var("tir_clip"): legalized["tir_clip"]})
    bb = relax.BlockBuilder(prim)
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    w = relax.Var("w", relax.TensorType((8, 8), "float32"))
    clip_gv = prim.get_global_var("tir_clip")
    with bb.function("main", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w))
            r = bb.emit(relax.op.nn.relu(y))
            c = bb.emit(relax.call_tir(clip_gv, (r,), relax.TensorType((4, 8), "float32")))
            out = bb.emit_output(relax.op.nn.relu(c))
        bb.emit_func_output(out)
    out, report = run(bb.get(), "O2")
    bindings = out["main"].body.blocks[0].bindings
    call = [b.value for b in bindings if b.value.op.name == "relax.call_tir"][0]
    assert str(call.args[1].fields[0].ty.dtype) == "float32"  # relu ran low, cast back for clip
    # the last relu reads the fp32 call_tir result and is the function's (fp32) result
    assert dict(report.ops["relax.nn.relu"]) == {"float16": 1, "float32": 1}


def test_tuples_if_and_several_functions():
    @I.ir_module
    class Before:
        @R.function
        def helper(x: R.Tensor((4, 4), "float32")) -> R.Tensor((4, 4), "float32"):
            with R.dataflow():
                y = R.matmul(x, x)
                R.output(y)
            return y

        @R.function
        def main(x: R.Tensor((4, 4), "float32"), flag: R.Tensor((), "bool")):
            cls = Before
            with R.dataflow():
                parts = R.split(x, 2, axis=1)
                cat = R.concat((parts[0], parts[1]), axis=1)
                m = R.matmul(cat, x)
                R.output(m)
            if flag:
                r = cls.helper(m)
            else:
                r = R.nn.relu(m)
            out = (r, m)
            return out

    out, report = run(Before, "O2")
    main = out["main"]
    assert [str(f.dtype) for f in main.ret_ty.fields] == ["float32", "float32"]
    assert str(out["helper"].ret_ty.dtype) == "float32"
    assert dict(report.ops["relax.matmul"]) == {"float16": 2}
    assert dict(report.ops["relax.concat"]) == {"float16": 1}


def test_dynamic_shapes_and_match_cast():
    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor(("n", 8), "float32"), w: R.Tensor((8, 8), "float32")):
            n = T.int64()
            with R.dataflow():
                y = R.matmul(x, w)
                z = R.match_cast(y, R.Tensor((n, 8), "float32"))
                s = R.nn.softmax(z)
                R.output(s)
            return s

    out, _ = run(Before, "O2")
    assert str(out["main"].ret_ty.dtype) == "float32"


def test_a_match_cast_of_a_concat_converts_the_concat():
    """``match_cast(concat([cls, x @ w]))``, the call itself the match_cast's value (the ONNX
    importer checks a concat's size at run time so: optimum's ViT over a dynamic batch). At
    O2 the concat reads a low GEMM and an fp32 input; visited as a plain expression it kept
    both dtypes ("Concat expects all input tensors to have the same dtype")."""
    n = tvm.tirx.Var("n", "int64")
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((n, 4, 8), "float32"))
    cls = relax.Var("cls", relax.TensorType((n, 1, 8), "float32"))
    w = relax.Var("w", relax.TensorType((8, 8), "float32"))
    with bb.function("main", [x, cls, w]):
        with bb.dataflow():
            patches = bb.emit(relax.op.matmul(x, w))
            joined = relax.op.concat([cls, patches], axis=1)
            tokens = bb.match_cast(joined, relax.TensorType((n, 5, 8), "float32"))
            out = bb.emit_output(relax.op.nn.relu(tokens))
        bb.emit_func_output(out)
    mod = bb.get()
    (cast,) = [b for b in mod["main"].body.blocks[0].bindings if isinstance(b, relax.MatchCast)]
    assert isinstance(cast.value, relax.Call)  # the case under test
    out, report = run(mod, "O2", "bfloat16")
    assert str(out["main"].ret_ty.dtype) == "float32"
    assert report.as_dict()["ops_per_dtype"]["bfloat16"] >= 2  # the GEMM and the concat


def test_o0_is_identity():
    out, report = run(MLP, "O0")
    tvm.ir.assert_structural_equal(out, MLP)
    assert report.casts_inserted == 0


def test_report_summary_mentions_casts_and_dtypes():
    _, report = run(MLP, "O1")
    text = report.summary()
    assert "4 casts inserted" in text and "float16: 2" in text and "float32: 1" in text
    assert report.as_dict()["ops_per_dtype"] == {"float16": 2, "float32": 1}


def test_policy_type_is_checked():
    with pytest.raises(TypeError, match="must be a tvmamp.Policy"):
        AutoMixedPrecision("O1")


def test_every_runtime_op_gets_a_unique_node_id():
    _, report = run(Mixed, "O2")
    assert [(n.node, n.op, n.dtype, n.reason) for n in report.nodes] == [
        ("main/y", "relax.matmul", "float16", "policy"),
        ("main/a", "relax.add", "float32", "feeds_fp32"),
        ("main/e", "relax.exp", "float32", "policy"),
        ("main/p", "relax.atan2", "float32", "policy"),
    ]


def test_exact_node_dtypes_win_over_the_lists():
    _, report = run(Mixed, "O2", node_dtypes={"main/a": "low", "main/e": "low"})
    decided = {n.node: (n.dtype, n.reason) for n in report.nodes}
    assert decided["main/a"] == ("float16", "node_dtypes")  # wins over feeds_fp32 too
    assert decided["main/e"] == ("float16", "node_dtypes")
    assert decided["main/y"] == ("float16", "policy")
    _, report = run(Mixed, "O2", node_dtypes={"main/y": "float32"})
    assert {n.node: (n.dtype, n.reason) for n in report.nodes}["main/y"] == (
        "float32",
        "node_dtypes",
    )
    with pytest.raises(ValueError, match="choose from float32, low, float16, bfloat16"):
        Policy.for_level("O2", "float16", node_dtypes={"main/a": "int8"})


def test_o2_fp32_accumulators_count_and_function_results_do_not():
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    w = relax.Var("w", relax.TensorType((8, 8), "float32"))
    g = relax.Var("g", relax.TensorType((8,), "float32"))
    with bb.function("main", [x, w, g]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w), name_hint="y")
            bias = relax.const(np.linspace(-1, 1, 8, dtype="float32"))
            # reads y's fp32 accumulator and feeds only the fp32 layer norm: fp32, no cast
            e = bb.emit(relax.op.add(y, bias), name_hint="e")
            o = bb.emit(relax.op.nn.layer_norm(e, g, g, axes=[-1]), name_hint="o")
            # feeds only the function's result: low, as O2 says (then cast back as I/O)
            z = bb.emit(relax.op.nn.relu(y), name_hint="z")
            out = bb.emit_output(relax.Tuple([o, z]))
        bb.emit_func_output(out)
    result, report = run(bb.get(), "O2")
    decided = {n.node: (n.dtype, n.reason) for n in report.nodes}
    assert decided["main/e"] == ("float32", "feeds_fp32")
    assert decided["main/z"] == ("float16", "policy")
    adds = [b.value for b in result["main"].body.blocks[0].bindings if b.var.name == "e"]
    assert adds[0].args[0].name == "y"  # the accumulator itself, not a cast of it


def test_o2_a_comparison_counts_as_an_fp32_use():
    """sdpa's scores: ``s = (q @ k^T) * scale`` feeds the softmax (fp32) and the "all -inf"
    check ``s == -inf``. Before, the check made ``s`` low: the scores were rounded to bf16
    before the softmax, and the scale ran as a cast-multiply-cast of its own."""
    bb = relax.BlockBuilder()
    q = relax.Var("q", relax.TensorType((4, 8), "float32"))
    k = relax.Var("k", relax.TensorType((8, 8), "float32"))
    with bb.function("main", [q, k]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(q, k), name_hint="y")
            s = bb.emit(relax.op.multiply(y, relax.const(0.125, "float32")), name_hint="s")
            p = bb.emit(relax.op.nn.softmax(s, axis=-1), name_hint="p")
            c = bb.emit(relax.op.equal(s, relax.const(float("-inf"), "float32")), name_hint="c")
            out = bb.emit_output(relax.Tuple([p, c]))
        bb.emit_func_output(out)
    _, report = run(bb.get(), "O2", "bfloat16")
    decided = {n.node: (n.dtype, n.reason) for n in report.nodes}
    assert decided["main/s"] == ("float32", "feeds_fp32")


def test_o2_a_promote_op_counts_as_an_fp32_use():
    """Two grid_samples of one fp32 grid (a permute of it, as the torch importer writes): the
    permute ran in bf16, and both samples read coordinates 1.4 px off at 512 px."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 2, 8, 8), "float32"))
    g = relax.Var("g", relax.TensorType((1, 4, 4, 2), "float32"))
    with bb.function("main", [x, g]):
        with bb.dataflow():
            p = bb.emit(relax.op.permute_dims(g, [0, 3, 1, 2]), name_hint="p")
            a = bb.emit(relax.op.image.grid_sample(x, p), name_hint="a")
            b = bb.emit(relax.op.image.grid_sample(x, p, method="nearest"), name_hint="b")
            out = bb.emit_output(relax.Tuple([a, b]))
        bb.emit_func_output(out)
    result, report = run(bb.get(), "O2", "bfloat16")
    decided = {n.node: (n.dtype, n.reason) for n in report.nodes}
    assert decided["main/p"] == ("float32", "feeds_fp32")
    assert "bfloat16" not in result.script()


def test_o2_a_value_read_by_gemms_and_the_fp32_residual_stream_stays_fp32():
    """DebertaV2: the embedding LayerNorm times the mask feeds the Q/K/V GEMMs and the residual
    add into the next LayerNorm. The GEMMs read a low copy whatever its dtype, so the product
    runs in fp32 and the residual stream is not rounded (it was: 20x autocast's error). A
    value read only by GEMMs stays low."""

    @I.ir_module
    class Before:
        @R.function
        def main(
            x: R.Tensor((4, 8), "float32"),
            m: R.Tensor((4, 1), "float32"),
            w: R.Tensor((8, 8), "float32"),
            g: R.Tensor((8,), "float32"),
            b: R.Tensor((8,), "float32"),
        ):
            with R.dataflow():
                n = R.nn.layer_norm(x, g, b, axes=[-1])
                e = R.multiply(n, m)
                q = R.matmul(e, w)
                h = R.add(q, e)
                a = R.nn.relu(n)
                v = R.matmul(a, w)
                o = R.nn.layer_norm(h, g, b, axes=[-1])
                R.output(o, v)
            return (o, v)

    @I.ir_module
    class Expected:
        @R.function
        def main(
            x: R.Tensor((4, 8), "float32"),
            m: R.Tensor((4, 1), "float32"),
            w: R.Tensor((8, 8), "float32"),
            g: R.Tensor((8,), "float32"),
            b: R.Tensor((8,), "float32"),
        ):
            with R.dataflow():
                n = R.nn.layer_norm(x, g, b, axes=[-1])
                e = R.multiply(n, m)  # read by a GEMM and the residual add: fp32
                e16 = R.astype(e, "bfloat16")
                w16 = R.astype(w, "bfloat16")
                q = R.matmul(e16, w16, out_dtype="float32")
                h = R.add(q, e)
                n16 = R.astype(n, "bfloat16")
                a = R.nn.relu(n16)  # read by a GEMM only: low
                v = R.matmul(a, w16, out_dtype="float32")
                o = R.nn.layer_norm(h, g, b, axes=[-1])
                R.output(o, v)
            return (o, v)

    out, report = run(Before, "O2", "bfloat16")
    tvm.ir.assert_structural_equal(out, Expected)
    decided = {n.node: (n.dtype, n.reason) for n in report.nodes}
    assert decided["main/e"] == ("float32", "feeds_fp32")
    assert decided["main/a"] == ("bfloat16", "policy")


def test_o2_a_comparison_of_an_fp32_value_compares_in_fp32():
    """``x > 0.5`` on a GEMM's fp32 accumulator: rounded to bf16 first, 0.50001 compared as 0.5
    (false). It reads the accumulator as it is; O3 still compares low."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)
                c = R.greater(y, R.const(0.5, "float32"))
                R.output(c)
            return c

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 8), "float32")):
            with R.dataflow():
                x16 = R.astype(x, "bfloat16")
                w16 = R.astype(w, "bfloat16")
                y = R.matmul(x16, w16, out_dtype="float32")
                c = R.greater(y, R.const(0.5, "float32"))
                R.output(c)
            return c

    out, report = run(Before, "O2", "bfloat16")
    tvm.ir.assert_structural_equal(out, Expected)
    decided = {n.node: (n.dtype, n.reason) for n in report.nodes}
    assert decided["main/c"] == ("float32", "comparison")
    _, o3 = run(Before, "O3", "bfloat16")
    assert {n.node: n.dtype for n in o3.nodes}["main/c"] == "bfloat16"
    _, npu = run(Before, "O2", "bfloat16", fp32_feeds=False)
    assert {n.node: n.dtype for n in npu.nodes}["main/c"] == "bfloat16"


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_resize_keeps_its_out_dtype_and_the_output_is_fp32(level):
    """resize2d's out_dtype is not an accumulator (TVM's legalization ignores it): a float32
    out_dtype on a bf16 resize returned a bf16 array from a keep_io_types model at O3, and
    failed to build where the resize fed an fp32 op."""
    import tvmamp

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 6, 6), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.multiply(x, relax.const(2.0, "float32")))
            out = bb.emit_output(relax.op.image.resize2d(y, (12, 12), method="linear"))
        bb.emit_func_output(out)
    mod = bb.get()
    converted = AutoMixedPrecision(Policy.for_level(level, "bfloat16"))(mod)
    (resize,) = [
        b.value
        for block in converted["main"].body.blocks
        for b in block.bindings
        if isinstance(b.value, relax.Call) and b.value.op.name == "relax.image.resize2d"
    ]
    assert resize.attrs.out_dtype is None  # as written: not the fp32 accumulate dtype
    exe = tvmamp.build(mod, level, "llvm", dtype="bfloat16")
    a = np.random.default_rng(0).uniform(0.5, 1.5, (1, 4, 6, 6)).astype("float32")
    out = exe(a)
    assert out.dtype == np.float32
    ref = tvmamp.build(mod, "O0", "llvm")(a)
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)


def test_o3_sum_reads_low_and_adds_up_in_float32():
    """O3 ran ``x.sum(-1)`` in bf16: the running sum of 4096 values near 0.8 stopped at 1024.
    A low reduction now reads the low input and adds up in the accumulate dtype."""

    @I.ir_module
    class Before:
        @R.function
        def main(x: R.Tensor((2, 4096), "float32")):
            with R.dataflow():
                s = R.sum(x, axis=[-1])
                R.output(s)
            return s

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((2, 4096), "float32")):
            with R.dataflow():
                x16 = R.astype(x, "bfloat16")
                x32 = R.astype(x16, "float32")
                s = R.sum(x32, axis=[-1])
                R.output(s)
            return s

    out, report = run(Before, "O3", "bfloat16")
    tvm.ir.assert_structural_equal(out, Expected)
    assert dict(report.ops["relax.sum"]) == {"bfloat16": 1}


@pytest.mark.parametrize("op", ["sum", "cumsum", "mean"])
def test_o3_reductions_match_float32(rng, op):
    import tvmamp

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 4096), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = getattr(relax.op, op)(x, axis=-1)
            out = bb.emit_output(relax.op.nn.relu(y))  # a low consumer after the reduction
        bb.emit_func_output(out)
    data = np.abs(rng.standard_normal((2, 4096))).astype("float32") + 0.1
    ref = {"sum": data.sum(-1), "mean": data.mean(-1), "cumsum": np.cumsum(data, -1)}[op]
    got = np.asarray(tvmamp.build(bb.get(), "O3", "llvm", "bfloat16")(data), dtype="float64")
    assert np.abs(got - ref).max() / np.abs(ref).max() <= 1e-2  # bf16 inputs and output


def test_o2_result_computed_from_fp32_ops_stays_fp32(rng):
    """``mean(x * x) - mean(x) ** 2`` at the end of a model: the means and the power are black
    (fp32), and the subtraction, the function's result, was rounded to bf16 first: error 1.85
    on data offset by 30. It now runs fp32; a GEMM's result plus a bias still runs low."""
    import tvmamp

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 256), "float32"))
    w = relax.Var("w", relax.TensorType((256, 8), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            square = bb.emit(relax.op.mean(relax.op.multiply(x, x), axis=-1))
            mean = bb.emit(relax.op.mean(x, axis=-1))
            power = bb.emit(relax.op.power(mean, relax.const(2.0, "float32")))
            var = bb.emit(relax.op.subtract(square, power))
            logits = bb.emit(relax.op.add(relax.op.matmul(x, w), relax.const(0.5, "float32")))
            out = bb.emit_output(relax.Tuple([var, logits]))
        bb.emit_func_output(out)
    mod = bb.get()
    _, report = run(mod, "O2", "bfloat16")
    decided = {n.op: (n.dtype, n.reason) for n in report.nodes}
    assert decided["relax.subtract"] == ("float32", "feeds_fp32")
    assert decided["relax.add"] == ("bfloat16", "policy")  # reads the GEMM's accumulator
    data = (rng.standard_normal((4, 256)) + 30).astype("float32")
    weight = rng.standard_normal((256, 8)).astype("float32")
    got = tvmamp.build(mod, "O2", "llvm", "bfloat16")(data, weight)[0]
    want = data.astype("float64").var(-1)
    assert np.abs(np.asarray(got) - want).max() / want.max() <= 1e-2


def test_o0_keeps_a_low_model_but_runs_what_tvm_cannot_run_low_in_fp32(rng):
    """A bf16 model at O0: argmax failed to compile and sort crashed the process in bf16. O0
    leaves every other op as written (the IR of an fp32 model is untouched)."""
    import ml_dtypes

    import tvmamp

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((8, 64), "bfloat16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            e = bb.emit(relax.op.exp(x))
            s = bb.emit(relax.op.sort(e, axis=-1))
            i = bb.emit(relax.op.argmax(e, axis=-1))
            out = bb.emit_output(relax.Tuple([s, i]))
        bb.emit_func_output(out)
    mod = bb.get()
    out, report = run(mod, "O0", "bfloat16")
    decided = {n.op: n.dtype for n in report.nodes}
    assert decided == {"relax.sort": "float32", "relax.argmax": "float32"}
    assert str(out["main"].ret_ty.fields[0].dtype) == "bfloat16"  # the model's output dtype
    data = rng.standard_normal((8, 64)).astype(ml_dtypes.bfloat16)
    sorted_, index = tvmamp.build(mod, "O0", "llvm")(data)
    want = np.exp(data.astype("float32")).astype(ml_dtypes.bfloat16).astype("float64")
    np.testing.assert_array_equal(np.asarray(index), want.argmax(-1))
    np.testing.assert_allclose(np.asarray(sorted_, "float64"), np.sort(want, -1), rtol=1e-2)
    fp32, _ = run(MLP, "O0")
    tvm.ir.assert_structural_equal(fp32, MLP)


def _router(columns, returned=False):
    """``topk(softmax(x @ w + b))``, a MoE router (``returned``: the logits are a result too)."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((16, 64), "float32"))
    w = relax.Var("w", relax.TensorType((64, columns), "float32"))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            logits = bb.emit(relax.op.add(relax.op.matmul(x, w), relax.const(0.1, "float32")))
            scores = bb.emit(relax.op.nn.softmax(logits, axis=-1))
            top = bb.emit(relax.op.topk(scores, 2, axis=-1, ret_type="both", dtype="int64"))
            out = [top, logits] if returned else [top]
            result = bb.emit_output(relax.Tuple(out))
        bb.emit_func_output(result)
    return bb.get()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_router_that_only_chooses_runs_fp32(level):
    """A MoE router's GEMM feeds only a topk: rounded low, near-equal logits swapped experts
    (tiny Mixtral: 36x autocast's error); it runs fp32, and so does its bias add."""
    _, report = run(_router(8), level, "bfloat16")
    decided = {n.op: (n.dtype, n.reason) for n in report.nodes}
    assert decided["relax.matmul"] == ("float32", "decision")
    assert decided["relax.add"][0] == "float32"


@pytest.mark.parametrize(
    "columns, returned, level",
    [(8, True, "O1"), (4096, False, "O1"), (8, False, "O3")],
    ids=["logits returned", "a vocabulary", "O3"],
)
def test_other_gemms_before_a_topk_stay_low(columns, returned, level):
    _, report = run(_router(columns, returned), level, "bfloat16")
    assert {n.op: n.dtype for n in report.nodes}["relax.matmul"] == "bfloat16"


_BIAS = np.linspace(-1.0, 1.0, 16, dtype="float32")


def _scale_and_bias():
    @I.ir_module
    class Module:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 16), "float32")):
            with R.dataflow():
                y = R.matmul(x, w)
                h = R.multiply(y, R.const(0.5, "float32"))
                z = R.add(h, R.const(_BIAS))
                R.output(z)
            return z

    return Module


def test_o1_an_fp32_parameter_promotes_a_follow_op_a_scalar_does_not():
    """As in Paddle's O1 and torch autocast's type promotion, ``h + b`` with an fp32 parameter
    ``b`` runs in fp32; a scalar (a Python number there) does not promote. Before, constants
    never decided: MobileBERT's NoNorm (``x * w + b``) kept its residual stream in bf16 at O1,
    3.8x autocast's error (4.3e-3 against 1.1e-3; 8.7e-4 now)."""

    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 16), "float32")):
            with R.dataflow():
                x16 = R.astype(x, "float16")
                w16 = R.astype(w, "float16")
                y = R.matmul(x16, w16, out_dtype="float32")
                y16 = R.astype(y, "float16")
                h = R.multiply(y16, R.const(0.5, "float16"))
                h32 = R.astype(h, "float32")
                z = R.add(h32, R.const(_BIAS))
                R.output(z)
            return z

    out, _ = run(_scale_and_bias(), "O1")
    tvm.ir.assert_structural_equal(out, Expected)


def test_o2_a_parameter_converts_to_the_low_dtype():
    @I.ir_module
    class Expected:
        @R.function
        def main(x: R.Tensor((4, 8), "float32"), w: R.Tensor((8, 16), "float32")):
            with R.dataflow():
                x16 = R.astype(x, "float16")
                w16 = R.astype(w, "float16")
                y = R.matmul(x16, w16, out_dtype="float32")
                y16 = R.astype(y, "float16")
                h = R.multiply(y16, R.const(0.5, "float16"))
                z = R.add(h, R.const(_BIAS.astype("float16")))
                z32 = R.astype(z, "float32")
                R.output(z32)
            return z32

    out, _ = run(_scale_and_bias(), "O2")
    tvm.ir.assert_structural_equal(out, Expected)


def test_o2_extends_a_returned_fp32_cache_in_fp32():
    """``present = concat(past, new)``, returned and read through slices by a GEMM (a
    decoder's key-value cache with an fp32 interface): at O2 the concatenation and its views
    stay fp32, and the GEMM casts its slice. Run low, the caller's cache was rounded to low
    and widened back to be returned, every step. A concatenation that is not returned, or
    that extends no input of the function, follows the policy."""

    @I.ir_module
    class Before:
        @R.function
        def main(
            x: R.Tensor((1, 8), "float32"),
            past: R.Tensor((2, "n", 8), "float32"),
            w: R.Tensor((8, 16), "float32"),
        ):
            R.func_attr({"num_input": 2})
            with R.dataflow():
                kv = R.reshape(R.matmul(x, w), R.shape([2, 1, 8]))
                present = R.concat((past, kv), axis=1)
                keys = R.squeeze(R.strided_slice(present, [0], [0], [1]), [0])
                scores = R.matmul(x, R.permute_dims(keys))
                twice = R.concat((x, x), axis=1)
                doubled = R.concat((w, w), axis=0)  # returned, extends a weight: no input
                out = R.matmul(twice, doubled)
                R.output(scores, present, out, doubled)
            return (scores, present, out, doubled)

    _, report = run(Before, "O2", "bfloat16")
    decided = {n.op + " " + n.node: (n.dtype, n.reason) for n in report.nodes}
    kept = [k for k, (dtype, reason) in decided.items() if reason == "fp32_cache"]
    ops = sorted(k.split()[0] for k in kept)
    assert ops == ["relax.concat", "relax.permute_dims", "relax.squeeze", "relax.strided_slice"]
    assert all(decided[k][0] == "float32" for k in kept)
    others = [v for k, v in decided.items() if k.startswith("relax.concat") and k not in kept]
    assert others == [("bfloat16", "policy")] * 2
    # the returned cache is cast back from nothing: no cast of ``present`` in the result
    _, low_io = run(Before, "O2", "bfloat16", keep_io_types=False)
    assert not [n for n in low_io.nodes if n.reason == "fp32_cache"]
