"""Register only the tensor intrinsics a target needs, not TVM's whole catalogue."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import sys

from . import logfile

# ``import tvm.s_tir.tensor_intrin`` (done by every meta_schedule TuneContext and builder worker)
# registers the intrinsics of every vendor; on this machine that costs 15 s to minutes of CPU,
# nearly all of it in the CUDA, ROCm and Hexagon modules. The schedule rules of one target use
# only its own family, so tuning imports just that family under an unexecuted package module.
PACKAGE = "tvm.s_tir.tensor_intrin"


def families_for(target) -> tuple[str, ...] | None:
    """Submodules of ``tvm.s_tir.tensor_intrin`` that ``target``'s meta_schedule rules can name.

    Returns None when tvmamp does not know the target family (then the whole package is used).
    """
    kind = target.kind.name
    if kind == "llvm":
        triple = str(target.attrs.get("mtriple", ""))
        if triple.startswith(("aarch64", "arm")):
            return ("arm_cpu",)
        return ("riscv_cpu",) if triple.startswith("riscv") else ("x86",)
    if kind == "cuda":
        arch = str(target.attrs.get("arch", "sm_80")).removeprefix("sm_")
        digits = "".join(ch for ch in arch if ch.isdigit())
        # below sm_75 meta_schedule's CUDA rules use no tensor-core intrinsics
        return () if digits and int(digits) < 75 else ("cuda",)
    return ("rocm",) if kind == "rocm" else None


def load(families: tuple[str, ...] | None) -> None:
    """Import those intrinsic modules under a stub package (all of them when ``None``).

    Also the ``initializer`` of meta_schedule's builder processes, which import the package too.
    """
    if families is None:
        importlib.import_module(PACKAGE)
        return
    if PACKAGE not in sys.modules:
        module = importlib.util.module_from_spec(importlib.util.find_spec(PACKAGE))
        module._tvmamp_stub = True
        sys.modules[PACKAGE] = module
    for name in families:
        importlib.import_module(f"{PACKAGE}.{name}")


@contextlib.contextmanager
def only_target_intrinsics(families: tuple[str, ...] | None):
    """Within the block, ``import tvm.s_tir.tensor_intrin`` registers only ``families``.

    On exit the stub package is removed again, so later code in this process that imports the
    package gets TVM's real one (the submodules already imported are reused, not re-registered).
    """
    load(families)
    try:
        yield
    finally:
        if getattr(sys.modules.get(PACKAGE), "_tvmamp_stub", False):
            sys.modules.pop(PACKAGE)
            parent = sys.modules.get(PACKAGE.rsplit(".", 1)[0])
            if parent is not None and hasattr(parent, "tensor_intrin"):
                delattr(parent, "tensor_intrin")


# The names tvmamp's CPU schedules give the tensor intrinsics they register on first use
# (``x86_amx_intrin.amx_intrin``: one per reduction length and accumulator scope).
TVMAMP_INTRIN = re.compile(r"tvmamp_x86_amx_bf16_32x32x(\d+)_(local|global)")


def register_log_intrinsics(work_dir: str) -> None:
    """Register the tvmamp tensor intrinsics that the traces of a tuning log name.

    TVM replays every trace when it opens a log (and again when it applies one); a tensorize
    step whose intrinsic is not registered in this process would fail. tvmamp's bf16 kernels
    register theirs lazily, so a fresh process must do it before opening the log.
    """
    path = os.path.join(work_dir, logfile.RECORDS)
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    if "tvmamp_" not in text:
        return
    from tvmamp.schedules import x86_amx_intrin, x86_bf16_intrin

    x86_bf16_intrin.register()
    for k, scope in sorted(set(TVMAMP_INTRIN.findall(text))):
        x86_amx_intrin.amx_intrin(int(k), scope)
