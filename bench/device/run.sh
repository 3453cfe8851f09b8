#!/usr/bin/env bash
# One call on a lent GPU machine (see bench/device/README.md): set up TVM and tvmamp from .dev/,
# then `pytest -m gpu`, bench/bench_cuda.py, and the CPU benches (bf16 GEMM, SimpleNet, conv
# net, transformer layer, training step) at 1, 4 and 16 threads. Each step has its own time
# limit and its own log under $OUT, so a step that fails or runs long loses nothing else.
# `python3 -P`: the repository root must not shadow the installed tvmamp (its subpackages are
# mapped from relay_passes/, schedules/ and targets/).
# Usage (device tool): bash bench/device/run.sh [steps], steps from: gpu cuda cpu1 cpu4 cpu16 avx512 intel amx amxc suite epilogue
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
steps=${1:-gpu cuda cpu1 cpu4 cpu16 avx512}
t0=$SECONDS
{
  date -u; lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Socket|NUMA node\(s\)|L2|L3'
  grep -o -w -E 'amx_bf16|amx_tile|avx512_bf16|avx512_fp16|avx512f' /proc/cpuinfo | sort | uniq -c
  nvidia-smi -L; python3 -V; command -v nvcc gcc
} > "$OUT/env.log" 2>&1
cat "$OUT/env.log"
nvcc_bin=$(command -v nvcc || ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1)
[ -n "$nvcc_bin" ] && export PATH="$PATH:$(dirname "$nvcc_bin")" CUDA_HOME="$(dirname "$(dirname "$nvcc_bin")")"
cudart=$(find /usr/local /opt /usr/lib -name 'libcudart.so.13*' 2>/dev/null | head -1)
[ -n "$cudart" ] && export LD_LIBRARY_PATH="$(dirname "$cudart")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "nvcc=$nvcc_bin cudart=$cudart"
if ! pp=$(bash bench/device/setup.sh /tmp/site 2> "$OUT/setup.log"); then
  echo "setup failed:"; tail -30 "$OUT/setup.log"; exit 1
fi
export PYTHONPATH=$pp
python3 -P -c "import tvm, tvmamp; print('tvm', tvm.__version__, 'cuda', tvm.cuda(0).exist)" 2>&1 | tail -3
echo "setup done at $((SECONDS - t0)) s"

run() {  # run NAME LIMIT CMD...: log to $OUT/NAME.log, print status
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >> "$OUT/$name.log" 2>&1
  echo "[$name] rc=$? $((SECONDS - start)) s (at $((SECONDS - t0)) s): $*"
}
cpu() {  # cpu THREADS [LOG] [KERNEL]: the CPU benches at THREADS threads
  local n=$1 log=${2:-cpu_t$1} kernel=${3:-auto}
  export TVM_NUM_THREADS=$n
  run "$log" 120 python3 bench/bench_cpu_bf16.py --threads "$n" --skip-large --repeat 7 \
    --kernel "$kernel" --shapes 1024x1024x1024,257x4096x1024,128x768x3072
  [ "$kernel" = auto ] || return 0
  run "$log" 60 python3 bench/bench_transformer.py --threads "$n" --repeat 7
  run "$log" 60 python3 bench/bench_training.py --repeat 3
}
for s in $steps; do
  case $s in
    gpu) xdist=$(python3 -c 'import xdist' 2>/dev/null && echo "-n 8")
         # shellcheck disable=SC2086
         run gpu_tests 200 python3 -P -m pytest -m gpu tests/targets/test_cuda_gpu.py -q $xdist \
           -p no:cacheprovider -rs ;;
    cuda) run cuda_bench 150 python3 bench/bench_cuda.py ;;
    cpu1) cpu 1 ;;
    cpu4) cpu 4 ;;
    cpu16) cpu 16 ;;
    avx512) grep -q amx_tile /proc/cpuinfo && cpu 1 cpu_avx512_t1 vdpbf16ps ;;
    suite) # the CPU tests on this host's CPU (AMX, avx512_fp16), the frontends' left out
         TVM_NUM_THREADS=2 run suite 170 python3 -P -m pytest tests --ignore=tests/frontends \
           -n 16 -v -p no:cacheprovider --timeout 150 -rf ;;
    intel) # tests of the session's attention, softmax and ONNX converter work on this host's CPU
         TVM_NUM_THREADS=2 run intel_tests 100 python3 -P -m pytest -n 16 -q -p no:cacheprovider \
           -rf tests/relay_passes/test_attention_ops.py tests/relay_passes/test_attention_keys.py \
           tests/schedules/test_cpu_bf16_softmax.py tests/frontends/test_onnx_converters.py ;;
    epilogue) # test_an_operand_the_epilogue_also_reads[(2, 5, 5)] alone (it ran past the 100 s
         # timeout on its worker on 2026-11-28), then its steps timed after an AMX kernel, as on
         # that worker; faulthandler dumps the stacks of a hang
         to=$(python3 -c 'import pytest_timeout' 2>/dev/null && echo "--timeout 35")
         # shellcheck disable=SC2086
         run epilogue 40 python3 -P -m pytest -x -q --tb=long -p no:cacheprovider $to \
           -o faulthandler_timeout=25 --durations=5 \
           "tests/schedules/test_cpu_bf16_matmul.py::test_an_operand_the_epilogue_also_reads[(2, 5, 5)]"
         run epilogue 30 python3 -P bench/device/epilogue_operand.py --amx-first --hang 20 ;;
    amx) TVM_NUM_THREADS=1 run amx_blocking 240 python3 bench/bench_amx_blocking.py \
           --k-blocks 128,256,384,512,768,1024,4096 --n-blocks auto,64,128,256,512 ;;
    amxc) # whole GEMMs in C from the AMX tile step, in several loop orders: no TVM
         TVM_NUM_THREADS=1 run amx_loop_orders 100 python3 bench/bench_amx_blocking.py \
           --loop-orders ;;
  esac
done
echo; echo "=== summary (logs in \$OUT)"
for f in "$OUT"/gpu_tests.log "$OUT"/intel_tests.log; do [ -f "$f" ] && tail -8 "$f"; done
for f in "$OUT"/epilogue.log; do
  [ -f "$f" ] && grep -E '[0-9.]+s (call|setup|teardown)|: [0-9.]+ s|^err|^nan|^amx|passed|failed|Error|Timeout|^Thread|File ' "$f" | head -60
done
for f in "$OUT"/suite.log; do
  [ -f "$f" ] && { grep -E "FAILED|ERROR" "$f" | head -40; grep -c PASSED "$f"; tail -3 "$f"; }
done
for f in "$OUT"/cuda_bench.log "$OUT"/cpu_*.log "$OUT"/amx_blocking.log; do
  [ -f "$f" ] && { echo "--- $(basename "$f")"; grep -E '^\| |^target|Error|error:' "$f" | grep -v -E '^\|---' | head -60; }
done
for f in "$OUT"/amx_loop_orders.log; do
  [ -f "$f" ] && { echo "--- $(basename "$f")"; grep -E '^\| |AMX|peak|register-only|loop orders|wrong|Error|error:' "$f" | grep -v -E '^\|---' | head -100; }
done
exit 0  # the steps report their own rc above; a missing log is not a failure
