# Shared by run_gpt2.sh and run_t5.sh (sourced after their variables are set): the flags
# that follow from PRECISION / pp_size, the log, the settings check and the launcher
# command. Edit the run scripts.

# True when this node computes on GPUs (CUDA_VISIBLE_DEVICES="" / -1 or MEGATRON_DEVICE=cpu
# say it does not).
megatron_has_gpu() {
  [ "${MEGATRON_DEVICE:-}" = cpu ] && return 1
  case "${CUDA_VISIBLE_DEVICES-unset}" in ""|-1) return 1 ;; esac
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q "^GPU"
}

# megatron_precision_and_deepspeed_args GPU_DEFAULT: sets precision_args (--fp16 / --bf16)
# from PRECISION (auto: GPU_DEFAULT on GPUs, fp32 on a CPU, where DeepSpeed runs no fp16 and
# bf16 has no fast kernels on most CPUs) and ds_args: the DeepSpeed config is always passed
# (without --deepspeed its ZeRO stage 1 asks for the distributed optimizer; DeepSpeed's engine
# steps only with --deepspeed), and USE_DEEPSPEED=1 asks for that engine (at pp_size 1).
# FP8=e4m3|hybrid adds the FP8 GEMMs (--fp8-format, with FP8_RECIPE=tensorwise|rowwise);
# they run under bf16, which PRECISION=auto then picks on GPUs and CPUs alike.
megatron_precision_and_deepspeed_args() {
  if [ "$PRECISION" = auto ]; then
    if [ -n "${FP8:-}" ]; then PRECISION=bf16
    elif megatron_has_gpu; then PRECISION=$1; else PRECISION=fp32; fi
    echo "> PRECISION=auto: $PRECISION"
  fi
  case "$PRECISION" in
    fp32) precision_args="" ;;
    fp16) precision_args="--fp16" ;;
    bf16) precision_args="--bf16" ;;
    *) echo "error: PRECISION=$PRECISION: use fp32, fp16, bf16 or auto" >&2; exit 2 ;;
  esac
  if [ -n "${FP8:-}" ]; then
    precision_args="$precision_args --fp8-format $FP8 --fp8-recipe ${FP8_RECIPE:-tensorwise}"
  fi
  ds_args="--deepspeed_config $config_json"
  if [ "${USE_DEEPSPEED:-0}" = 1 ]; then
    ds_args="--deepspeed $ds_args"
  fi
}

# Sets speed_args from RECOMPUTE (1: recompute each layer's activations in backward, for
# models that do not fit otherwise; 0, the default: no recompute, the faster step),
# ATTENTION_BACKEND (auto = scaled_dot_product_attention; unfused/local = Megatron's bmm +
# fused softmax) and COMPILE (1: torch.compile each pipeline chunk, its loss included).
megatron_speed_args() {
  speed_args="--attention-backend ${ATTENTION_BACKEND:-auto}"
  [ "${RECOMPUTE:-0}" = 1 ] && speed_args="$speed_args --checkpoint-activations"
  [ "${COMPILE:-0}" = 1 ] && speed_args="$speed_args --compile"
  return 0
}

# Sets batch_args: the micro-batch and the global batch (BATCHSIZE x GAS x the full
# data-parallel size), never --gas itself: a run restarted on fewer nodes (MIN_NODES) keeps
# the global batch and accumulates more micro-batches (gas = global / (micro x dp)).
megatron_batch_args() {
  local dp_full=$(( GPUS_PER_NODE * NNODES / (mp_size * ${cp_size:-1} * pp_size) ))
  GLOBAL_BATCH=${GLOBAL_BATCH:-$(( BATCHSIZE * GAS * dp_full ))}
  batch_args="--batch-size $BATCHSIZE --global-batch-size $GLOBAL_BATCH"
}

# Sets fault_args: save and exit 0 on Ctrl-C / SIGTERM / SIGUSR1 (Slurm's --signal=USR1@120),
# a hang watchdog when STEP_TIMEOUT is set, background saves when ASYNC_SAVE=1
# (docs/fault_tolerance.md).
megatron_fault_args() {
  fault_args="--exit-signal-handler"
  [ -n "${STEP_TIMEOUT:-}" ] && fault_args="$fault_args --step-timeout $STEP_TIMEOUT"
  [ "${ASYNC_SAVE:-0}" = 1 ] && fault_args="$fault_args --async-save"
  return 0
}

# Sets log_args from TENSORBOARD_DIR (TensorBoard event files; empty: none). The node's
# output goes to a log file in LOG_DIR (megatron_launch).
megatron_log_args() {
  log_args=""
  [ -n "${TENSORBOARD_DIR:-}" ] && log_args="--tensorboard-dir $TENSORBOARD_DIR"
  return 0
}

