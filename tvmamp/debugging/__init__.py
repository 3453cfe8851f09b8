"""tvmamp.debugging: operator statistics, the NaN/Inf tensor checker and accuracy comparison.

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
from .dump import OpDump, OpRecord, record_op_outputs
from .numerics import DebugMode, Finding, check_layer_numerics, check_numerics, tensor_stats
from .operator_stats import (
    OperatorStats,
    collect_operator_stats,
    disable_operator_stats_collection,
    enable_operator_stats_collection,
    operator_stats_collection,
    static_operator_stats,
)
from .plots import plot_accuracy, plot_loss_scale

__all__ = [
    "AccuracyReport",
    "DebugMode",
    "Finding",
    "OpDump",
    "OpError",
    "OpRecord",
    "OperatorStats",
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
    "operator_stats_collection",
    "plot_accuracy",
    "plot_loss_scale",
    "record_op_outputs",
    "static_operator_stats",
    "tensor_checker",
    "tensor_stats",
]
