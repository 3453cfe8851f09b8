"""PrecisionPlan: an exact per-node dtype assignment, versioned and tied to one model."""

from __future__ import annotations

import dataclasses
import json
import os

import tvm
import tvm_ffi

PLAN_FORMAT = "tvmamp.precision_plan"
PLAN_VERSION = 1


def model_hash(mod: tvm.IRModule) -> str:
    """A stable structural hash of a Relax module (the same in every process)."""
    return f"{tvm_ffi.structural_hash(mod):016x}"


@dataclasses.dataclass
class PrecisionPlan:
    """Which nodes of a model run in the low dtype and which stay fp32.

    ``build(mod, plan=plan)`` converts at ``base_level`` and then forces every node in
    ``node_dtypes`` exactly, so the plan is applied as it was searched.

    Attributes
    ----------
    model_hash : str
        ``model_hash(mod)`` of the model the plan was made for (before params are bound).
    target, dtype, base_level : str
        The target JSON, low dtype and level the plan starts from.
    node_dtypes : dict
        Node id (``AmpReport.nodes``) -> "float32" or "low", for every runtime float op.
    reasons : dict
        Node id -> why it was kept in fp32 (only for fp32 nodes).
    metrics : dict
        Calibration/held-out error, latency and the search's own figures.
    """

    model_hash: str
    target: str
    dtype: str
    base_level: str
    node_dtypes: dict
    reasons: dict = dataclasses.field(default_factory=dict)
    metrics: dict = dataclasses.field(default_factory=dict)

    @property
    def fp32_nodes(self) -> list[str]:
        """Node ids kept in fp32."""
        return [n for n, d in self.node_dtypes.items() if d == "float32"]

    def check_model(self, mod: tvm.IRModule) -> None:
        """Raise ValueError if ``mod`` is not the model this plan was made for."""
        actual = model_hash(mod)
        if actual != self.model_hash:
            raise ValueError(
                f"tvmamp: this precision plan was made for model {self.model_hash}, but the model "
                f"given has hash {actual}; search a new plan for it with tvmamp.search_precision"
            )

    def to_dict(self) -> dict:
        """JSON-friendly contents, with format and version."""
        return {"format": PLAN_FORMAT, "version": PLAN_VERSION, **dataclasses.asdict(self)}

    def save(self, path: str | os.PathLike) -> str:
        """Write the plan as JSON."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)
        return os.fspath(path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> PrecisionPlan:
        """Read a plan written by :meth:`save`; a file of another format or version is refused."""
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"tvmamp: precision plan {os.fspath(path)!r} is not JSON: {err}"
            ) from None
        return cls.from_dict(data, os.fspath(path))

    @classmethod
    def from_dict(cls, data: dict, source: str = "<dict>") -> PrecisionPlan:
        """Validate and build a plan from :meth:`to_dict` output."""
        if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
            raise ValueError(f"tvmamp: {source} is not a tvmamp precision plan")
        if data.get("version") != PLAN_VERSION:
            raise ValueError(
                f"tvmamp: {source} is plan version {data.get('version')}; this tvmamp reads "
                f"version {PLAN_VERSION}"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(fields - set(data) - {"reasons", "metrics"})
        if missing:
            raise ValueError(f"tvmamp: precision plan {source} lacks {', '.join(missing)}")
        return cls(**{k: v for k, v in data.items() if k in fields})

    def summary(self) -> str:
        """Nodes kept in fp32 and why, with the measured figures."""
        low = sum(d != "float32" for d in self.node_dtypes.values())
        lines = [
            f"precision plan for model {self.model_hash} ({self.dtype}, from {self.base_level}): "
            f"{low} of {len(self.node_dtypes)} nodes low, {len(self.fp32_nodes)} kept fp32"
        ]
        lines += [
            f"  fp32 {n}: {self.reasons.get(n, 'fp32 in the base level')}" for n in self.fp32_nodes
        ]
        lines += [f"  {k}: {v}" for k, v in sorted(self.metrics.items())]
        return "\n".join(lines)
