"""tvmamp: automatic mixed precision (fp16/bf16) compiler stack on Apache TVM Relax."""

from tvmamp import debugging, training
from tvmamp.conversion import Converted, convert
from tvmamp.driver import build
from tvmamp.executable import Executable
from tvmamp.frontends import from_onnx, from_torch
from tvmamp.lists import get_black_list, get_white_list
from tvmamp.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale
from tvmamp.policy import LEVELS, LOW_DTYPES, Category, Policy
from tvmamp.relay_passes import AmpReport, AutoMixedPrecision
from tvmamp.search import ErrorBudget, PrecisionPlan, search_precision
from tvmamp.tuning import RPC, load_tuning_log, tune

__version__ = "0.1.0"

__all__ = [
    "LEVELS",
    "LOW_DTYPES",
    "NoOpLossScale",
    "AmpReport",
    "AutoMixedPrecision",
    "Category",
    "Converted",
    "DynamicLossScale",
    "ErrorBudget",
    "Executable",
    "Policy",
    "PrecisionPlan",
    "RPC",
    "StaticLossScale",
    "build",
    "convert",
    "debugging",
    "from_onnx",
    "from_torch",
    "get_black_list",
    "get_white_list",
    "load_tuning_log",
    "search_precision",
    "training",
    "tune",
]
