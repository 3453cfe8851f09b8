"""``tvmamp compile`` on ONNX, .pt2, TorchScript and factories, then ``tvmamp run``; CLI errors."""

import subprocess
import sys

import numpy as np
import pytest

import tvmamp
from tvmamp import suite
from tvmamp.cli import build_parser, main
from tvmamp.frontends import from_onnx

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
from tvmamp.suite.onnx_models import zoo_style  # noqa: E402

TARGET = "llvm -num-cores=1"
FLAGS = ["--level", "O2", "--dtype", "bfloat16", "--target", TARGET]


def _run_cli(*args):
    """``python -m tvmamp`` in a fresh process: the deployed path, without the test's imports."""
    return subprocess.run(
        [sys.executable, "-m", "tvmamp", *map(str, args)],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )


def test_onnx_compile_then_run_matches_the_python_api(tmp_path, capsys):
    model_path, lib = tmp_path / "cnn.onnx", tmp_path / "cnn.so"
    model = suite.create("onnx_cnn", image_size=16)
    onnx.save(model, model_path)
    argv = ["compile", model_path, "--input-shape", "image=2,3,16,16", *FLAGS, "-o", lib]
    assert main(list(map(str, argv))) == 0
    captured = capsys.readouterr()
    assert "casts inserted" in captured.out and "main(image: float32[2x3x16x16])" in captured.out
    assert "[compile 3/4] compiling" in captured.err
    x = suite.example_inputs("onnx_cnn", batch=2, image_size=16)[0]
    np.savez(tmp_path / "inputs.npz", image=x)
    result = _run_cli("run", lib, "--inputs", tmp_path / "inputs.npz", "-o", tmp_path / "y.npy")
    assert "output 0: shape (2, 10) dtype float32" in result.stdout
    mod, params = from_onnx(model, shape_dict={"image": (2, 3, 16, 16)})
    exe = tvmamp.build(mod, "O2", TARGET, dtype="bfloat16", params=params)
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), exe(x), rtol=1e-6, atol=1e-6)


def test_a_question_mark_keeps_the_onnx_batch_symbolic(tmp_path, capsys):
    """``--input-shape image=?,3,16,16``: the batch stays the model's own (symbolic), the
    rest is fixed; the library runs at two batch sizes (the option took positive ints only,
    so a symbolic dim could not be kept while fixing the others)."""
    model_path, lib = tmp_path / "cnn.onnx", tmp_path / "cnn.so"
    model = suite.create("onnx_cnn", image_size=16)
    onnx.save(model, model_path)
    argv = ["compile", model_path, "--input-shape", "image=?,3,16,16", *FLAGS, "-o", lib]
    assert main(list(map(str, argv))) == 0
    assert "main(image: float32[batchx3x16x16])" in capsys.readouterr().out
    mod, params = from_onnx(model, shape_dict={"image": (None, 3, 16, 16)})
    exe = tvmamp.build(mod, "O2", TARGET, dtype="bfloat16", params=params)
    for batch in (1, 3):
        x = suite.example_inputs("onnx_cnn", batch=batch, image_size=16)[0]
        np.save(tmp_path / "x.npy", x)
        run = ["run", lib, "--inputs", tmp_path / "x.npy", "-o", tmp_path / "y.npy"]
        assert main(list(map(str, run))) == 0
        np.testing.assert_allclose(np.load(tmp_path / "y.npy"), exe(x), rtol=1e-6, atol=1e-6)


def test_parse_input_shapes_question_marks():
    from tvmamp.frontends.files import parse_input_shapes, random_inputs

    assert parse_input_shapes(["ids=?,128", "2x?"]) == [("ids", (None, 128)), (None, (2, None))]
    with pytest.raises(ValueError, match="or \\? to keep"):
        parse_input_shapes(["ids=??,128"])
    with pytest.raises(ValueError, match="ids=\\?,128 has a \\? dimension"):
        random_inputs(parse_input_shapes(["ids=?,128"]), "tvmamp")


def test_compile_a_zoo_style_onnx_file(tmp_path):
    """An IR-3 file that lists its initializers in graph.input compiles, runs and is right."""
    model = suite.create("onnx_cnn", image_size=16)
    onnx.save(zoo_style(model), tmp_path / "zoo.onnx")
    argv = ["compile", tmp_path / "zoo.onnx", "--input-shape", "2,3,16,16", *FLAGS]
    assert main(list(map(str, [*argv, "-o", tmp_path / "zoo.so"]))) == 0
    x = suite.example_inputs("onnx_cnn", batch=2, image_size=16)[0]
    np.save(tmp_path / "x.npy", x)
    run = ["run", tmp_path / "zoo.so", "--inputs", tmp_path / "x.npy", "-o", tmp_path / "y.npy"]
    assert main(list(map(str, run))) == 0
    want = suite.reference(model, [x])
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=3e-2, atol=3e-2)


class TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, a, b):
        return self.fc(torch.tanh(a) * b)


def two_inputs():
    """A factory for ``module:function``: a module and its example inputs."""
    torch.manual_seed(0)
    return TwoInputs().eval(), (torch.randn(3, 16), torch.randn(3, 16))


