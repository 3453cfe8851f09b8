"""The C++ source of the CPU feature guard that ``export_library`` links into a library.

Generated from the one feature table (:data:`cpu_features.FEATURES`): the CPUID bit and XCR0
state of each feature, the CPU levels for the "rebuild for" suggestion, and the message, which
is :data:`cpu_features.GUARD_MESSAGE` as a printf format. It speaks tvm-ffi's C ABI (``c_api.h``)
only, uses no C++ runtime library, and is compiled with the compiler's default flags.
"""

from __future__ import annotations

import json

import tvm

from .cpu_features import (
    CPU_LEVEL_VENDORS,
    CPU_LEVELS,
    FEATURES,
    GUARD_MESSAGE,
    cpu_level_features,
    describe_target,
    target_cpu_features,
)

GUARD_FUNC = "tvmamp_check_cpu_features"
INFO_FUNC = "tvmamp_compiled_cpu_features"


def feature_mask(names) -> int:
    """The guard's mask of LLVM feature ``names``: bit ``i`` for ``FEATURES[i]``."""
    index = {f.name: i for i, f in enumerate(FEATURES)}
    return sum(1 << index[n] for n in set(names))


def mask_features(mask: int) -> list[str]:
    """The feature names of a guard mask, in table order."""
    return [f.name for i, f in enumerate(FEATURES) if mask >> i & 1]


if len(FEATURES) > 63:  # bit 63 of the C guard's host mask marks "detected"
    raise RuntimeError("tvmamp.targets.cpu_guard: the guard's mask holds at most 63 features")


