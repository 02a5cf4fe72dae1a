#!/usr/bin/env bash
# One command for a GPU session (the device tool): the GPU tests, the throughput tables with a
# profile of one step per case, and the kernel tables, everything under $OUT.
#
#   bash benchmarks/run_h100.sh [PHASE ...]       (default: every phase, in this order)
#
# Phases: env (versions, nvidia-smi), build (the CUDA and CPU kernels, once), tests (pytest -m
# gpu), checks (the tests and tests/gpu_probe_t5_fp16.py side by side: neither is timed),
# kernels (benchmarks/kernels.py at the models' shapes), eager (throughput tables, the eager
# cases), compiled (the --compile cases and compiled baselines), t5ab (T5 compiled and eager,
# masked SDPA calls with and without cuDNN, one process: issue 43's A/B), graphs (--compile
# with --cuda-graphs and on the DeepSpeed path), throughput (the tables with $THROUGHPUT_ARGS). Each phase has its own time limit (PHASE_LIMIT_<name> seconds), so one
# that runs long leaves the rest their time.
#
# The GPU machine has no package index: DeepSpeed and what it needs beyond the machine's image
# travel as wheels in .whl/ (ignored by git; see docs/benchmarks.md for the pip commands).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
T0=$(date +%s)
log() { echo "[$(( $(date +%s) - T0 )) s] $*" | tee -a "$OUT/phases.txt"; }

if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || log "wheel install FAILED"
fi
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 MEGATRON_TDS_BUILD_DIR=/tmp/megatron-tds-build
PHASES=${*:-env build tests kernels eager compiled}

limit() { local v="PHASE_LIMIT_$1"; echo "${!v:-$2}"; }

for phase in $PHASES; do
  log "phase $phase: start"
  case $phase in
    env)
      { nvidia-smi; python3 -c "import torch, deepspeed, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name()); print('deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)"; } > "$OUT/env.txt" 2>&1
      tail -3 "$OUT/env.txt" ;;
    build)  # both kernel sets at once: the CPU reference runs of the tests use the C++ ones
      timeout "$(limit build 240)" python3 -c "
import time, torch
from megatron.fused_kernels import build
t = time.time(); m = build.load_kernels('cuda'); print('cuda kernels', m is not None, f'{time.time() - t:.0f} s', build._ERRORS)
" 2>&1 | tail -5 &
      timeout "$(limit build 240)" python3 -c "
import time
from megatron.fused_kernels import build
t = time.time(); m = build.load_kernels('cpu'); print('cpu kernels', m is not None, f'{time.time() - t:.0f} s', build._ERRORS)
" 2>&1 | tail -5
      wait ;;
    tests|checks)
      if [ "$phase" = checks ]; then
        timeout "$(limit checks 240)" python3 tests/gpu_probe_t5_fp16.py > "$OUT/probe.txt" 2>&1 &
      fi
      timeout "$(limit tests 240)" python3 -m pytest -q -m gpu -n "${GPU_TEST_WORKERS:-8}" \
        -p no:cacheprovider --durations=15 ${GPU_TESTS:-} > "$OUT/gpu_tests.txt" 2>&1
      echo "pytest rc=$?" >> "$OUT/gpu_tests.txt"
      wait
      grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/gpu_tests.txt" | tail -40
      [ "$phase" = checks ] && grep -vE "^\[|WARNING" "$OUT/probe.txt" | tail -12 ;;
    kernels)
      timeout "$(limit kernels 120)" python3 benchmarks/kernels.py --dtypes bf16 \
        --seqs "${KERNEL_SEQS-1024,2048}" --hiddens "${KERNEL_HIDDENS-768,1024,4096}" \
        --json "$OUT/kernels.json" > "$OUT/kernels.txt" 2>&1
      echo "kernels rc=$?" >> "$OUT/kernels.txt"
      grep -vE "^\[|WARNING" "$OUT/kernels.txt" | tail -30 ;;
    eager)
      timeout "$(limit eager 240)" python3 benchmarks/gpu_throughput.py --kinds eager,unfused,deepspeed \
        --baselines eager --batches "${BATCHES:-8,16}" --profile /tmp/profiles \
        > "$OUT/throughput_eager.txt" 2>&1
      echo "throughput rc=$?" >> "$OUT/throughput_eager.txt"
      grep -E "^(###|\||--- profile)|rc=|Error" "$OUT/throughput_eager.txt" | tail -60 ;;
    compiled)
      timeout "$(limit compiled 300)" python3 benchmarks/gpu_throughput.py --kinds compile \
        --baselines compiled --batches "${BATCHES:-8,16}" --profile /tmp/profiles \
        > "$OUT/throughput_compiled.txt" 2>&1
      echo "throughput rc=$?" >> "$OUT/throughput_compiled.txt"
      grep -E "^(###|\||--- profile)|rc=|Error" "$OUT/throughput_compiled.txt" | tail -60 ;;
    t5ab)
      timeout "$(limit t5ab 300)" python3 benchmarks/gpu_throughput.py --models t5 \
        --kinds compile,compile-nocudnn,eager,eager-nocudnn --baselines compiled \
        --profile /tmp/profiles > "$OUT/throughput_t5ab.txt" 2>&1
      echo "throughput rc=$?" >> "$OUT/throughput_t5ab.txt"
      grep -E "^(###|\||--- profile)|rc=|Error" "$OUT/throughput_t5ab.txt" | tail -40 ;;
    graphs)
      timeout "$(limit graphs 300)" python3 benchmarks/gpu_throughput.py --models gpt2 \
        --kinds compile,compile-cudagraphs,compile-deepspeed --baselines compiled \
        --batches "${BATCHES:-16}" > "$OUT/throughput_graphs.txt" 2>&1
      echo "throughput rc=$?" >> "$OUT/throughput_graphs.txt"
      grep -E "^(###|\||--- profile)|rc=|Error" "$OUT/throughput_graphs.txt" | tail -40 ;;
    throughput)
      timeout "$(limit throughput 300)" python3 benchmarks/gpu_throughput.py ${THROUGHPUT_ARGS:-} \
        --profile /tmp/profiles > "$OUT/throughput.txt" 2>&1
      echo "throughput rc=$?" >> "$OUT/throughput.txt"
      grep -E "^(###|\||--- profile)|rc=|Error" "$OUT/throughput.txt" | tail -60 ;;
    *) log "unknown phase $phase (env build tests checks kernels eager compiled t5ab graphs throughput)"
       exit 2 ;;
  esac
  log "phase $phase: done"
done