def test_pt2_torchscript_and_factory_with_several_inputs(tmp_path, rng):
    module, example = two_inputs()
    a, b = (rng.standard_normal((3, 16)).astype("float32") for _ in range(2))
    np.save(tmp_path / "a.npy", a), np.save(tmp_path / "b.npy", b)
    with torch.no_grad():
        want = module(torch.from_numpy(a), torch.from_numpy(b)).numpy()
    torch.export.save(torch.export.export(module, example), tmp_path / "m.pt2")
    torch.jit.trace(module, example).save(tmp_path / "m.pt")
    shapes = ["--input-shape", "3,16", "--input-shape", "3,16"]
    for model, extra in [("m.pt2", []), ("m.pt", shapes), (f"{__file__}:two_inputs", [])]:
        lib, out = tmp_path / "m.so", tmp_path / "out.npy"
        assert (
            main(
                [
                    "compile",
                    str(tmp_path / model) if ".py:" not in model else model,
                    *extra,
                    *FLAGS,
                    "-o",
                    str(lib),
                ]
            )
            == 0
        )
        inputs = [str(tmp_path / "a.npy"), str(tmp_path / "b.npy")]
        assert main(["run", str(lib), "--inputs", *inputs, "-o", str(out)]) == 0
        np.testing.assert_allclose(np.load(out), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["compile", "missing.onnx", "-o", "x.so"], "no such model file 'missing.onnx'"),
        (["compile", "resnet18", "--input-shape", "1,3,x", "-o", "x.so"], "is not NAME=D0,D1"),
        (["compile", "resnet18", "--input-shape", "1,4,32,32", "-o", "x.so"], "does not fit"),
        (["run", "missing.so", "--inputs", "x.npy"], "no such file 'missing.so'"),
    ],
)
def test_errors_are_reported_without_a_traceback(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_model_and_unsupported_op_errors(tmp_path, capsys):
    (tmp_path / "bad.onnx").write_bytes(b"not an onnx model")
    (tmp_path / "bad.pt").write_bytes(b"not torchscript")
    det = onnx.helper.make_graph(
        [onnx.helper.make_node("Det", ["x"], ["y"])],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3, 3])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [])],
    )
    onnx.save(onnx.helper.make_model(det), tmp_path / "det.onnx")
    cases = [
        ("bad.onnx", "is not a valid ONNX model"),
        ("bad.pt", "is not a TorchScript archive"),
        ("det.onnx", "does not support the operators Det"),
    ]
    for name, message in cases:
        assert main(["compile", str(tmp_path / name), "-o", str(tmp_path / "x.so")]) == 2
        assert message in capsys.readouterr().err


def test_files_of_the_wrong_kind_are_named(tmp_path, capsys):
    """A checkpoint or TorchScript module saved as .pt2 printed torch's logged traceback and
    "check the warnings above"; JSON and numpy errors did not name the file."""
    module, example = two_inputs()
    torch.save(module.state_dict(), tmp_path / "weights.pt2")
    torch.jit.trace(module, example).save(tmp_path / "script.pt2")
    (tmp_path / "text.json").write_text("not json")
    (tmp_path / "text.npy").write_text("not numpy")
    (tmp_path / "m.so").write_bytes(b"")
    cases = [
        (["stats", tmp_path / "weights.pt2"], "it holds a torch.save checkpoint"),
        (["stats", tmp_path / "script.pt2"], "it holds a TorchScript module"),
        (["stats", tmp_path / "text.json"], "text.json' is not a module saved with tvm.ir"),
        (
            ["run", tmp_path / "m.so", "--inputs", tmp_path / "text.npy"],
            "is not a numpy .npy or .npz",
        ),
    ]
    for argv, message in cases:
        assert main([str(arg) for arg in argv]) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err
        assert "error: tvmamp" not in err  # the CLI's prefix is said once


def test_inspect_search_and_tune_take_input_shapes(tmp_path, capsys):
    """They told users of a TorchScript file to pass --input-shape, which they did not take."""
    module, example = two_inputs()
    torch.jit.trace(module, example).save(tmp_path / "m.pt")
    shapes = ["--input-shape", "3,16", "--input-shape", "3,16"]
    assert main(["inspect", str(tmp_path / "m.pt"), *shapes, "--target", TARGET]) == 0
    assert "casts inserted" in capsys.readouterr().out
    for command in (["search", "--inputs", "x.npz", "-o", "p.json"], ["tune"]):
        args = build_parser().parse_args([command[0], "m.pt", *shapes, *command[1:]])
        assert args.input_shape == ["3,16", "3,16"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["demo", "--batch", "0"], "argument --batch: 0 is less than 1"),
        (["demo", "--hidden", "x"], "argument --hidden: 'x' is not an integer"),
        (["run", "m.so", "--inputs", "x.npy", "--repeat", "-1"], "--repeat: -1 is less than 0"),
        (["tune", "simplenet", "--trials", "0"], "argument --trials: 0 is less than 1"),
    ],
)
def test_counts_are_checked_by_the_parser(argv, message, capsys):
    """``demo --batch 0`` failed with numpy's "zero-size array" after building."""
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err
