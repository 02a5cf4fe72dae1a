#!/bin/bash
# A one-host Slurm cluster for tests: slurmctld + slurmd of Debian's slurm-wlm, with all
# state, logs and the config in one folder, on free ports, so it touches nothing in /etc.
#
#   bash tests/slurm_cluster.sh start DIR   # installs slurm-wlm if missing, starts, waits idle
#   bash tests/slurm_cluster.sh stop DIR    # stops the daemons started with DIR
#
# Clients (sbatch, srun, scontrol) find the cluster through SLURM_CONF=DIR/slurm.conf.
# Exit codes of start: 0 up; 3 Slurm cannot be installed here (the caller skips, with the
# message on stderr); anything else is a failure to report.
# Authentication is auth/none: the cluster listens on this host only and lives for one test,
# so there is no munge daemon or key to manage.
set -euo pipefail

action=${1:?usage: slurm_cluster.sh start|stop DIR}
dir=${2:?usage: slurm_cluster.sh start|stop DIR}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

install_slurm() {
  command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
    && return 0
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "slurm-wlm is not installed and cannot be installed here (needs root and apt-get)" >&2
    return 3
  fi
  echo "installing slurm-wlm with apt-get (log: $dir/apt.log)" >&2
  if ! { apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y slurm-wlm; } \
      >"$dir/apt.log" 2>&1; then
    echo "apt-get install slurm-wlm failed: $(tail -n 3 "$dir/apt.log" | tr '\n' ' ')" >&2
    return 3
  fi
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

write_config() {
  local node cpus mem
  node=$(hostname -s)
  # nproc honours OMP_NUM_THREADS (often 1 in test runs), which is not the machine's size;
  # and the tests' jobs need 2 tasks per node: declare at least 4 (config_overrides lets
  # slurmd take the configured size over what it detects).
  cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
  [ "$cpus" -ge 4 ] || cpus=4
  # Declared a little below the machine's memory: slurmd drains a node whose real memory is
  # below the configured one. The topology is spelled out so that slurmd does not reduce
  # the CPUs to one per socket when it cannot read the machine's topology.
  mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
  mkdir -p "$dir/state" "$dir/spool" "$dir/log"
  # Job ids from a random start: the run scripts derive MASTER_PORT from the job id, and two
  # test clusters on one host (two test runs at once) would otherwise both run job 1 on the
  # same port.
  local first_job=$(( $(od -An -N2 -tu2 /dev/urandom) % 19000 + 1 ))
  cat >"$dir/slurm.conf" <<EOF
ClusterName=tdstest
FirstJobId=$first_job
SlurmctldHost=$node(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
SlurmdParameters=config_overrides
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus Sockets=1 CoresPerSocket=$cpus ThreadsPerCore=1 RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

stop_cluster() {
  local name pid
  for name in slurmd slurmctld; do
    [ -f "$dir/$name.pid" ] || continue
    pid=$(cat "$dir/$name.pid")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$dir/$name.pid"
  done
}

start_cluster() {
  install_slurm || exit $?
  write_config
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -f "$SLURM_CONF" -i  # -i: ignore state left by an earlier cluster in DIR
  slurmd -f "$SLURM_CONF"
  local state=""
  for _ in $(seq 100); do
    state=$(sinfo -h -o %T 2>/dev/null | head -n1 || true)
    [ "$state" = idle ] && { echo "slurm up: SLURM_CONF=$SLURM_CONF"; return 0; }
    sleep 0.3
  done
  echo "slurm did not come up (node state '$state'); logs:" >&2
  tail -n 20 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
  stop_cluster
  exit 1
}

case $action in
  start) start_cluster ;;
  stop) stop_cluster ;;
  *) echo "unknown action $action (start|stop)" >&2; exit 2 ;;
esac
