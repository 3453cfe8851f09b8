"""Inputs that are not 64-byte aligned: every way into the VM copies them, nothing crashes.

TVM's CPU kernels load their arguments with aligned vector moves, and TVM 0.27 passes a numpy
array to a VM function without a copy; a numpy view 8 bytes past a 64-byte boundary crashed the
process (SIGSEGV). The end-to-end checks run in a subprocess, so a crash fails the test instead
of killing the pytest run.
"""

import inspect
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tvm
import tvm_ffi

from tvmamp.executable import ALIGNMENT, aligned_input


def misaligned(shape, offset=8, seed=0):
    """A float32 array (random, non-zero) whose data starts ``offset`` bytes past 64 bytes."""
    n = int(np.prod(shape))
    buf = np.empty(n * 4 + 128, np.uint8)
    start = (-buf.ctypes.data) % 64 + offset
    out = buf[start : start + n * 4].view(np.float32).reshape(shape)
    out[...] = np.random.default_rng(seed).uniform(0.5, 1.5, shape)
    if out.ctypes.data % 64 != offset:
        raise RuntimeError(f"misaligned: got offset {out.ctypes.data % 64}, wanted {offset}")
    return out


def run_isolated(body: str) -> None:
    """Run ``body`` in a fresh interpreter; a signal or an error fails the test with its output."""
    helper = "import numpy as np\n" + inspect.getsource(misaligned)
    code = helper + textwrap.dedent(body) + "\nprint('ok')\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), (
        f"exit code {result.returncode} (negative: killed by signal {-result.returncode})\n"
        f"{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    )


def test_misaligned_helper_makes_misaligned_views():
    assert misaligned((16, 64)).ctypes.data % 64 == 8
    assert misaligned((3,), offset=32).ctypes.data % 64 == 32


@pytest.mark.parametrize("offset", [4, 8, 32])
def test_aligned_input_copies_a_misaligned_numpy_array(offset):
    x = misaligned((4, 16), offset=offset)
    t = aligned_input(x, tvm.cpu(0))
    assert isinstance(t, tvm.runtime.Tensor) and t.data_ptr() % ALIGNMENT == 0
    np.testing.assert_array_equal(t.numpy(), x)


def test_aligned_input_copies_misaligned_and_strided_tensors_and_keeps_aligned_ones():
    dev = tvm.cpu(0)
    x = misaligned((4, 16))
    view = tvm_ffi.from_dlpack(x)  # a TVM tensor sharing the misaligned memory
    assert view.data_ptr() % ALIGNMENT == 8
    copied = aligned_input(view, dev)
    assert copied.data_ptr() % ALIGNMENT == 0
    np.testing.assert_array_equal(copied.numpy(), x)
    strided = tvm_ffi.from_dlpack(np.ascontiguousarray(x)[:, ::2])
    compact = aligned_input(strided, dev)
    assert compact.is_contiguous() and compact.data_ptr() % ALIGNMENT == 0
    np.testing.assert_array_equal(compact.numpy(), x[:, ::2])
    aligned = tvm.runtime.tensor(x, dev)
    assert aligned_input(aligned, dev) is aligned  # no copy when nothing is wrong
    nested = aligned_input((x, [x, 3]), dev)
    assert isinstance(nested, tuple) and isinstance(nested[1], list) and nested[1][1] == 3
    assert all(t.data_ptr() % ALIGNMENT == 0 for t in (nested[0], nested[1][0]))


def test_aligned_input_copies_a_misaligned_torch_tensor():
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(misaligned((4, 16)))
    assert x.data_ptr() % ALIGNMENT == 8
    t = aligned_input(x, tvm.cpu(0))
    assert t.data_ptr() % ALIGNMENT == 0
    np.testing.assert_array_equal(t.numpy(), x.numpy())


def test_misaligned_inputs_through_exe_and_exe_vm_do_not_crash():
    """exe(...), exe.vm[...] with numpy / TVM / torch views, time_evaluator and set_input."""
    run_isolated(
        """
        import tvm, tvm_ffi, tvmamp
        from tvm import relax
        bb = relax.BlockBuilder()
        x = relax.Var("x", relax.TensorType((64, 256), "float32"))
        with bb.function("main", [x]):
            with bb.dataflow():
                out = bb.emit_output(relax.op.add(relax.op.multiply(x, x), x))
            bb.emit_func_output(out)
        exe = tvmamp.build(bb.get(), level="O0")
        a = misaligned((64, 256))
        want = a * a + a
        np.testing.assert_allclose(exe(a), want, rtol=1e-6)
        main = exe.vm["main"]
        np.testing.assert_allclose(main(a).numpy(), want, rtol=1e-6)
        np.testing.assert_allclose(main(tvm_ffi.from_dlpack(a)).numpy(), want, rtol=1e-6)
        import torch
        np.testing.assert_allclose(main(torch.from_numpy(a)).numpy(), want, rtol=1e-6)
        assert exe.vm.time_evaluator("main", exe.device, number=1, repeat=2)(a).mean > 0
        exe.vm.set_input("main", tvm_ffi.from_dlpack(a))
        exe.vm.invoke_stateful("main")
        np.testing.assert_allclose(exe.vm.get_outputs("main").numpy(), want, rtol=1e-6)
        """
    )


def test_misaligned_inputs_through_the_trainer_do_not_crash():
    """Trainer.step and Trainer.gradients match the same step on aligned copies of the data."""
    run_isolated(
        """
        from tvmamp import models, training
        mod, params = models.simple_net(batch=8, hidden=64, layers=2)
        x, y = misaligned((8, 64), seed=1), misaligned((8, 64), offset=40, seed=2)
        runs = []
        for data in ((x, y), (x.copy(), y.copy())):
            trainer = training.Trainer(mod, "mse", level="O1", dtype="float16", params=params)
            grads = trainer.gradients(*data)
            runs.append(([trainer.step(*data) for _ in range(3)], grads))
        assert np.isfinite(runs[0][0]).all() and runs[0][0] == runs[1][0]
        for name, g in runs[0][1].items():
            np.testing.assert_array_equal(g, runs[1][1][name])
        """
    )
