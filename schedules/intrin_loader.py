"""Register only the TVM tensor intrinsics of one target family, not TVM's whole catalogue."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys

# ``import tvm.s_tir.tensor_intrin`` (done by every meta_schedule TuneContext and builder worker)
# registers the intrinsics of every vendor; on this machine that costs 15 s to minutes of CPU,
# nearly all of it in the CUDA, ROCm and Hexagon modules. The schedule rules of one target use
# only its own family (its target entry's ``intrinsic_families``), so tuning and the rules that
# need TVM's intrinsics import just that family under an unexecuted package module.
PACKAGE = "tvm.s_tir.tensor_intrin"


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
