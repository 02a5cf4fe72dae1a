#!/bin/bash
# Pretrain GPT-2 with data x tensor x pipeline parallelism (CPM-Pretrain's launcher shape).
#
# Edit the variables below (or set them in the environment) and run this script on every
# node:  bash examples/run_gpt2.sh
# Multi-node: same script on each node with NNODES, NODE_RANK and MASTER_ADDR set, e.g.
#   node 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash examples/run_gpt2.sh
#   node 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 bash examples/run_gpt2.sh
# Each node waits (up to 10 min) until all NNODES have joined, so they may start apart.
# The settings are checked once before the launcher starts (a bad one: one message, exit 2).
# Ctrl-C (or SIGTERM) saves at the next step boundary and exits 0; a second Ctrl-C aborts.
# Without GPUs, GPUS_PER_NODE CPU processes start and talk over gloo.
# LAUNCHER=deepspeed uses the DeepSpeed launcher with examples/hostfile instead of torchrun.
set -euo pipefail
script_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$script_dir")

# ---- cluster -------------------------------------------------------------------------
GPUS_PER_NODE=${GPUS_PER_NODE:-8}     # processes per node (GPUs, or CPU processes)
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
LAUNCHER=${LAUNCHER:-torchrun}        # torchrun | deepspeed
# ---- surviving failures (docs/fault_tolerance.md) ---------------------------------------
MIN_NODES=${MIN_NODES:-$NNODES}       # fewest nodes a run starts or restarts on (< NNODES: opt-in)
MAX_RESTARTS=${MAX_RESTARTS:-3}       # restarts of the job after a failed worker or node
STEP_TIMEOUT=${STEP_TIMEOUT:-}        # seconds: a rank with no finished step is ended
ASYNC_SAVE=${ASYNC_SAVE:-0}           # 1: checkpoints written on a background thread
HOSTFILE=${HOSTFILE:-$script_dir/hostfile}

# ---- parallelism: world = GPUS_PER_NODE x NNODES = mp_size x cp_size x pp_size x dp ---
mp_size=${mp_size:-2}                 # tensor parallel
cp_size=${cp_size:-1}                 # context parallel: ranks splitting each sequence (long SEQLEN)
pp_size=${pp_size:-2}                 # pipeline stages (1 = no pipeline)
vpp_size=${vpp_size:-1}               # model chunks per pipeline stage (> 1: interleaved 1F1B)
PIPELINE_SCHEDULE=${PIPELINE_SCHEDULE:-}  # 1f1b | interleaved | zb-h1 | zbv (zero bubble); empty: implied
ep_size=${ep_size:-1}                 # expert parallel: ranks splitting the experts (out of dp x cp)
NUM_EXPERTS=${NUM_EXPERTS:-}          # experts per MoE layer (empty: dense; docs/moe.md)

# ---- model -----------------------------------------------------------------------------
NLAYERS=${NLAYERS:-24}
NHIDDEN=${NHIDDEN:-1024}
NHEADS=${NHEADS:-16}
SEQLEN=${SEQLEN:-1024}

# ---- batch: global batch = BATCHSIZE x GAS x dp (at NNODES; kept on fewer nodes) ------
BATCHSIZE=${BATCHSIZE:-4}             # micro-batch per process
GAS=${GAS:-8}                         # gradient accumulation (= micro-batches per pipeline step)
TRAIN_ITERS=${TRAIN_ITERS:-100000}
LR=${LR:-1.5e-4}
HIDDEN_DROPOUT=${HIDDEN_DROPOUT:-0.1}  # dropout of the layers' outputs (--hidden-dropout)
ATTENTION_DROPOUT=${ATTENTION_DROPOUT:-0.1}  # of the attention probabilities (0 for cp_size > 1)
PRECISION=${PRECISION:-auto}          # fp32 | fp16 | bf16 | auto (fp16 on GPUs, fp32 on a CPU)
FP8=${FP8:-}                          # e4m3 | hybrid: the layers' linear GEMMs in float8 (bf16
                                      # around them; GPUs of compute capability >= 8.9)
FP8_RECIPE=${FP8_RECIPE:-tensorwise}  # tensorwise | rowwise scaling (with FP8)

# ---- data and checkpoints ---------------------------------------------------------------
DATA_PATH=${DATA_PATH:-$repo/data/corpus_text_document}
VOCAB_FILE=${VOCAB_FILE:-$repo/data/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-$repo/data/gpt2-merges.txt}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-$repo/checkpoints/gpt2}
config_json=${config_json:-$script_dir/ds_config_gpt2.json}
LOG_DIR=${LOG_DIR-$repo/logs/gpt2}    # each node's output, also in a file here (empty: none)
TENSORBOARD_DIR=${TENSORBOARD_DIR-${LOG_DIR:+$LOG_DIR/tensorboard}}  # event files (empty: none)
EXTRA_ARGS=${EXTRA_ARGS:-}

# ---- speed ------------------------------------------------------------------------------
RECOMPUTE=${RECOMPUTE:-0}             # 1: activation recompute (--checkpoint-activations)
ATTENTION_BACKEND=${ATTENTION_BACKEND:-auto}  # auto|flash|fused: SDPA; unfused|local: bmm
COMPILE=${COMPILE:-0}                 # 1: torch.compile each pipeline chunk (pp 1: the model)
USE_DEEPSPEED=${USE_DEEPSPEED:-0}     # 1: DeepSpeed data parallelism (ZeRO) at pp_size 1
CHECK_ONLY=${CHECK_ONLY:-0}           # 1: check the settings, print the verdict, launch nothing

source "$script_dir/launch_common.sh"
megatron_precision_and_deepspeed_args fp16
megatron_speed_args
megatron_batch_args
megatron_fault_args
megatron_log_args

gpt_args="--model-parallel-size $mp_size --context-parallel-size $cp_size --pipe-parallel-size $pp_size \
  --virtual-pipeline-model-parallel-size $vpp_size ${PIPELINE_SCHEDULE:+--pipeline-schedule $PIPELINE_SCHEDULE} \
  --expert-model-parallel-size $ep_size ${NUM_EXPERTS:+--num-experts $NUM_EXPERTS} \
  --num-layers $NLAYERS --hidden-size $NHIDDEN --num-attention-heads $NHEADS \
  --seq-length $SEQLEN --max-position-embeddings $SEQLEN \
  $batch_args --train-iters $TRAIN_ITERS \
  --lr $LR --min-lr 1.0e-5 --lr-decay-style cosine --warmup 0.01 --weight-decay 0.01 \
  --hidden-dropout $HIDDEN_DROPOUT --attention-dropout $ATTENTION_DROPOUT \
  --clip-grad 1.0 --hidden-bias $speed_args \
  --data-path $DATA_PATH --data-impl mmap --split 949,50,1 \
  --tokenizer-type GPT2BPETokenizer --vocab-file $VOCAB_FILE --merge-file $MERGE_FILE \
  --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH --save-interval 1000 \
  --log-interval 10 --eval-interval 1000 --eval-iters 10 \
  $precision_args $ds_args $fault_args $log_args $EXTRA_ARGS"

megatron_launch "$repo/pretrain_gpt2.py" "$gpt_args"
