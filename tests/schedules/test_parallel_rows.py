"""GEMMs with fewer column tasks than cores run their row tiles in parallel too.

Each GEMM rule ran only its column blocks in parallel; a narrow output (a 32- or 64-channel
layer) then kept one or two of 16 threads busy. On a 16-core Emerald Rapids the AMX SimpleNet
took 7.2 ms at 16 threads and 3.5 ms at 4. ``parallel_with_rows`` cuts the rows into chunks
beside the column tasks; these tests check the parallel extent and the numbers at odd shapes.
"""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
import tvm
from forced_cpus import forced
from tvm import relax

from tvmamp.pipeline import legalize_passes
from tvmamp.schedules.cpu import cpu_schedule_passes
from tvmamp.schedules.cpu.parallel import row_chunks
from tvmamp.targets.llvm import _host_flags

LEGALIZE = legalize_passes()
CORES = 16


@pytest.mark.parametrize(
    ("cores", "columns", "rows", "expected"),
    [
        (1, 1, 38, 1),  # one core: never cut
        (16, 32, 33, 1),  # 32 column tasks already keep 16 cores busy
        (16, 1, 38, 38),  # one column task: every row tile is a task
        (16, 2, 8, 8),
        (16, 4, 36, 4),  # 16 tasks of 9 row tiles
        (4, 3, 16, 4),  # 12 tasks of 4: no core does more than 3 x 4 = 12
    ],
)
def test_row_chunks(cores, columns, rows, expected):
    assert row_chunks(cores, columns, rows) == expected


def _gemm(m: int, k: int, n: int, dtype: str, out_dtype: str) -> tvm.IRModule:
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((m, k), dtype))
    w = relax.Var("w", relax.TensorType((k, n), dtype))
    with bb.function("main", [x, w]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.matmul(x, w, out_dtype=out_dtype))
        bb.emit_func_output(out)
    return bb.get()


# (dtype, out_dtype, mcpu, host flag): the fp32 FMA rule, F16C fp16 and vdpbf16ps bf16.
RULES = [
    pytest.param("float32", "float32", "znver4", "avx512f", id="fp32"),
    pytest.param("float16", "float32", "znver4", "f16c", id="fp16"),
    pytest.param("bfloat16", "float32", "znver4", "avx512_bf16", id="bf16"),
]
NUMPY = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@pytest.mark.parametrize(("dtype", "out_dtype", "mcpu", "flag"), RULES)
@pytest.mark.parametrize(("m", "k", "n"), [(300, 64, 32), (130, 40, 48)])
def test_narrow_gemm_has_a_task_per_core(rng, dtype, out_dtype, mcpu, flag, m, k, n):
    target = tvm.target.Target(forced(mcpu, CORES))
    with target:
        mod = tvm.transform.Sequential([*LEGALIZE, *cpu_schedule_passes(target)])(
            _gemm(m, k, n, dtype, out_dtype)
        )
    scripts = [f.script() for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    gemm = next(s for s in scripts if "matmul" in s and "T.parallel" in s)
    tasks = re.findall(r"T\.parallel\(T\.int64\((\d+)\)", gemm)
    assert int(tasks[0]) >= CORES, tasks
    if flag not in _host_flags():
        pytest.skip(f"the host CPU lacks {flag}")
    a = rng.standard_normal((m, k)).astype(NUMPY[dtype])
    b = rng.standard_normal((k, n)).astype(NUMPY[dtype])
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    ref = a.astype("float64") @ b.astype("float64")
    tolerance = 1e-5 if dtype == "float32" else 1e-2
    assert np.abs(out - ref).max() / np.abs(ref).max() <= tolerance


def test_padded_copy_of_a_runs_in_parallel(rng):
    """fp32 GEMM whose rows do not fill whole row tiles (ViT's 197 tokens): the padded copy of
    ``A`` was a serial, scalar root loop nest beside the parallel GEMM."""
    m, k, n = 197, 384, 1536
    target = tvm.target.Target(
        {"kind": "llvm", "mcpu": "znver4", "mattr": ["-sse4a"], "num-cores": CORES}
    )
    with target:
        mod = tvm.transform.Sequential([*LEGALIZE, *cpu_schedule_passes(target)])(
            _gemm(m, k, n, "float32", "float32")
        )
    (script,) = [f.script() for _, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(re.findall(r"T\.parallel\(", script)) == 2, script  # the copy and the GEMM
    a = rng.standard_normal((m, k)).astype("float32")
    b = rng.standard_normal((k, n)).astype("float32")
    vm = relax.VirtualMachine(tvm.compile(mod, target=target), tvm.cpu())
    out = vm["main"](tvm.runtime.tensor(a), tvm.runtime.tensor(b)).numpy()
    ref = a.astype("float64") @ b.astype("float64")
    assert np.abs(out - ref).max() / np.abs(ref).max() <= 1e-5
