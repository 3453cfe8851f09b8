"""Step 4 of the precision search: measured per-node and whole-model latencies.

Low precision is not always faster: a small matmul pays for padding and casts, a kernel may
have no fast low-precision schedule on the target. Two measurements find this out:

* ``slow_low_nodes``: each matmul that the plan runs low is compiled alone, once in fp32 and
  once in the low dtype (identical layers share one measurement), and the nodes whose low
  kernel is slower are returned. Convolutions are not measured alone: on the CPU a bf16 conv
  chain shares its layout conversions (NCHW to NHWC rows and back) across the chain, which a
  lone conv would pay in full; the whole-model comparison judges them;
* ``fastest``: whole-model plans that meet the budget are timed interleaved in one run
  (``paired_medians``), and the fastest wins.

:func:`speed_step` puts them together: the searched plan, it with its slow low matmuls in fp32,
the O1 and O2 assignments and the fp32 plan, of which the fastest that meets the budget wins.
"""

from __future__ import annotations

import math
import time

import numpy as np
import tvm
import tvm_ffi
from tvm import relax

from tvmamp.benchmark import paired_medians
from tvmamp.conversion import bind_params, convert

from .state import SearchState, compile_plan

SLOWER = 1.1  # a low kernel counts as slower when it takes 10 % longer than fp32 (noise margin)
MEASURED_ALONE = ("relax.matmul",)


def node_calls(mod: tvm.IRModule) -> dict[str, relax.Call]:
    """Node id (as ``AmpReport.nodes`` names it) -> the op call of that binding.

    Names are numbered the way the AMP pass numbers them: per function, parameters first, then
    every variable binding in order (``lv``, ``lv_1``, ...), nested ``If`` branches included.
    """
    calls: dict[str, relax.Call] = {}
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            seen: dict[str, int] = {}
            for param in func.params:
                _unique(seen, param.name)
            _walk(func.body, gv.name_hint, seen, calls)
    return calls


def _unique(seen: dict, name: str) -> str:
    count = seen.get(name, 0)
    seen[name] = count + 1
    return name if count == 0 else f"{name}_{count}"


def _walk(expr, func_name: str, seen: dict, calls: dict) -> None:
    if not isinstance(expr, relax.SeqExpr):
        return
    for block in expr.blocks:
        for binding in block.bindings:
            if not isinstance(binding, relax.VarBinding):
                continue
            name = _unique(seen, binding.var.name)
            value = binding.value
            if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op):
                calls[f"{func_name}/{name}"] = value
            elif isinstance(value, relax.If):
                _walk(value.true_branch, func_name, seen, calls)
                _walk(value.false_branch, func_name, seen, calls)


def single_op_module(call: relax.Call) -> tvm.IRModule | None:
    """A module whose ``main`` runs only ``call``: variable inputs become parameters, constants
    (weights) stay constants. None when an input is not a static-shape tensor."""
    params, args = [], []
    for arg in call.args:
        if isinstance(arg, tvm.ir.expr.Constant):
            args.append(arg)
            continue
        ty = arg.ty if isinstance(arg, relax.Var) else None
        if not isinstance(ty, relax.TensorType) or ty.shape is None:
            return None
        if not all(isinstance(d, tvm.tirx.IntImm) for d in ty.shape):
            return None
        var = relax.Var(arg.name, relax.TensorType([int(d) for d in ty.shape], ty.dtype))
        params.append(var)
        args.append(var)
    bb = relax.BlockBuilder()
    with bb.function("main", params):
        with bb.dataflow():
            out = bb.emit_output(relax.Call(call.op, args, call.attrs, call.ty_args))
        bb.emit_func_output(out)
    return bb.get()


def _inputs(mod: tvm.IRModule) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [
        rng.standard_normal([int(d) for d in p.ty.shape]).astype(str(p.ty.dtype))
        for p in mod["main"].params
    ]


