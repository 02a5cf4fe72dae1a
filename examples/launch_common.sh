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

# megatron_launch ENTRY_SCRIPT "FLAGS": start ENTRY_SCRIPT on this node with torchrun or the
# DeepSpeed launcher (LAUNCHER), with the cluster variables.
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
    cmd="torchrun --nproc_per_node $GPUS_PER_NODE --nnodes $NNODES --node_rank $NODE_RANK \
      --master_addr $MASTER_ADDR --master_port $MASTER_PORT $entry $flags"
  fi
  echo "$cmd"
  cd "$repo"
  exec $cmd
}
