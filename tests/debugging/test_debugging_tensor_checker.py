"""The tensor checker: an instrumented build that finds NaN/Inf op by op, and costs nothing off."""

import re

import numpy as np
import pytest
import tvm
from tvm import relax

import tvmamp
from tvmamp import debugging, models
from tvmamp.debugging import DebugMode, TensorCheckerConfig
from tvmamp.pipeline import compile_converted, instrumentation_hooks


@pytest.fixture(autouse=True)
def _checker_off():
    yield
    debugging.disable_tensor_checker()
    assert not instrumentation_hooks()


def exp_model():
    """x -> multiply(x, x) -> exp -> add x: with exp forced to fp16, exp(12.25) overflows."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4,), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            y = bb.emit(relax.op.multiply(x, x))
            z = bb.emit(relax.op.exp(y))
            out = bb.emit_output(relax.op.add(z, x))
        bb.emit_func_output(out)
    return bb.get()


def build_exp(**config):
    config = TensorCheckerConfig(True, **config)
    debugging.enable_tensor_checker(config)
    exe = tvmamp.build(exp_model(), level="O1", dtype="float16", custom_white_list=["exp"])
    return config, exe


SAFE = np.array([1.0, 2.0, 2.5, 0.5], "float32")
PLANTED = np.array([1.0, 2.0, 2.5, 3.5], "float32")  # exp(3.5 ** 2) > 65504


def test_abort_raises_naming_the_exp_op(capsys):
    config, exe = build_exp()
    np.testing.assert_allclose(exe(SAFE), np.exp(SAFE * SAFE) + SAFE, rtol=1e-2)
    assert config.findings == []
    with pytest.raises(
        RuntimeError, match=r"op exp \(tensor lv1 in main\) produced 0 NaN and 1 Inf"
    ):
        exe(PLANTED)
    assert [f.op for f in config.findings] == ["exp"]
    assert "op=exp, tensor=lv1, dtype=fp16], numel=4, num_nan=0, num_inf=1" in (
        capsys.readouterr().err
    )


def test_check_nan_inf_reports_and_continues():
    config, exe = build_exp(debug_mode=DebugMode.CHECK_NAN_INF)
    out = exe(PLANTED)
    assert np.isinf(out[3]) and np.isfinite(out[:3]).all()
    assert [(f.op, f.dtype, f.num_inf) for f in config.findings] == [
        ("exp", "float16", 1),
        ("astype", "float32", 1),
        ("add", "float32", 1),
    ]


def test_overflow_mode_reports_fp32_values_beyond_fp16(tmp_path):
    config, exe = build_exp(debug_mode="CHECK_ALL_FOR_OVERFLOW", output_dir=tmp_path)
    exe(np.array([1.0, 2.0, 300.0, 0.5], "float32"))  # 300 ** 2 > 65504 in the fp32 multiply
    first = config.findings[0]
    assert (first.op, first.dtype, first.num_overflow, first.num_inf) == (
        "multiply",
        "float32",
        1,
        0,
    )
    log = (tmp_path / "tensor_checker.log").read_text().splitlines()
    assert log[0].startswith("[PRECISION] [WARNING] in [device=cpu:0, op=multiply")


def test_check_all_op_lists_and_debug_step():
    config, exe = build_exp(
        debug_mode=DebugMode.CHECK_ALL, checked_op_list=["exp", "add"], debug_step=(1, 2)
    )
    exe(SAFE)  # call 0: outside debug_step
    assert config.findings == []
    exe(SAFE)
    assert [f.op for f in config.findings] == ["exp", "add"]
    exe(PLANTED)  # call 2: outside again
    assert len(config.findings) == 2
    config, exe = build_exp(debug_mode=DebugMode.CHECK_ALL, skipped_op_list=["exp", "astype"])
    exe(PLANTED)
    assert [f.op for f in config.findings] == ["multiply", "add"]


def test_bad_config_values_are_value_errors():
    with pytest.raises(ValueError, match="unknown op name 'expp'"):
        TensorCheckerConfig(True, checked_op_list=["expp"])
    with pytest.raises(ValueError, match="debug_step \\(3, 1\\) must be"):
        TensorCheckerConfig(True, debug_step=(3, 1))
    with pytest.raises(TypeError, match="expected a TensorCheckerConfig"):
        debugging.enable_tensor_checker({"enable": True})


def llvm_ir(exe):
    """The generated LLVM IR, with the object addresses LLVM writes in TBAA names blanked."""
    return re.sub(r"0x[0-9a-f]+", "0x_", exe.get_source("ll"))


def test_checker_off_builds_the_same_module(rng):
    mod, params = models.simple_net(batch=2, hidden=16, layers=2)
    plain = tvmamp.build(mod, level="O1", dtype="float16", params=params)
    with debugging.tensor_checker(TensorCheckerConfig(True)):
        checked = tvmamp.build(mod, level="O1", dtype="float16", params=params)
    after = tvmamp.build(mod, level="O1", dtype="float16", params=params)
    assert "tvmamp.debugging.check_tensor" in checked.vm_exec.as_text()
    assert llvm_ir(checked) != llvm_ir(plain)
    assert after.vm_exec.as_text() == plain.vm_exec.as_text()
    assert llvm_ir(after) == llvm_ir(plain)
    debugging.enable_tensor_checker(TensorCheckerConfig(enable=False))
    assert not instrumentation_hooks()  # a disabled config registers nothing
    x = rng.standard_normal((2, 16)).astype("float32")
    np.testing.assert_array_equal(checked(x), plain(x))


def test_checker_works_inside_a_training_step():
    """A gradient function compiled through compile_converted, as the Trainer compiles its step."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((4, 8), "float32"))
    w = relax.Var("w", relax.TensorType((8, 8), "float32"))
    with bb.function("loss", [x, w]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, w))
            out = bb.emit_output(relax.op.sum(relax.op.multiply(y, y)))
        bb.emit_func_output(out)
    mod = bb.get()
    mod = relax.transform.Gradient("loss", require_grads=[mod["loss"].params[1]])(mod)
    converted = tvmamp.convert(mod, level="O3", dtype="float16")
    config = TensorCheckerConfig(True, debug_mode=DebugMode.CHECK_NAN_INF)
    with debugging.tensor_checker(config):
        exe = compile_converted(converted)
        loss_adjoint = exe.vm["loss_adjoint"]
        x, w = np.full((4, 8), 0.1, "float32"), np.eye(8, dtype="float32")
        # VM functions take 64-byte aligned TVM tensors (numpy memory is often less aligned)
        loss, (grad,) = loss_adjoint(tvm.runtime.tensor(x), tvm.runtime.tensor(w))
        assert config.findings == []
        loss_adjoint(
            tvm.runtime.tensor(np.full((4, 8), 30.0, "float32")), tvm.runtime.tensor(w * 10)
        )
    assert (config.findings[0].func, config.findings[0].op) == ("loss_adjoint", "multiply")


