"""Per-node error attribution: which low-precision nodes to return to fp32 first."""

from __future__ import annotations

import dataclasses

import tvm
from tvm import relax


@dataclasses.dataclass
class Candidate:
    """A node running in the low dtype, with the evidence against it.

    ``introduced`` is the node's relative error minus the largest error among its inputs, so
    error that merely flows through a node is not blamed on it. ``range_hits`` counts values
    that overflow the low dtype or turn non-finite there (from the fp32 magnitudes and the AMP
    run).
    """

    node: str
    op: str
    category: str
    error: float = 0.0
    introduced: float = 0.0
    range_hits: int = 0

    @property
    def expensive(self) -> bool:
        """GEMM-like ops (the white list) carry most of the speed-up of low precision."""
        return self.category == "white"

    def reason(self) -> str:
        """Why the search returned this node to fp32."""
        parts = [f"{self.op} adds rel. error {self.introduced:.2e} (output error {self.error:.2e})"]
        if self.range_hits:
            parts.append(f"{self.range_hits} values out of the low dtype's range")
        return ", ".join(parts)


def input_names(mod: tvm.IRModule) -> dict[str, list[str]]:
    """``function/binding`` -> the ``function/binding`` names of its variable inputs."""
    graph: dict[str, list[str]] = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, relax.Function):
            continue
        for block in func.body.blocks:
            for binding in block.bindings:
                value = binding.value
                args = value.args if isinstance(value, relax.Call) else []
                names = []
                for arg in args:
                    leaves = arg.fields if isinstance(arg, relax.Tuple) else [arg]
                    names += [
                        f"{gv.name_hint}/{a.name}" for a in leaves if isinstance(a, relax.Var)
                    ]
                graph[f"{gv.name_hint}/{binding.var.name}"] = names
    return graph


def rank_candidates(mod: tvm.IRModule, nodes: list, rows: list) -> list[Candidate]:
    """Low nodes, most suspicious first.

    Parameters
    ----------
    mod : tvm.IRModule
        The fp32 model (its bindings give each node's inputs).
    nodes : list of NodeDecision
        ``AmpReport.nodes`` of the starting plan.
    rows : list of OpError
        Per-op errors of the starting plan (``tvmamp.debugging.compare_accuracy``).

    Order: nodes with out-of-range values first; then cheap ops before GEMM-like ones (their
    low precision buys less speed); then by the error each node introduces.
    """
    by_name = {f"{r.func}/{r.var}": r for r in rows}
    graph = input_names(mod)
    candidates = []
    for node in nodes:
        if node.dtype == "float32":
            continue
        cand = Candidate(node.node, node.op, node.category)
        row = by_name.get(node.node)
        if row is not None:
            upstream = [by_name[i].max_rel_err for i in graph.get(node.node, []) if i in by_name]
            cand.error = float(row.max_rel_err)
            cand.introduced = max(0.0, cand.error - max(upstream, default=0.0))
            cand.range_hits = int(row.overflow + row.nonfinite)
        candidates.append(cand)
    return sorted(candidates, key=lambda c: (c.range_hits == 0, c.expensive, -c.introduced))
