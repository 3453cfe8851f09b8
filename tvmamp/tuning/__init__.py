"""Auto-scheduling with meta_schedule (XGBoost cost model) and tuning logs for deployment."""

from .loader import load_tuning_log
from .rpc import RPC
from .tuner import TaskResult, TuneResult, tune

__all__ = ["RPC", "TaskResult", "TuneResult", "load_tuning_log", "tune"]
