"""Every x86 CPU kind on any host: forced ``-mcpu`` targets, built and checked everywhere.

The machine under the tests varies (Sapphire Rapids with AMX and avx512_fp16, Zen 4/5 with
avx512_bf16 only, an AVX2 CI runner), so each kind is forced with ``llvm -mcpu=<kind>``:

========================  ==========================================================
``x86-64-v3``             AVX2 + F16C, no AVX-512: fp16 through ``vcvtph2ps``, bf16 emulated
``skylake-avx512``        AVX-512 without bf16: bf16 emulated (widened to fp32)
``znver4``                avx512_bf16 (``vdpbf16ps``), no AMX, no avx512_fp16
``sapphirerapids``        AMX (``tdpbf16ps``) and avx512_fp16
========================  ==========================================================

Every build is made whatever the host. Its instructions are checked from the assembly
(``test_instructions``), and where the host has every feature the kind's code may use
(:func:`missing_on_host`, read from /proc/cpuinfo) its fp16 and bf16 numerics at O1, O2 and O3
are checked elementwise against fp32 on an MLP, a conv net, a transformer layer and an MLP's
training gradients. Forcing ``znver4`` runs the avx512_bf16-without-AMX kernels on an AMX host.

Builds are shared through a module-scoped cache. By default the MLP is built for every kind
and dtype at O2 (its program is the same at O1-O3); the conv net, the transformer and the
gradient are built 8 times each (:func:`spread`: every kind in both dtypes, every dtype at
every level), and between them they cover every (kind, dtype, level) once. The rest of each
full product is marked slow.
"""

from __future__ import annotations

import functools
import re
import warnings

import numpy as np
import pytest
import tvm
from forced_cpus import forced_str
from tolerances import assert_close, tolerance
from tvm.target import codegen

import tvmamp
from tvmamp import models
from tvmamp.training import SGD, Trainer

KINDS = ("x86-64-v3", "skylake-avx512", "znver4", "sapphirerapids")
DTYPES = ("float16", "bfloat16")
LEVELS = ("O1", "O2", "O3")
SHORT = {"float16": "fp16", "bfloat16": "bf16"}

# LLVM feature -> /proc/cpuinfo flag, for the ISA extensions LLVM may emit in TVM's kernels.
# AMD's sse4a and clzero (in znver4) are left out: the forced znver4 target turns sse4a off
# (forced_cpus.py: LLVM's insertq stopped an Intel host), and LLVM never emits clzero.
# Kept local to this test; targets/cpu_features.py is the library's own table.
FEATURE_FLAGS = {
    "sse3": "pni",
    "ssse3": "ssse3",
    "sse4.1": "sse4_1",
    "sse4.2": "sse4_2",
    "popcnt": "popcnt",
    "movbe": "movbe",
    "lzcnt": "abm",
    "bmi": "bmi1",
    "bmi2": "bmi2",
    "avx": "avx",
    "avx2": "avx2",
    "fma": "fma",
    "f16c": "f16c",
    "avx512f": "avx512f",
    "avx512dq": "avx512dq",
    "avx512cd": "avx512cd",
    "avx512bw": "avx512bw",
    "avx512vl": "avx512vl",
    "avx512ifma": "avx512ifma",
    "avx512vbmi": "avx512vbmi",
    "avx512vbmi2": "avx512_vbmi2",
    "avx512vnni": "avx512_vnni",
    "avx512bitalg": "avx512_bitalg",
    "avx512vpopcntdq": "avx512_vpopcntdq",
    "avx512bf16": "avx512_bf16",
    "avx512fp16": "avx512_fp16",
    "gfni": "gfni",
    "vaes": "vaes",
    "vpclmulqdq": "vpclmulqdq",
    "avxvnni": "avx_vnni",
    "amx-tile": "amx_tile",
    "amx-bf16": "amx_bf16",
    "amx-int8": "amx_int8",
    "amx-fp16": "amx_fp16",
}


def target(kind: str) -> str:
    """The forced target; a fixed core count keeps the generated code independent of the host."""
    return forced_str(kind, 2)


@functools.cache
def kind_flags(kind: str) -> frozenset[str]:
    """The /proc/cpuinfo flags of every feature LLVM enables for ``-mcpu=kind``."""
    llvm = tvm.target.Target({"kind": "llvm", "mcpu": kind})
    return frozenset(
        flag for f, flag in FEATURE_FLAGS.items() if codegen.llvm_cpu_has_features([f], llvm)
    )


