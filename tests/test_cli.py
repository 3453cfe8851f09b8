"""The tvmamp command line: demo, compile then run, and clear errors."""

import subprocess
import sys

import numpy as np
import pytest

import tvmamp
from tvmamp import models
from tvmamp.cli import main


def test_demo_prints_the_table(capsys):
    assert (
        main(
            [
                "demo",
                "--batch",
                "4",
                "--hidden",
                "32",
                "--layers",
                "3",
                "--repeat",
                "2",
                "--target",
                "llvm -num-cores=1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for level in ("O0", "O1", "O2"):
        assert f"\n{level} " in out
    assert "max rel err" in out and "median ms" in out


def test_compile_then_run_matches_the_python_api(tmp_path, capsys):
    lib, x_path, out_path = tmp_path / "m.so", tmp_path / "x.npy", tmp_path / "out.npy"
    args = [
        "compile",
        "transformer",
        "--level",
        "O2",
        "--dtype",
        "bfloat16",
        "--target",
        "llvm -num-cores=1",
        "--black",
        "gelu",
        "-o",
        str(lib),
    ]
    assert main(args) == 0
    assert "casts inserted" in capsys.readouterr().out
    mod, params = models.transformer_layer()
    x = models.example_inputs(mod)[0]
    np.save(x_path, x)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tvmamp",
            "run",
            str(lib),
            "--inputs",
            str(x_path),
            "-o",
            str(out_path),
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert "output 0: shape (2, 16, 64)" in result.stdout
    exe = tvmamp.build(
        mod, "O2", "llvm -num-cores=1", dtype="bfloat16", params=params, custom_black_list=["gelu"]
    )
    np.testing.assert_allclose(np.load(out_path), exe(x), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["compile", "nosuchmodel", "-o", "x.so"], "cannot load model 'nosuchmodel'"),
        (["compile", "missing.json", "-o", "x.so"], "no such model file"),
        (["compile", "simplenet", "--level", "O9", "-o", "x.so"], "level 'O9' is not one of"),
        (["run", "missing.so", "--inputs", "x.npy"], "no such file"),
        (["compile", "simplenet", "-o", "/nonexistent/dir/x.so"], "does not exist"),
        # TVM's CPU list lookup segfaulted on an unknown triple
        (["stats", "simplenet", "--target", "llvm -mtriple=garbage"], "names no architecture"),
        (["stats", "simplenet", "--target", "llvm -num-cores=0"], "not a positive number"),
        # TVM's thread pool aborted the process
        (["profile", "simplenet", "--threads", "100000"], "is not between 1 and"),
        # an ImportError escaped as a traceback
        (["stats", "nosuchmodule:build"], "nosuchmodule"),
        # these failed after the compile, in the linker or TVM's .tar export
        (["compile", "simplenet", "-o", "."], "names no file"),
        (["compile", "simplenet", "-o", "model.tar"], "must end in .so"),
    ],
)
def test_errors_are_reported_without_a_traceback(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_run_output_names_what_it_writes(tmp_path, capsys):
    """``-o out.txt`` printed "wrote out.txt" and wrote out.txt.npy; ``-o x.npy`` kept the
    first of several outputs and dropped the others."""
    from tvmamp.commands.run import _save

    library = tmp_path / "m.so"
    library.write_bytes(b"")
    argv = ["run", str(library), "--inputs", "x.npy", "-o", str(tmp_path / "out.txt")]
    assert main(argv) == 2
    assert "must end in .npy (one output) or .npz" in capsys.readouterr().err
    outputs = [np.ones(2, "float32"), np.zeros(3, "float32")]
    with pytest.raises(ValueError, match="has 2 outputs"):
        _save(str(tmp_path / "y.npy"), outputs)
    _save(str(tmp_path / "y.npz"), outputs)
    np.testing.assert_array_equal(np.load(tmp_path / "y.npz")["arr_1"], outputs[1])


def _embedding_model(batch):
    """ids (int64, [batch, 5]) -> embedding -> mean -> linear."""
    from tvm import relax

    bb = relax.BlockBuilder()
    ids = relax.Var("ids", relax.TensorType((batch, 5), "int64"))
    table = relax.const(np.random.default_rng(0).standard_normal((8, 4)).astype("float32"))
    with bb.function("main", [ids]):
        with bb.dataflow():
            rows = bb.emit(relax.op.take(table, ids, axis=0))
            out = bb.emit_output(relax.op.mean(rows, axis=[1]))
        bb.emit_func_output(out)
    return bb.get()


def test_example_inputs_follow_the_input_dtypes():
    """Integer inputs get small non-negative integers (token ids any vocabulary accepts)."""
    (ids,) = models.example_inputs(_embedding_model(3))
    assert ids.dtype == np.int64 and ids.shape == (3, 5)
    assert ids.min() >= 0 and ids.max() < 8
    tvmamp.build(_embedding_model(3), "O2", "llvm")(ids)  # runs, no dtype error


def test_example_inputs_name_a_symbolic_input():
    from tvm import tirx

    with pytest.raises(ValueError, match=r"input 'ids' has shape \[n, 5\].*--input-shape"):
        models.example_inputs(_embedding_model(tirx.Var("n", "int64")))


def bf16_model():
    """A factory for ``file.py:function``: ``x`` (bfloat16, [2, 3]) -> ``(x * 2, x[:0])``."""
    from tvm import relax

    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((2, 3), "bfloat16"))
    with bb.function("main", [x]):
        with bb.dataflow():
            twice = bb.emit(relax.op.multiply(x, relax.const(2.0, "bfloat16")))
            empty = bb.emit(relax.op.strided_slice(x, axes=[0], begin=[0], end=[0]))
            out = bb.emit_output(relax.Tuple([twice, empty]))
        bb.emit_func_output(out)
    return bb.get()


def test_run_takes_bfloat16_and_names_what_does_not_fit(tmp_path, capsys):
    """numpy stores bfloat16 as 2-byte void values, which TVM refused ("unknown dtype |V2");
    an empty output failed on its minimum; a wrong input gave TVM's bare check."""
    import ml_dtypes

    library = tmp_path / "m.so"
    assert main(["compile", f"{__file__}:bf16_model", "--level", "O0", "-o", str(library)]) == 0
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(ml_dtypes.bfloat16)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "f.npy", x.astype("float32"))
    out = tmp_path / "out.npz"
    capsys.readouterr()
    assert main(["run", str(library), "--inputs", str(tmp_path / "x.npy"), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "output 1: shape (0, 3) dtype bfloat16 (empty)" in printed
    assert "bfloat16 written as float32" in printed
    np.testing.assert_array_equal(np.load(out)["arr_0"], x.astype("float32") * 2)
    for inputs, message in [
        (["f.npy"], "main(x) failed on the inputs float32[2, 3]"),
        (["x.npy", "x.npy"], "main takes 1 inputs (x)"),
    ]:
        paths = [str(tmp_path / name) for name in inputs]
        assert main(["run", str(library), "--inputs", *paths]) == 2
        assert message in capsys.readouterr().err
