"""Without the torch/onnx extras tvmamp still imports, and the frontends say how to install them."""

import subprocess
import sys

SCRIPT = """
import sys
sys.modules["torch"] = None  # make "import torch" fail as it does without the extra
sys.modules["onnx"] = None
import tvmamp, tvmamp.frontends, tvmamp.suite, tvmamp.frontends.model_spec, tvmamp.cli
from tvmamp.frontends import MissingExtraError, from_onnx, from_torch
for call, extra in ((lambda: from_torch(object(), ()), "torch"),
                    (lambda: from_onnx("m.onnx"), "onnx"),
                    (lambda: tvmamp.suite.create("resnet18"), "torch")):
    try:
        call()
    except MissingExtraError as err:
        assert isinstance(err, RuntimeError) and isinstance(err, ImportError)
        print(err)
    else:
        raise SystemExit("no error")
"""


def test_frontends_without_extras_name_the_pip_command():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 3
    assert "tvmamp.from_torch needs the 'torch' package" in lines[0]
    assert "pip install 'tvmamp[torch]'" in lines[0]
    assert "pip install 'tvmamp[onnx]'" in lines[1]
    assert "pip install 'tvmamp[torch]'" in lines[2]
