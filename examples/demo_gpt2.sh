#!/bin/bash
# The README's main command: install, build a corpus, train a tokenizer, preprocess, train a
# small GPT-2 with tp=2 x pp=2 x dp=2 (8 CPU processes, or 8 GPUs), save, and sample from it.
#
#   bash examples/demo_gpt2.sh
#
# Everything lands in ./demo/ (corpus, tokenizer, dataset, checkpoints, the training log in
# demo/logs/ and TensorBoard events in demo/logs/tensorboard/). Environment variables of
# examples/run_gpt2.sh (TRAIN_ITERS, GPUS_PER_NODE, LOG_DIR, ...) can be overridden.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
out=${DEMO_DIR:-$repo/demo}
mkdir -p "$out"

echo "== 1/6 install"
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  # the tensorboard extra: the run writes TensorBoard events (demo/logs/tensorboard/)
  pip install -q torch==2.13.0 && pip install -q -e ".[tensorboard]"
fi

echo "== 2/6 sample corpus: docstrings of the installed Python libraries"
[ -f "$out/corpus.jsonl" ] || python tools/make_sample_corpus.py --output "$out/corpus.jsonl" \
  --max-mb "${CORPUS_MB:-3}"

echo "== 3/6 GPT-2 byte-level BPE tokenizer"
[ -f "$out/tokenizer/vocab.json" ] || python tools/train_tokenizer.py --type gpt2 \
  --input "$out/corpus.jsonl" --vocab-size "${VOCAB_SIZE:-4000}" --output-dir "$out/tokenizer"

echo "== 4/6 preprocess to Megatron's .bin/.idx"
[ -f "$out/corpus_text_document.idx" ] || python tools/preprocess_data.py \
  --input "$out/corpus.jsonl" --tokenizer-type GPT2BPETokenizer \
  --vocab-file "$out/tokenizer/vocab.json" --merge-file "$out/tokenizer/merges.txt" \
  --append-eod --workers 2 --output-prefix "$out/corpus"

echo "== 5/6 train: tp=2 x pp=2 x dp=2"
# A re-run trains from scratch: it replaces the last run's checkpoints and, in the demo's
# own events folder, its event files (a resume would find the finished run and train no
# step; two runs' events in one folder draw as one tangled curve). A TENSORBOARD_DIR of
# your own is left alone; earlier logs stay, each run's in its own file.
events_dir=${LOG_DIR:-$out/logs}/tensorboard
[ -n "${TENSORBOARD_DIR+set}" ] && events_dir=""  # yours: not touched
events=$(ls "$events_dir"/events.out.tfevents.* 2>/dev/null || true)
if [ -d "$out/checkpoints" ] || [ -n "$events" ]; then
  last=$(cat "$out/checkpoints/latest_checkpointed_iteration.txt" 2>/dev/null || echo none)
  echo "> re-run: replacing the last run's checkpoints in $out/checkpoints (iteration" \
    "$last)${events:+ and its TensorBoard events in $events_dir}"
  rm -rf "$out/checkpoints"
  [ -z "$events" ] || rm -f "$events_dir"/events.out.tfevents.*
fi
GPUS_PER_NODE=${GPUS_PER_NODE:-8} mp_size=${mp_size:-2} pp_size=${pp_size:-2} \
  NLAYERS=${NLAYERS:-4} NHIDDEN=${NHIDDEN:-128} NHEADS=${NHEADS:-4} SEQLEN=${SEQLEN:-64} \
  BATCHSIZE=${BATCHSIZE:-4} GAS=${GAS:-4} TRAIN_ITERS=${TRAIN_ITERS:-300} LR=${LR:-2e-3} \
  PRECISION=${PRECISION:-fp32} MASTER_PORT=${MASTER_PORT:-29517} \
  DATA_PATH="$out/corpus_text_document" VOCAB_FILE="$out/tokenizer/vocab.json" \
  MERGE_FILE="$out/tokenizer/merges.txt" CHECKPOINT_PATH="$out/checkpoints" \
  LOG_DIR="${LOG_DIR:-$out/logs}" \
  HIDDEN_DROPOUT=${HIDDEN_DROPOUT:-0.0} ATTENTION_DROPOUT=${ATTENTION_DROPOUT:-0.0} \
  EXTRA_ARGS="--log-interval 25 --eval-interval 100 --eval-iters 2 --save-interval 1000 \
    --make-vocab-size-divisible-by 64 --warmup 0.05 --min-lr 2e-4 ${EXTRA_ARGS:-}" \
  bash examples/run_gpt2.sh

echo "== 6/6 generate from the checkpoint"
python tools/generate_samples_gpt2.py --load "$out/checkpoints" --top-k 20 --temperature 0.7 --seed 7 \
  --out-seq-length 40 --prompt "Return the number of" --prompt "This module provides"
