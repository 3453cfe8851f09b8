"""Frontends: PyTorch (torch.export) and ONNX models to a Relax IRModule plus named params.

torch and onnx are optional extras (``pip install 'tvmamp[torch,onnx]'``); they are imported
only when a frontend is called.
"""

from .common import MissingExtraError, UnsupportedOperatorError
from .onnx import from_onnx
from .torch import from_torch, import_exported_program

__all__ = [
    "MissingExtraError",
    "UnsupportedOperatorError",
    "from_onnx",
    "from_torch",
    "import_exported_program",
]
