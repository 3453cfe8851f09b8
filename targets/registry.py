"""The target registry: what tvmamp knows about each target kind, and target spec parsing.

A :class:`TargetEntry` says what tvmamp needs to know about a kind of hardware: how to turn
the user's target spec into a TVM 0.27 target, the default and supported low dtypes, the ops
that cannot run low there, hardware checks, its pipeline phases, how it is tuned and which
generated sources it can show. Adding a target means adding a module to ``targets/`` that
calls :func:`register_target` (and its rules to ``schedules/``); code outside those two folders
asks the entry and never branches on kind names.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import shlex
from collections.abc import Callable, Mapping

import tvm


@dataclasses.dataclass(frozen=True)
class DesignSpace:
    """How ``tvmamp.tune`` searches one kernel.

    Attributes
    ----------
    name : str
        Recorded in the tuning log's manifest ("post-order-apply", "bf16-gemm:<digest>"); a
        target's own space changes its name when its candidates change, so that the loader
        does not replay a record of an older space.
    size : int or None
        How many distinct candidates the space holds, when the target knows; such a space is
        enumerated, each candidate measured once, and a task gets at most ``size`` trials.
    generator : callable or None
        ``(target) -> meta_schedule SpaceGenerator`` for a target-specific space; None for
        meta_schedule's own "post-order-apply" space searched by evolutionary search.
    """

    name: str
    size: int | None = None
    generator: Callable | None = None


# meta_schedule's own design space: its schedule rules for the target, evolutionary search.
DEFAULT_SPACE = DesignSpace("post-order-apply")


@dataclasses.dataclass(frozen=True)
class SourceFormat:
    """Where ``Executable.get_source(fmt)`` finds one format of generated code.

    Attributes
    ----------
    module_kind : str
        The kind of runtime module that holds the code ("llvm", "cuda").
    module_format : str
        The format asked of those modules' ``inspect_source``.
    convert : callable or None
        ``(target, text) -> str`` applied to the modules' text (CUDA source -> PTX), or None.
    """

    module_kind: str
    module_format: str
    convert: Callable | None = None


# Host code of every target kind is LLVM's: its assembly and LLVM IR.
LLVM_SOURCES = {"asm": SourceFormat("llvm", "asm"), "ll": SourceFormat("llvm", "ll")}


def _local_device(target: tvm.target.Target) -> tvm.runtime.Device:
    return tvm.device(target.get_target_device_type(), 0)


@dataclasses.dataclass(frozen=True)
class TargetEntry:
    """What tvmamp knows about one target kind.

    Parameters
    ----------
    name : str
        The name users write first in a target string ("llvm", "cuda", ...).
    make_target : callable
        ``(options: dict) -> tvm.target.Target`` from the parsed ``-key=value`` options.
    default_dtype : callable
        ``(target) -> str``: the low dtype used when the user gives none.
    check : callable
        ``(target, dtype) -> None``: warns or raises for unsupported hardware/dtype pairs.
    schedule_passes : callable
        ``(target) -> list[tvm.transform.Pass]``: run after legalize and fuse.
    unsupported_low_ops : callable
        ``(target, dtype) -> tuple[str, ...]``: ops that must stay fp32 on this target.
    partition_passes : callable
        ``(target, policy) -> list[tvm.transform.Pass]``: run after the AMP pass and before
        legalization (BYOC partitioning, layout rewrites).
    legalize_rules : callable
        ``(target) -> dict``: op name -> legalization, given to ``LegalizeOps`` over tvmamp's
        own (the CPU's norms, :mod:`tvmamp.relay_passes.row_norms`).
    fusion_passes : callable
        ``(target) -> list[tvm.transform.Pass]``: run between ``FuseOps`` and ``FuseTIR``, on
        the grouped kernels (merging a GEMM kernel with the softmax that reads its result).
    pass_config : callable
        ``(target) -> dict``: PassContext options the build needs (e.g. cp.async on sm_80+).
    finalize_passes : callable
        ``(target) -> list[tvm.transform.Pass]``: run last, on the VM-ready module (the CPU
        feature guard of :mod:`tvmamp.targets.cpu_guard`).
    device : callable
        ``(target) -> tvm.runtime.Device``: the device of this machine that runs the target's
        code (it may not exist here).
    source_formats : mapping
        ``Executable.get_source`` format name -> :class:`SourceFormat`.
    tuning_target : callable
        ``(target) -> (target, notes)``: the target meta_schedule tunes for (the target with
        what meta_schedule needs and the user's spec may lack) and notes on what was assumed.
    intrinsic_families : callable
        ``(target) -> tuple[str, ...] | None``: the submodules of ``tvm.s_tir.tensor_intrin``
        meta_schedule's rules for the target can name; None when not known (all of them).
    design_space : callable
        ``(mod, target) -> DesignSpace``: how a kernel (a one-PrimFunc module) is tuned.
    register_log_intrinsics : callable
        ``(records_text) -> None``: register the tvmamp tensor intrinsics that the traces of a
        tuning log (the text of its records file) name, before TVM replays them.
    tir_pipeline : callable
        ``(target) -> str``: the registered TIR pipeline (``tvm.tirx.register_tir_pipeline``)
        that ``tvm.compile`` lowers the kernels with; TVM's ``"default"`` unless the target
        needs its own (:mod:`tvmamp.targets.llvm_lowering`).
    meta_schedule_build : str
        The global function meta_schedule's ``LocalBuilder`` builds tuning candidates with, so
        that they are lowered as the final build lowers them.
    fp32_feeds : bool
        Whether O2 keeps follow ops that only feed fp32 ops in fp32 (``Policy.fp32_feeds``).
        False where every fp32 op falls back to a slower device (an fp16-only NPU).
    """

    name: str
    make_target: Callable
    default_dtype: Callable
    check: Callable
    schedule_passes: Callable
    unsupported_low_ops: Callable = lambda target, dtype: ()
    fp32_feeds: bool = True
    partition_passes: Callable = lambda target, policy: []
    legalize_rules: Callable = lambda target: {}
    fusion_passes: Callable = lambda target: []
    pass_config: Callable = lambda target: {}
    finalize_passes: Callable = lambda target: []
    device: Callable = _local_device
    source_formats: Mapping[str, SourceFormat] = dataclasses.field(
        default_factory=lambda: dict(LLVM_SOURCES)
    )
    tuning_target: Callable = lambda target: (target, [])
    intrinsic_families: Callable = lambda target: None
    design_space: Callable = lambda mod, target: DEFAULT_SPACE
    register_log_intrinsics: Callable = lambda records_text: None
    tir_pipeline: Callable = lambda target: "default"
    meta_schedule_build: str = "meta_schedule.builder.default_build"


REGISTRY: dict[str, TargetEntry] = {}


def register_target(entry: TargetEntry, *, override: bool = False) -> TargetEntry:
    """Add a target entry; refuses to replace an existing one unless ``override``."""
    if entry.name in REGISTRY and not override:
        raise ValueError(f"tvmamp.targets: target {entry.name!r} is already registered")
    REGISTRY[entry.name] = entry
    return entry


# Names users write for a target kind -> the registered entry's name.
TARGET_ALIASES = {"cpu": "llvm", "x86": "llvm", "gpu": "cuda", "nvidia": "cuda"}


def _split_spec(spec: str) -> tuple[str, dict]:
    """'llvm -mcpu=znver4 -num-cores=2' -> ('llvm', {'mcpu': 'znver4', 'num-cores': '2'})."""
    words = shlex.split(spec)
    if not words:
        raise ValueError("tvmamp: the target string is empty")
    options = {}
    for word in words[1:]:
        if not word.startswith("-"):
            raise ValueError(
                f"tvmamp: target option {word!r} in {spec!r} must look like -key=value"
            )
        key, _, value = word.lstrip("-").partition("=")
        options[key] = value if value else "true"
    return words[0], options


def _unknown_target(name: str) -> ValueError:
    choices = sorted(REGISTRY)
    close = difflib.get_close_matches(name, choices, n=3)
    hint = f" (did you mean {', '.join(close)}?)" if close else ""
    return ValueError(
        f"tvmamp: unknown target {name!r}{hint}; valid targets: {', '.join(choices)}, "
        "a TVM target JSON dict, or a tvm.target.Target"
    )


def _entry_for_kind(kind: str) -> TargetEntry:
    if kind not in REGISTRY:
        raise _unknown_target(kind)
    return REGISTRY[kind]


def resolve_target(target) -> tuple[tvm.target.Target, TargetEntry]:
    """Turn a user's target into a TVM target and its tvmamp entry.

    Accepts the familiar strings ("llvm", "llvm -mcpu=znver4", "cuda -arch=sm_80"), a named
    GPU ("nvidia/a100"), a JSON dict or its JSON text, or a ``tvm.target.Target``.
    """
    if isinstance(target, tvm.target.Target):
        return target, _entry_for_kind(target.kind.name)
    if isinstance(target, dict):
        return _from_dict(target)
    if not isinstance(target, str):
        raise TypeError(
            f"tvmamp: target must be a string, a dict or a tvm.target.Target, got {target!r}"
        )
    text = target.strip()
    if text.startswith("{"):
        try:
            return _from_dict(json.loads(text))
        except json.JSONDecodeError as err:
            raise ValueError(f"tvmamp: target {target!r} is not valid JSON: {err}") from None
    name, options = _split_spec(text)
    if "/" in name:  # a named device such as nvidia/a100: the entry that owns the prefix
        options["tag"] = name
        name = name.split("/", 1)[0]
    entry = REGISTRY.get(name) or _entry_by_alias(name)
    return entry.make_target(options), entry


def _from_dict(spec: dict) -> tuple[tvm.target.Target, TargetEntry]:
    kind = spec.get("kind")
    if kind is None:
        raise ValueError(f"tvmamp: target dict {spec!r} has no 'kind'")
    entry = _entry_for_kind(kind)
    # the entry fills in what a dict leaves out as for a string (an llvm dict without mcpu is
    # this machine's CPU, as "llvm" is, not LLVM's generic one with no vector unit)
    options = {key: value for key, value in spec.items() if key != "kind"}
    try:
        return entry.make_target(options), entry
    except ValueError:
        raise
    except Exception as err:  # TVM reports bad keys with its own error types
        raise ValueError(f"tvmamp: TVM rejected target {spec!r}: {err}") from None


def _entry_by_alias(name: str) -> TargetEntry:
    if name in TARGET_ALIASES and TARGET_ALIASES[name] in REGISTRY:
        return REGISTRY[TARGET_ALIASES[name]]
    raise _unknown_target(name)


def derived_pass_context(config=None, instruments=()) -> tvm.transform.PassContext:
    """The current PassContext (opt level, required and disabled passes, instruments, config)
    with ``config`` over its options and ``instruments`` after its own: a target entry's
    ``pass_config`` for a build, a lowering option for some kernels, a recording instrument."""
    current = tvm.transform.PassContext.current()
    return tvm.transform.PassContext(
        opt_level=current.opt_level,
        required_pass=current.required_pass,
        disabled_pass=current.disabled_pass,
        instruments=[*current.instruments, *instruments],
        config={**dict(current.config), **(config or {})},
    )