# Everything this node prints also goes to LOG_DIR/<date>-<time>-node<NODE_RANK>.log (none
# when LOG_DIR is empty). tee ignores Ctrl-C and the stop signals, so it outlives a stopping
# run and writes its last lines.
megatron_log_to_file() {
  [ -n "${LOG_DIR:-}" ] || return 0
  mkdir -p "$LOG_DIR"
  LOG_FILE="$LOG_DIR/$(date +%Y%m%d-%H%M%S)-node$NODE_RANK.log"
  export MEGATRON_TDS_LOG_FILE=$LOG_FILE
  exec > >(trap '' INT TERM USR1 HUP; exec tee -a "$LOG_FILE") 2>&1
  echo "> log: $LOG_FILE"
}

# On a CPU, OMP_NUM_THREADS = the cores / the processes per node, for every launcher
# (torchrun alone sets 1, with a warning; the DeepSpeed launcher sets none, and 8 processes
# each using every core step 5-7x slower). On GPUs torchrun's 1. A value set is kept.
megatron_cpu_threads() {
  [ -n "${OMP_NUM_THREADS:-}" ] && return 0
  if megatron_has_gpu; then
    export OMP_NUM_THREADS=1
  else
    local threads=$(( $(nproc) / GPUS_PER_NODE ))
    export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
  fi
}

# megatron_launch ENTRY_SCRIPT "FLAGS": check the settings once, then start ENTRY_SCRIPT on
# this node with torchrun or the DeepSpeed launcher (LAUNCHER), with the cluster variables.
#
# The check (megatron/launch/check.py) runs the entry script's validation in one process for
# the whole world (GPUS_PER_NODE x NNODES): a bad setting is one message naming the flag and
# the variable here that sets it, and exit 2, before any launcher starts.
#
# torchrun (through megatron/launch/torchrun.py: Ctrl-C or SIGTERM saves and exits 0, a
# second Ctrl-C aborts) waits until NNODES nodes have joined at MASTER_ADDR:MASTER_PORT;
# MIN_NODES < NNODES (opt-in) starts or restarts with as few as MIN_NODES. A failed worker
# (or a node that stops answering) restarts the job up to MAX_RESTARTS times, each time from
# the latest checkpoint (--load = --save); fewer nodes = smaller data-parallel size, same
# global batch. The rendezvous store is the agent's on MASTER_ADDR.
megatron_launch() {
  local entry=$1 flags=$2 cmd script
  script=${BASH_SOURCE[1]:-run script}
  cd "$repo"
  [ "${CHECK_ONLY:-0}" = 1 ] || megatron_log_to_file
  megatron_cpu_threads
  ${PYTHON:-python} -m megatron.launch.check --script "$script" \
    --world-size $(( GPUS_PER_NODE * NNODES )) "$entry" $flags || exit $?
  # CHECK_ONLY=1: the verdict only (a planned layout's line, tools/plan_layout.py, checked
  # before a cluster is booked)
  [ "${CHECK_ONLY:-0}" = 1 ] && exit 0
  if [ "$LAUNCHER" = deepspeed ]; then
    # The DeepSpeed launcher reaches the hosts of a hostfile over passwordless ssh (pdsh);
    # on one node it starts the processes itself. Its runner and per-node launch processes
    # log at INFO by default (the command, the world, "Setting CUDA_VISIBLE_DEVICES" even on
    # a CPU, each process spawned and exited): WARNING here. On one node its runner still
    # looks for a hostfile (/job/hostfile) and warns that it found none, though none is
    # wanted: ERROR there. Without a GPU, DS_ACCELERATOR=cpu names the accelerator that its
    # detection would otherwise warn it fell back to, in the runner and the launch process
    # (the workers name it themselves: tds/__init__.py).
    local hosts="" level=error
    [ "$NNODES" -gt 1 ] && hosts="--hostfile $HOSTFILE" && level=warning
    megatron_has_gpu || export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
    cmd="deepspeed $hosts --log_level $level --num_nodes $NNODES --num_gpus $GPUS_PER_NODE \
      --master_addr $MASTER_ADDR --master_port $MASTER_PORT $entry $flags"
  else
    cmd="${PYTHON:-python} -m megatron.launch.torchrun --nproc_per_node $GPUS_PER_NODE \
      --nnodes ${MIN_NODES:-$NNODES}:$NNODES --max-restarts ${MAX_RESTARTS:-3} \
      --rdzv-backend c10d --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT \
      --rdzv-id ${RDZV_ID:-megatron-tds} ${RDZV_CONF:+--rdzv-conf $RDZV_CONF} $entry $flags"
  fi
  echo "$cmd"
  # Slurm's warning signal reaches every process of the job step: the agent ignores it (its
  # default action would end the agent), the workers catch it (--exit-signal-handler).
  trap '' USR1
  exec $cmd
}