def test_checker_and_loss_scale_plot_with_the_trainer(tmp_path, rng):
    """The Trainer's compiled train_step is checked, its inlined adjoint included."""
    training = pytest.importorskip("tvmamp.training")
    mod, params = models.simple_net(batch=4, hidden=8, layers=2)
    config = TensorCheckerConfig(True, debug_mode=DebugMode.CHECK_NAN_INF, debug_step=(2, 4))
    found_after_step = []
    with debugging.tensor_checker(config):
        trainer = training.Trainer(mod, "mse", level="O1", dtype="float16", params=params)
        for step in range(6):
            x = rng.standard_normal((4, 8)).astype("float32")
            x[1, 2] = np.inf if step % 2 else x[1, 2]  # inf at steps 1, 3 and 5
            trainer.step(x, rng.standard_normal((4, 8)).astype("float32"))
            found_after_step.append(len(config.findings))
    assert found_after_step[:3] == [0, 0, 0] and found_after_step[3] > 0  # only step 3 checked
    assert found_after_step[5] == found_after_step[3]
    first = config.findings[0]
    assert (first.func, first.op, first.num_inf) == ("train_step", "astype", 1)
    assert [h["skipped"] for h in trainer.history] == [False, True] * 3
    png = debugging.plot_loss_scale(trainer.history, tmp_path / "scale.png")
    assert open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