_SOURCE = r"""// tvmamp CPU feature guard for {target}, from tvmamp.targets.cpu_guard_source.
// Compiled by the system compiler with its default (baseline x86-64) flags.
#include <tvm/ffi/c_api.h>

#include <stdint.h>
#include <stdio.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {{
struct Feature {{
  const char* name;
  uint32_t leaf, subleaf, reg, bit;
  uint64_t xcr0;
}};
const Feature kFeatures[] = {{
{features}
}};
const int kNumFeatures = sizeof(kFeatures) / sizeof(kFeatures[0]);
struct Level {{
  const char* cpu;
  uint64_t mask;
  const char* vendor;  // "" for the vendor-neutral x86-64 levels
}};
const Level kLevels[] = {{
{levels}
}};
const int kNumLevels = sizeof(kLevels) / sizeof(kLevels[0]);
const char kMessage[] = {message};
const char kCompiledFor[] = {record};
const uint64_t kTileState = 0x60000;
const uint64_t kDetected = 1ull << 63;
uint64_t g_host = 0;

bool AmxPermitted() {{
#if defined(__linux__) && defined(SYS_arch_prctl)
  return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
#else
  return false;
#endif
}}

uint64_t Detect() {{
  uint64_t mask = kDetected;
#if defined(__x86_64__) || defined(__i386__)
  unsigned r[4];
  uint64_t xcr0 = 0;
  if (__get_cpuid(1, &r[0], &r[1], &r[2], &r[3]) && (r[2] >> 27 & 1u)) {{  // OSXSAVE
    uint32_t lo, hi;
    __asm__ __volatile__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    xcr0 = (uint64_t)hi << 32 | lo;
  }}
  int amx = -1;
  for (int i = 0; i < kNumFeatures; ++i) {{
    const Feature& f = kFeatures[i];
    if (!__get_cpuid_count(f.leaf, f.subleaf, &r[0], &r[1], &r[2], &r[3])) continue;
    if (!(r[f.reg] >> f.bit & 1u) || (xcr0 & f.xcr0) != f.xcr0) continue;
    if (f.xcr0 & kTileState) {{
      if (amx < 0) amx = AmxPermitted() ? 1 : 0;
      if (!amx) continue;
    }}
    mask |= 1ull << i;
  }}
#endif
  return mask;
}}

uint64_t Host() {{  // detected once; a race only computes the same value twice
  uint64_t host = __atomic_load_n(&g_host, __ATOMIC_ACQUIRE);
  if (!host) {{
    host = Detect();
    __atomic_store_n(&g_host, host, __ATOMIC_RELEASE);
  }}
  return host;
}}

bool Str(const TVMFFIAny* a, const char** data, size_t* size) {{
  if (a->type_index == kTVMFFISmallStr) {{
    *data = a->v_bytes;
    *size = a->small_str_len;
  }} else if (a->type_index == kTVMFFIStr) {{
    TVMFFIByteArray* bytes = TVMFFIBytesGetByteArrayPtr(a->v_obj);
    *data = bytes->data;
    *size = bytes->size;
  }} else if (a->type_index == kTVMFFIRawStr) {{
    *data = a->v_c_str;
    *size = strlen(a->v_c_str);
  }} else {{
    return false;
  }}
  return true;
}}

// Writes the names of the features in `mask` to `out`, comma-separated.
void Names(uint64_t mask, char* out, size_t cap) {{
  size_t used = 0;
  out[0] = '\0';
  for (int i = 0; i < kNumFeatures; ++i) {{
    if (!(mask >> i & 1u)) continue;
    int n = snprintf(out + used, cap - used, "%s%s", used ? ", " : "", kFeatures[i].name);
    if (n < 0 || (size_t)n >= cap - used) break;
    used += (size_t)n;
  }}
}}

// The CPUID vendor string ("GenuineIntel", "AuthenticAMD"), "" where unknown.
void Vendor(char out[13]) {{
  out[0] = '\0';
#if defined(__x86_64__) || defined(__i386__)
  unsigned r[4];
  if (__get_cpuid(0, &r[0], &r[1], &r[2], &r[3])) {{
    memcpy(out, &r[1], 4);
    memcpy(out + 4, &r[3], 4);
    memcpy(out + 8, &r[2], 4);
    out[12] = '\0';
  }}
#endif
}}

// The newest level of the host's vendor (or vendor-neutral) whose features the host has.
const char* Suggest(uint64_t host) {{
  char vendor[13];
  Vendor(vendor);
  for (int i = 0; i < kNumLevels; ++i) {{
    const char* own = kLevels[i].vendor;
    if (own[0] && vendor[0] && strcmp(own, vendor) != 0) continue;
    if ((kLevels[i].mask & host) == kLevels[i].mask) return kLevels[i].cpu;
  }}
  return "x86-64";
}}

void SetNone(TVMFFIAny* result) {{
  result->type_index = kTVMFFINone;
  result->zero_padding = 0;
  result->v_int64 = 0;
}}
}}  // namespace

extern "C" TVM_FFI_DLL_EXPORT int __tvm_ffi_{guard}(void*, const TVMFFIAny* args,
                                                   int32_t num_args, TVMFFIAny* result) {{
  const char* target;
  size_t target_size;
  if (num_args != 2 || args[0].type_index != kTVMFFIInt || !Str(&args[1], &target, &target_size)) {{
    TVMFFIErrorSetRaisedFromCStr("TypeError", "{guard}(mask: int, target: str)");
    return -1;
  }}
  uint64_t host = Host();
  uint64_t missing = (uint64_t)args[0].v_int64 & ~host;
  if (missing) {{
    char names[1024], name[256], message[2048];
    Names(missing, names, sizeof(names));
    snprintf(name, sizeof(name), "%.*s", (int)target_size, target);
    snprintf(message, sizeof(message), kMessage, name, names, Suggest(host));
    TVMFFIErrorSetRaisedFromCStr("RuntimeError", message);
    return -1;
  }}
  SetNone(result);
  return 0;
}}

extern "C" TVM_FFI_DLL_EXPORT int __tvm_ffi_{info}(void*, const TVMFFIAny*, int32_t,
                                                  TVMFFIAny* result) {{
  TVMFFIByteArray bytes = {{kCompiledFor, sizeof(kCompiledFor) - 1}};
  return TVMFFIStringFromByteArray(&bytes, result);
}}
"""


def _c_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal of ASCII text is a valid C literal


def guard_source(target: tvm.target.Target) -> str:
    """The C++ source of the guard for a library compiled for ``target``."""
    rows = (
        f'    {{"{f.name}", {f.leaf:#x}u, {f.subleaf}u, {f.register}u, {f.bit}u, {f.xcr0:#x}ull}},'
        for f in FEATURES
    )
    levels = (
        f'    {{"{cpu}", {feature_mask(cpu_level_features(cpu)):#x}ull, '
        f'"{CPU_LEVEL_VENDORS.get(cpu, "")}"}},'
        for cpu in CPU_LEVELS
    )
    message = GUARD_MESSAGE.replace("%", "%%").format(target="%s", missing="%s", suggest="%s")
    return _SOURCE.format(
        target=describe_target(target),
        features="\n".join(rows),
        levels="\n".join(levels),
        message=_c_string(message),
        record=_c_string(json.dumps(compiled_record(target))),
        guard=GUARD_FUNC,
        info=INFO_FUNC,
    )


def compiled_record(target: tvm.target.Target) -> dict:
    """What an exported library records about the CPU it was compiled for."""
    return {"target": describe_target(target), "features": list(target_cpu_features(target))}


__all__ = [
    "GUARD_FUNC",
    "INFO_FUNC",
    "compiled_record",
    "feature_mask",
    "guard_source",
    "mask_features",
]