@functools.lru_cache(maxsize=1)
def host_flags() -> frozenset[str]:
    """This host's /proc/cpuinfo flags (empty where there is none: nothing is run then)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def missing_on_host(kind: str, flags: frozenset[str] | None = None) -> list[str]:
    """The flags ``kind``'s code may need that the host (or ``flags``) lacks; [] if it runs."""
    have = host_flags() if flags is None else flags
    return sorted(kind_flags(kind) - have)


def skip_unless_runnable(kind: str) -> None:
    missing = missing_on_host(kind)
    if missing:
        pytest.skip(f"built only: the host lacks {', '.join(missing)} to run -mcpu={kind}")


def spread(offset: int) -> set[tuple[str, str, str]]:
    """8 (kind, dtype, level): every (kind, dtype) once, every (dtype, level) on some kind.

    The three spreads (offsets 0, 1, 2) are disjoint and together hold every (kind, dtype,
    level) once, so the conv net, the transformer and the gradient between them build the
    whole product by default.
    """
    return {
        (kind, dtype, LEVELS[(i + j + offset) % len(LEVELS)])
        for i, kind in enumerate(KINDS)
        for j, dtype in enumerate(DTYPES)
    }


def cases(default: set) -> list:
    """Every (kind, dtype, level), those not in ``default`` marked slow."""
    return [
        pytest.param(
            kind,
            dtype,
            level,
            id=f"{kind}-{SHORT[dtype]}-{level}",
            marks=() if (kind, dtype, level) in default else pytest.mark.slow,
        )
        for kind in KINDS
        for dtype in DTYPES
        for level in LEVELS
    ]


# The MLP's Relax program is the same at O1, O2 and O3 (matmul, add and relu run low at every
# level), so by default it is built at O2 only, for every kind and dtype.
MLP = {(k, d, "O2") for k in KINDS for d in DTYPES}
CONVNET, TRANSFORMER, GRADIENT = spread(0), spread(1), spread(2)


def level_in(design: set, kind: str, dtype: str) -> str:
    """The level at which ``design`` builds (kind, dtype) by default."""
    return next(lv for k, d, lv in design if (k, d) == (kind, dtype))


# Small shapes that still reach every kernel: 32 rows for the AMX GEMMs (rows >= 32), 32
# channels for the conv whose im2col is fused into the AMX A-pack, 3 for the RGB stem.
MODELS = {
    "mlp": lambda: models.simple_net(batch=32, hidden=64, layers=3),
    "convnet": lambda: models.conv_net(batch=2, channels=32, size=8),
    "transformer": lambda: models.transformer_layer(batch=1, seq=32, dim=64, heads=2),
}
GRAD_BATCH, GRAD_HIDDEN = 32, 64


class Builds:
    """Each model, trainer and fp32 reference built once for the whole module."""

    def __init__(self):
        self._cache = {}

    def _once(self, key, make):
        if key not in self._cache:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                value = make()
            self._cache[key] = (value, [str(w.message) for w in caught])
        return self._cache[key]

    def model(self, name: str):
        """(mod, params, inputs, fp32 outputs of an O0 build for this host)."""

        def make():
            mod, params = MODELS[name]()
            inputs = models.example_inputs(mod, seed=7)
            ref = tvmamp.build(mod, "O0", "llvm", params=params)(*inputs)
            return mod, params, inputs, np.asarray(ref, dtype="float64")

        return self._once(("model", name), make)[0]

    def exe(self, name: str, kind: str, dtype: str, level: str):
        """(Executable, warnings raised while building it)."""
        mod, params, _, _ = self.model(name)
        return self._once(
            (name, kind, dtype, level),
            lambda: tvmamp.build(mod, level, target(kind), dtype, params=params),
        )

    def grad_data(self):
        """(mod, params, x, y) of the two-layer MLP trained with the MSE loss."""

        def make():
            mod, params = models.simple_net(batch=GRAD_BATCH, hidden=GRAD_HIDDEN, layers=2, seed=3)
            rng = np.random.default_rng(11)
            x = rng.standard_normal((GRAD_BATCH, GRAD_HIDDEN)).astype("float32")
            y = rng.standard_normal((GRAD_BATCH, GRAD_HIDDEN)).astype("float32")
            return mod, params, x, y

        return self._once("grad_data", make)[0]

    def trainer(self, kind: str, dtype: str, level: str):
        """(Trainer, warnings raised while building it)."""
        mod, params, _, _ = self.grad_data()
        return self._once(
            ("trainer", kind, dtype, level),
            lambda: Trainer(
                mod, "mse", SGD(0.1), level=level, dtype=dtype, target=target(kind), params=params
            ),
        )


