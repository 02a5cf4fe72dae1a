# Sourced by the sbatch scripts of this folder: turns Slurm's variables into the cluster
# variables of examples/run_gpt2.sh / run_t5.sh and starts that script once per node.
#
# One Slurm task per node (--ntasks-per-node=1): each task runs torchrun, which starts
# GPUS_PER_NODE ranks on its node. The task's SLURM_PROCID is then its node's rank (with one
# task per node, procid = nodeid under Slurm's block distribution); using the task id rather
# than SLURM_NODEID also lets several tasks on one host act as separate nodes (the tests).

# slurm_launch RUN_SCRIPT: derive NNODES / MASTER_ADDR / MASTER_PORT / GPUS_PER_NODE and the
# job's folders, then `srun` RUN_SCRIPT with NODE_RANK set per task.
slurm_launch() {
  local run_script=$1
  if [ -z "${SLURM_JOB_ID:-}" ]; then
    echo "error: not inside a Slurm job; submit with: sbatch ${BASH_SOURCE[1]:-examples/slurm/<model>.sbatch}" >&2
    return 2
  fi
  if [ ! -f "$run_script" ]; then
    echo "error: $run_script not found; submit from the repository root or set MEGATRON_REPO" >&2
    return 2
  fi
  # One task per node, so the number of tasks is the number of (torchrun) nodes.
  export NNODES=${NNODES:-${SLURM_NTASKS:-$SLURM_NNODES}}
  export MASTER_ADDR=${MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
  # A port from the job id: two jobs sharing a first node do not collide (unless their ids
  # differ by a multiple of 20000).
  export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
  export GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-8}}
  # The rendezvous is per job: a requeued job (same id) starts a fresh one.
  export RDZV_ID=${RDZV_ID:-slurm-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}}
  export LAUNCHER=torchrun  # srun already starts one launcher per node

  # The job's folders: checkpoints keyed by job name, so a resubmitted job resumes; logs and
  # TensorBoard events per job id.
  RUN_DIR=${RUN_DIR:-$MEGATRON_REPO/runs/$SLURM_JOB_NAME}
  export CHECKPOINT_PATH=${CHECKPOINT_PATH:-$RUN_DIR/checkpoints}
  local log_dir=${LOG_DIR:-$RUN_DIR/logs}
  mkdir -p "$CHECKPOINT_PATH" "$log_dir" "$RUN_DIR/tensorboard"
  export TENSORBOARD_DIR=${TENSORBOARD_DIR:-$RUN_DIR/tensorboard/$SLURM_JOB_ID}
  # srun writes each node's output to $log_dir (--output): the run script tees no copy
  export LOG_DIR=""

  echo "slurm job $SLURM_JOB_ID: $NNODES nodes x $GPUS_PER_NODE processes, master" \
       "$MASTER_ADDR:$MASTER_PORT, checkpoints $CHECKPOINT_PATH, logs $log_dir"
  # --kill-on-bad-exit=1 (when every node is needed, MIN_NODES = NNODES): one failing node
  # ends the job instead of leaving the others waiting in a collective until the timeout.
  # With MIN_NODES < NNODES the torchrun agents of the remaining nodes go on without it.
  local kill_on_bad_exit=1
  [ "${MIN_NODES:-$NNODES}" -lt "$NNODES" ] && kill_on_bad_exit=0
  rm -f "$CHECKPOINT_PATH/preempted.txt"
  srun --ntasks="$NNODES" --kill-on-bad-exit=$kill_on_bad_exit \
    --output="$log_dir/%j-node%t.log" \
    bash -c 'export NODE_RANK=$SLURM_PROCID MEGATRON_TDS_LOG_FILE="$1/$SLURM_JOB_ID-node$SLURM_PROCID.log"
             exec bash "$0"' "$run_script" "$log_dir"
  # A run stopped by SIGUSR1/SIGTERM saved, left this marker and exited 0: requeue the job
  # (same job id and name), which resumes from the checkpoint (--load = --save).
  if [ -f "$CHECKPOINT_PATH/preempted.txt" ]; then
    echo "stopped on a signal ($(cat "$CHECKPOINT_PATH/preempted.txt")): requeueing job" \
         "$SLURM_JOB_ID"
    rm -f "$CHECKPOINT_PATH/preempted.txt"
    scontrol requeue "$SLURM_JOB_ID"
  fi
}
