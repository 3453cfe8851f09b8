"""What the AMP pass did to a module: casts, op dtypes, forced nodes and folded constants."""

from __future__ import annotations

import collections
import dataclasses


@dataclasses.dataclass
class ForcedNode:
    """A node whose dtype came from a per-node rule or a guard, not from the op lists."""

    name: str
    op: str
    dtype: str
    reason: str


@dataclasses.dataclass
class NodeDecision:
    """The compute dtype the pass chose for one op call, and why."""

    node: str  # "<function>/<binding name>", made unique as the TVMScript printer does (lv, lv_1)
    op: str
    dtype: str
    category: str
    # "policy", "feeds_fp32" (O2: its result only feeds fp32 ops), "comparison" (O2: a
    # comparison of a computed fp32 value, kept fp32), "index_values" (computes on
    # positions or counts cast from integers only: kept as written), "quant_params" (computes
    # only a quantization scale or zero point: kept as written), "fp32_cache" (O2: extends
    # and returns an fp32 input, as a key-value cache, or views it), "custom_fp32_nodes",
    # "custom_low_nodes", "node_dtypes", "unsupported", "overflow"
    reason: str


@dataclasses.dataclass
class AmpReport:
    """Counters filled by :class:`AutoMixedPrecision` while it rewrites a module.

    Attributes
    ----------
    casts_inserted : int
        ``astype`` bindings the pass emitted (constants folded at compile time not counted).
    casts_removed : int
        User ``astype`` calls that became no-ops and were dropped.
    ops : dict
        Relax op name -> Counter of compute dtype -> number of calls.
    forced : list of ForcedNode
        Nodes forced by ``custom_fp32_nodes``/``custom_low_nodes``/``node_dtypes``, by the
        target (no low kernel), or by the overflow guard: a constant (bound params included),
        directly or through ops that only move or select its values, that the low dtype cannot
        hold; the reason names the constant, the ops it went through and its largest value.
    constants_converted : int
        Constants (bound params included) converted to the low dtype at compile time.
    nodes : list of NodeDecision
        Every float op call that runs at run time, in program order, with its node id.
    """

    level: str = "O0"
    low_dtype: str = ""
    casts_inserted: int = 0
    casts_removed: int = 0
    ops: dict = dataclasses.field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    forced: list = dataclasses.field(default_factory=list)
    constants_converted: int = 0
    nodes: list = dataclasses.field(default_factory=list)

    def count_op(self, op_name: str, dtype: str) -> None:
        """Record one call of ``op_name`` computing in ``dtype``."""
        self.ops[op_name][dtype] += 1

    def ops_per_dtype(self) -> dict[str, int]:
        """Total op calls per compute dtype."""
        total: collections.Counter = collections.Counter()
        for counter in self.ops.values():
            total.update(counter)
        return dict(total)

    def as_dict(self) -> dict:
        """A JSON-friendly copy."""
        return {
            "level": self.level,
            "low_dtype": self.low_dtype,
            "casts_inserted": self.casts_inserted,
            "casts_removed": self.casts_removed,
            "constants_converted": self.constants_converted,
            "ops_per_dtype": self.ops_per_dtype(),
            "ops": {name: dict(c) for name, c in sorted(self.ops.items())},
            "forced": [dataclasses.asdict(f) for f in self.forced],
            "nodes": [dataclasses.asdict(n) for n in self.nodes],
        }

    def summary(self) -> str:
        """A short human-readable account."""
        per_dtype = ", ".join(f"{d}: {n}" for d, n in sorted(self.ops_per_dtype().items()))
        lines = [
            f"AMP {self.level} ({self.low_dtype or 'no low dtype'}): "
            f"{self.casts_inserted} casts inserted, {self.casts_removed} removed, "
            f"{self.constants_converted} constants converted",
            f"ops per dtype: {per_dtype or 'none'}",
        ]
        lines += [f"forced {f.name} ({f.op}) -> {f.dtype}: {f.reason}" for f in self.forced]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()