def op_latencies(call: relax.Call, target, dtype: str, cache: dict) -> tuple[float, float] | None:
    """(fp32 ms, low ms) of ``call`` compiled alone; None when it cannot be isolated."""
    mod = single_op_module(call)
    if mod is None:
        return None
    key = tvm_ffi.structural_hash(mod)
    if key not in cache:
        fp32 = compile_plan(mod, "O0", target)
        low = compile_plan(mod, "O3", target, dtype)
        inputs = _inputs(mod)
        cache[key] = tuple(
            t * 1e3 for t in paired_medians([lambda: fp32(*inputs), lambda: low(*inputs)], 15)
        )
    return cache[key]


def slow_low_nodes(mod, params, nodes, target, dtype: str, cache: dict, deadline) -> dict:
    """Low matmuls whose kernel is slower than fp32: node id -> (fp32 ms, low ms).

    ``nodes`` are the plan's ``NodeDecision``s; ``deadline()`` returns True when time is up.
    """
    bound, _ = bind_params(mod, params)
    calls = node_calls(bound)
    slow = {}
    for node in nodes:
        call = calls.get(node.node)
        if node.dtype == "float32" or node.op not in MEASURED_ALONE or call is None:
            continue
        if call.op.name != node.op or deadline():
            continue
        times = op_latencies(call, target, dtype, cache)
        if times is not None and times[1] > SLOWER * times[0]:
            slow[node.node] = times
    return slow


def fastest(
    executables: dict, inputs: list, repeat: int = 31, sample_ms: float = 10.0, margin=0.03
) -> tuple[str, dict]:
    """Time the executables interleaved on ``inputs``; (fastest name, name -> median ms).

    Each sample runs enough calls to last about ``sample_ms``, so that a sub-millisecond model
    is not judged on timer noise. ``executables`` are in order of preference (the searched plan
    first): a later one wins only when it is faster by more than ``margin``.
    """
    names = list(executables)
    first = executables[names[0]]
    first(*inputs)  # the first call creates the VM
    start = time.perf_counter()
    first(*inputs)
    once_ms = (time.perf_counter() - start) * 1e3
    number = max(1, math.ceil(sample_ms / max(once_ms, 1e-3)))
    medians = paired_medians([lambda e=executables[n]: e(*inputs) for n in names], repeat, number)
    times = {n: t * 1e3 for n, t in zip(names, medians)}
    best = names[0]
    for name in names[1:]:
        if times[name] < (1 - margin) * times[best]:
            best = name
    return best, times


def speed_step(search: SearchState, fp32: set, reasons: dict, notes: list) -> set:
    """Step 4: the fastest of the plans that meet the budget; fills ``reasons`` for its nodes."""
    _, exe = search.evaluate(fp32)
    search.bar.set_postfix_str("timing the low matmuls alone, in fp32 and low")
    slow = slow_low_nodes(
        search.mod,
        search.params,
        exe.stats.nodes,
        search.target,
        search.dtype,
        search.op_times,
        search.out_of_time,
    )
    plans = {"searched": fp32}
    if slow:
        plans["searched, slow kernels fp32"] = fp32 | set(slow)
        for node, (t32, tlow) in slow.items():
            reasons[node] = f"its low kernel is slower: {tlow:.3f} ms against {t32:.3f} ms in fp32"
    for level in ("O1", "O2"):
        if level != search.level:
            report = convert(search.mod, level, search.target, search.dtype, search.params).report
            plans[level] = {n.node for n in report.nodes if n.dtype == "float32"}
    plans["fp32"] = set(search.low_nodes())
    executables = {}
    for name, nodes in plans.items():
        if search.out_of_time() and executables:
            notes.append(f"time limit: the {name} plan and later ones were not compared")
            break
        error, candidate = search.evaluate(nodes)
        if search.budget.met(error):
            executables[name] = candidate
    if not executables:
        return fp32
    search.bar.set_postfix_str(f"timing {len(executables)} plans that meet the budget")
    winner, search.latencies = fastest(executables, list(search.calib[0]))
    search.chosen = winner
    search.bar.set_postfix(plan=winner, latency=f"{search.latencies[winner]:.3f} ms")
    for node in plans[winner] - fp32:
        reasons.setdefault(node, f"fp32 in the {winner} plan, the fastest that meets the budget")
    return plans[winner]
