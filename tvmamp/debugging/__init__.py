"""tvmamp.debugging: operator statistics, the NaN/Inf tensor checker, accuracy comparison and the
per-kernel profile.

The compiler's form of ``paddle.amp.debugging``: what Paddle does with runtime hooks, tvmamp does
with instrumented builds (while a tool is enabled, an instrumentation hook of the pipeline inserts
a packed-function call after every selected op); with every tool off, builds are untouched.
"""

from .accuracy import AccuracyReport, OpError, compare_accuracy, compare_dumps
from .checker import (
    TensorCheckerConfig,
    disable_tensor_checker,
    enable_tensor_checker,
    tensor_checker,
)
from .costs import KernelCost, KernelCosts, kernel_cost_recording, kernel_costs
from .dump import OpDump, OpRecord, record_op_outputs
from .kernel_profile import KernelRecord, Profile, profile
from .numerics import DebugMode, Finding, check_layer_numerics, check_numerics, tensor_stats
from .operator_stats import (
    OperatorStats,
    collect_operator_stats,
    disable_operator_stats_collection,
    enable_operator_stats_collection,
    operator_stats_collection,
    static_operator_stats,
)
from .peaks import Peaks, measure_peaks
from .plots import plot_accuracy, plot_loss_scale

__all__ = [
    "AccuracyReport",
    "DebugMode",
    "Finding",
    "KernelCost",
    "KernelCosts",
    "KernelRecord",
    "OpDump",
    "OpError",
    "OpRecord",
    "OperatorStats",
    "Peaks",
    "Profile",
    "TensorCheckerConfig",
    "check_layer_numerics",
    "check_numerics",
    "collect_operator_stats",
    "compare_accuracy",
    "compare_dumps",
    "disable_operator_stats_collection",
    "disable_tensor_checker",
    "enable_operator_stats_collection",
    "enable_tensor_checker",
    "kernel_cost_recording",
    "kernel_costs",
    "measure_peaks",
    "operator_stats_collection",
    "plot_accuracy",
    "plot_loss_scale",
    "profile",
    "record_op_outputs",
    "static_operator_stats",
    "tensor_checker",
    "tensor_stats",
]
