"""CPU targets the tests force whatever the host, built so that every host with their features
runs them.

LLVM's AMD models (``znver*``) use sse4a's ``insertq`` for byte shuffles, an instruction no Intel
CPU has: a torch attention's mask kernel built for ``znver4`` stopped an Emerald Rapids with
SIGILL (2026-11-28). The tests force ``znver4`` for its kernels (``vdpbf16ps`` without AMX) and
run them on Intel hosts too, so they turn sse4a off.
"""

from __future__ import annotations

import tvm

from tvmamp.targets.cpu_features import host_cpu_features, target_cpu_features


def forced(mcpu: str, cores: int | None = None) -> dict:
    """The LLVM target dict for ``mcpu`` (AMD's models without sse4a), with ``cores`` cores."""
    target = {"kind": "llvm", "mcpu": mcpu}
    if mcpu.startswith("znver"):
        target["mattr"] = ["-sse4a"]
    if cores is not None:
        target["num-cores"] = cores
    return target


def forced_str(mcpu: str, cores: int | None = None) -> str:
    """:func:`forced` as a tvmamp target string: ``llvm -mcpu=znver4 -mattr=-sse4a ...``."""
    target = forced(mcpu, cores)
    words = ["llvm", f"-mcpu={mcpu}"]
    words += [f"-mattr={','.join(target['mattr'])}"] if "mattr" in target else []
    words += [f"-num-cores={cores}"] if cores is not None else []
    return " ".join(words)


def runs_here(target) -> bool:
    """Whether this host has every CPU feature the code built for ``target`` may use."""
    host = host_cpu_features()
    features = target_cpu_features(tvm.target.Target(target))
    return host is not None and set(features) <= host
