#!/usr/bin/env bash
# One command for a GPU session (the device tool): install the carried DeepSpeed wheel,
# run the GPU tests, the throughput tables (with profiles) and the kernel benchmark, and
# leave everything under $OUT. Build the wheel beforehand on the CPU machine with
#   pip wheel --no-deps deepspeed==0.19.8 -w wheels/
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
if ls wheels/deepspeed-*.whl >/dev/null 2>&1; then
  pip install -q --no-deps wheels/deepspeed-*.whl
  pip install -q hjson pydantic pydantic-core annotated-types typing-inspection
fi
pip install -q -e . --no-deps
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python -m pytest -q -m gpu 2>&1 | tee "$OUT/gpu_tests.txt"
python benchmarks/gpu_throughput.py --profile "$OUT/profiles" --plot "$OUT/gpu_throughput.png" 2>&1 | tee "$OUT/gpu_throughput.txt"
python benchmarks/kernels.py --plot "$OUT/kernels.png" 2>&1 | tee "$OUT/kernels.txt"
