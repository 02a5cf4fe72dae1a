# Shared by run_gpt2.sh and run_t5.sh (sourced after their variables are set): the flags
# that follow from PRECISION / pp_size, and the launcher command. Edit the run scripts.

# Sets precision_args (--fp16 / --bf16) and ds_args: the DeepSpeed config is always passed
# (pretrain() uses it when it trains through an engine: pipeline stages, or --deepspeed),
# and USE_DEEPSPEED=1 asks for DeepSpeed's data parallelism without pipeline stages.
megatron_precision_and_deepspeed_args() {
  precision_args=""
  [ "$PRECISION" = fp16 ] && precision_args="--fp16"
  [ "$PRECISION" = bf16 ] && precision_args="--bf16"
  ds_args="--deepspeed_config $config_json"
  if [ "${USE_DEEPSPEED:-0}" = 1 ]; then
    ds_args="--deepspeed $ds_args"
  fi
}

# Sets speed_args from RECOMPUTE (1: recompute each layer's activations in backward, for
# models that do not fit otherwise; 0, the default: no recompute, the faster step),
# ATTENTION_BACKEND (auto = scaled_dot_product_attention; unfused/local = Megatron's bmm +
# fused softmax) and COMPILE (1: torch.compile each transformer layer).
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
  local dp_full=$(( GPUS_PER_NODE * NNODES / (mp_size * pp_size) ))
  GLOBAL_BATCH=${GLOBAL_BATCH:-$(( BATCHSIZE * GAS * dp_full ))}
  batch_args="--batch-size $BATCHSIZE --global-batch-size $GLOBAL_BATCH"
}

# Sets fault_args: save and exit 0 on SIGTERM / SIGUSR1 (Slurm's --signal=USR1@120), a hang
# watchdog when STEP_TIMEOUT is set, background saves when ASYNC_SAVE=1
# (docs/fault_tolerance.md).
megatron_fault_args() {
  fault_args="--exit-signal-handler"
  [ -n "${STEP_TIMEOUT:-}" ] && fault_args="$fault_args --step-timeout $STEP_TIMEOUT"
  [ "${ASYNC_SAVE:-0}" = 1 ] && fault_args="$fault_args --async-save"
  return 0
}

# megatron_launch ENTRY_SCRIPT "FLAGS": start ENTRY_SCRIPT on this node with torchrun or the
# DeepSpeed launcher (LAUNCHER), with the cluster variables.
#
# torchrun runs as an elastic agent: a failed worker (or a node that stops answering)
# restarts the job up to MAX_RESTARTS times, each time from the latest checkpoint
# (--load = --save), with as many nodes as rendezvous within the time (MIN_NODES..NNODES:
# fewer nodes = smaller data-parallel size, same global batch); a node that comes back
# joins at the next restart. The rendezvous store is the agent's on MASTER_ADDR.
megatron_launch() {
  local entry=$1 flags=$2 cmd
  if [ "$LAUNCHER" = deepspeed ]; then
    # The DeepSpeed launcher reaches the hosts of a hostfile over passwordless ssh (pdsh);
    # on one node it starts the processes itself.
    local hosts=""
    [ "$NNODES" -gt 1 ] && hosts="--hostfile $HOSTFILE"
    cmd="deepspeed $hosts --num_nodes $NNODES --num_gpus $GPUS_PER_NODE \
      --master_addr $MASTER_ADDR --master_port $MASTER_PORT $entry $flags"
  else
    cmd="torchrun --nproc_per_node $GPUS_PER_NODE --nnodes ${MIN_NODES:-$NNODES}:$NNODES \
      --max-restarts ${MAX_RESTARTS:-3} --rdzv-backend c10d \
      --rdzv-endpoint $MASTER_ADDR:$MASTER_PORT --rdzv-id ${RDZV_ID:-megatron-tds} \
      ${RDZV_CONF:+--rdzv-conf $RDZV_CONF} $entry $flags"
  fi
  echo "$cmd"
  cd "$repo"
  # Slurm's warning signal reaches every process of the job step: the agent ignores it (its
  # default action would end the agent), the workers catch it (--exit-signal-handler).
  trap '' USR1
  exec $cmd
}