@pytest.fixture(scope="module")
def builds():
    return Builds()


def mse_grads(params: dict, x: np.ndarray, y: np.ndarray) -> dict:
    """float64 numpy gradients of ``mean((relu(x W0^T + b0) W1^T + b1 - y) ** 2)``."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    x, y = x.astype(np.float64), y.astype(np.float64)
    h = x @ p["linear0.weight"].T + p["linear0.bias"]
    a = np.maximum(h, 0.0)
    out = a @ p["linear1.weight"].T + p["linear1.bias"]
    dout = 2.0 * (out - y) / out.size
    dh = (dout @ p["linear1.weight"]) * (h > 0)
    return {
        "linear0.weight": dh.T @ x,
        "linear0.bias": dh.sum(0),
        "linear1.weight": dout.T @ a,
        "linear1.bias": dout.sum(0),
    }


# ---------------------------------------------------------------------------------------------
# The kinds and the host check
# ---------------------------------------------------------------------------------------------

# Flags of the hosts the tests meet (Zen 5, Sapphire Rapids, an AVX2 CI runner such as Zen 3),
# trimmed to the instruction set extensions (from /proc/cpuinfo).
BASE = "pni ssse3 sse4_1 sse4_2 popcnt movbe abm bmi1 bmi2 avx avx2 fma f16c "
AVX512 = (
    "avx512f avx512dq avx512cd avx512bw avx512vl avx512ifma avx512vbmi avx512_vbmi2 avx512_vnni "
    "avx512_bitalg avx512_vpopcntdq avx512_bf16 gfni vaes vpclmulqdq "
)
ZEN5_FLAGS = frozenset((BASE + AVX512 + "sse4a clzero").split())
SPR_FLAGS = frozenset((BASE + AVX512 + "avx512_fp16 avx_vnni amx_tile amx_bf16 amx_int8").split())
ZEN3_FLAGS = frozenset((BASE + "sse4a clzero").split())


def test_the_forced_kinds_have_the_features_the_matrix_is_about():
    assert {"avx2", "f16c", "fma"} <= kind_flags("x86-64-v3")
    assert not {"avx512f", "avx512_bf16"} & kind_flags("x86-64-v3")
    assert "avx512f" in kind_flags("skylake-avx512")
    assert "avx512_bf16" not in kind_flags("skylake-avx512")
    assert "avx512_bf16" in kind_flags("znver4")
    assert not {"amx_bf16", "amx_tile", "avx512_fp16"} & kind_flags("znver4")
    assert {"amx_tile", "amx_bf16", "avx512_fp16", "avx512_bf16"} <= kind_flags("sapphirerapids")


@pytest.mark.parametrize(
    ("flags", "runnable"),
    [
        pytest.param(SPR_FLAGS, KINDS, id="sapphirerapids-host"),
        pytest.param(ZEN5_FLAGS, KINDS[:3], id="zen5-host"),
        pytest.param(ZEN3_FLAGS, KINDS[:1], id="avx2-host"),
    ],
)
def test_which_kinds_a_host_runs(flags, runnable):
    assert [k for k in KINDS if not missing_on_host(k, flags)] == list(runnable)
    if "sapphirerapids" not in runnable:
        assert {"amx_bf16", "amx_tile"} <= set(missing_on_host("sapphirerapids", flags))


def test_the_default_builds_cover_every_kind_dtype_and_level():
    designs = (CONVNET, TRANSFORMER, GRADIENT)
    assert set().union(*designs) == {(k, d, lv) for k in KINDS for d in DTYPES for lv in LEVELS}
    assert sum(len(d) for d in designs) == len(KINDS) * len(DTYPES) * len(LEVELS)
    for design in designs:
        assert {(k, d) for k, d, _ in design} == {(k, d) for k in KINDS for d in DTYPES}
        assert {(d, lv) for _, d, lv in design} == {(d, lv) for d in DTYPES for lv in LEVELS}


# ---------------------------------------------------------------------------------------------
# Instructions, on any host
# ---------------------------------------------------------------------------------------------

ZMM = r"%zmm\d"
YMM = r"%ymm\d"
OPMASK = r"%k[1-7]\b"  # AVX-512 mask registers
FP16_MATH = r"\bv(?:add|sub|mul|div|min|max|sqrt|fn?m(?:add|sub)\d{3})[ps]h\b"  # avx512_fp16


def word(mnemonic: str) -> str:
    return rf"\b{mnemonic}\b"


AVX512_BF16 = (word("vdpbf16ps"), word("vcvtneps2bf16"), word("vcvtne2ps2bf16"))

# (kind, dtype) -> (patterns every build has, patterns no build has)
EXPECTED = {
    ("x86-64-v3", "float16"): ((word("vcvtph2ps"), YMM), (ZMM, OPMASK, FP16_MATH)),
    ("x86-64-v3", "bfloat16"): ((YMM,), (ZMM, OPMASK, *AVX512_BF16, word("tdpbf16ps"))),
    ("skylake-avx512", "float16"): ((word("vcvtph2ps"), ZMM), (FP16_MATH, word("vdpbf16ps"))),
    ("skylake-avx512", "bfloat16"): ((ZMM,), (*AVX512_BF16, word("tdpbf16ps"))),
    ("znver4", "float16"): ((word("vcvtph2ps"), ZMM), (FP16_MATH, word("tdpbf16ps"))),
    ("znver4", "bfloat16"): (
        (word("vdpbf16ps"), ZMM),
        (word("tdpbf16ps"), word("tileloadd"), word("ldtilecfg")),
    ),
    ("sapphirerapids", "float16"): ((word("vcvtph2ps"), ZMM), (word("tdpbf16ps"),)),
    ("sapphirerapids", "bfloat16"): (
        (word("tdpbf16ps"), word("tileloadd"), word("ldtilecfg")),
        (),
    ),
}


def check_instructions(asm: str, kind: str, dtype: str, what: str) -> None:
    has, lacks = EXPECTED[(kind, dtype)]
    for pattern in has:
        assert re.search(pattern, asm), f"{what} for -mcpu={kind} {dtype}: no {pattern}"
    for pattern in lacks:
        found = re.search(pattern, asm)
        assert not found, f"{what} for -mcpu={kind} {dtype}: {found.group(0)!r} in the asm"


@pytest.mark.parametrize("dtype", DTYPES, ids=SHORT.get)
@pytest.mark.parametrize("kind", KINDS)
def test_instructions(builds, kind, dtype):
    for name, design in (("mlp", MLP), ("convnet", CONVNET)):
        exe, _ = builds.exe(name, kind, dtype, level_in(design, kind, dtype))
        check_instructions(exe.get_source("asm"), kind, dtype, name)
    trainer, _ = builds.trainer(kind, dtype, level_in(GRADIENT, kind, dtype))
    check_instructions(trainer.executable.get_source("asm"), kind, dtype, "training step")


@pytest.mark.parametrize("kind", KINDS)
def test_bf16_without_hardware_builds_with_a_warning(builds, kind):
    _, caught = builds.exe("mlp", kind, "bfloat16", "O2")
    warned = any("has no avx512_bf16" in m for m in caught)
    assert warned == ("avx512_bf16" not in kind_flags(kind)), caught


# ---------------------------------------------------------------------------------------------
# Numerics, where the host runs the kind
# ---------------------------------------------------------------------------------------------


def check_model(builds, name, kind, dtype, level):
    exe, _ = builds.exe(name, kind, dtype, level)  # built on every host
    skip_unless_runnable(kind)
    _, _, inputs, ref = builds.model(name)
    out = exe(*inputs)
    assert_close(out, ref, **tolerance(dtype, float(np.std(ref))), what=f"{name} output")


@pytest.mark.parametrize(("kind", "dtype", "level"), cases(MLP))
def test_mlp(builds, kind, dtype, level):
    check_model(builds, "mlp", kind, dtype, level)


@pytest.mark.parametrize(("kind", "dtype", "level"), cases(CONVNET))
def test_convnet(builds, kind, dtype, level):
    check_model(builds, "convnet", kind, dtype, level)


@pytest.mark.parametrize(("kind", "dtype", "level"), cases(TRANSFORMER))
def test_transformer_layer(builds, kind, dtype, level):
    check_model(builds, "transformer", kind, dtype, level)


@pytest.mark.parametrize(("kind", "dtype", "level"), cases(GRADIENT))
def test_training_gradients(builds, kind, dtype, level):
    """Unscaled gradients of the mixed-precision backward against float64 numpy."""
    trainer, _ = builds.trainer(kind, dtype, level)
    skip_unless_runnable(kind)
    _, params, x, y = builds.grad_data()
    grads = trainer.gradients(x, y)
    for name, ref in mse_grads(params, x, y).items():
        tol = tolerance(dtype, float(np.std(ref)))
        assert_close(grads[name], ref, **tol, what=f"d loss / d {name}")
