"""examples/slurm/*.sbatch under a real Slurm (Debian's slurm-wlm, started on this host by
tests/slurm_cluster.sh): a job of 2 tasks on one host, each task one "node" of CPU processes,
trains to the same losses as a single-node run of the same script (GPT-2: 2 x 2 vs 4; T5:
2 x 1 vs 2)."""
import glob
import os
import re
import subprocess
import time

import pytest

from gpt2_runs import REPO
from launch_runs import finish, free_port, launch_env, log_losses

# One worker runs this file's tests one after the other: one cluster per test run (the fixture
# is per module, so per worker), and no two jobs competing for its node at once.
pytestmark = pytest.mark.xdist_group("slurm")

CLUSTER = os.path.join(REPO, "tests", "slurm_cluster.sh")
# Derived by the sbatch script from Slurm's variables: must not leak in from the test env.
DERIVED = ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "CHECKPOINT_PATH", "LOG_DIR",
           "TENSORBOARD_DIR")  # slurm_launch derives these from RUN_DIR


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A running one-host cluster; yields the environment its clients need."""
    root = tmp_path_factory.mktemp("slurm")
    up = subprocess.run(["bash", CLUSTER, "start", str(root)], capture_output=True, text=True,
                        timeout=900)
    if up.returncode == 3:
        pytest.skip(f"Slurm unavailable: {up.stderr.strip()}")
    assert up.returncode == 0, up.stdout + up.stderr
    yield {"SLURM_CONF": str(root / "slurm.conf")}
    subprocess.run(["bash", CLUSTER, "stop", str(root)], timeout=60)


def _sbatch(script, env, job_dir):
    """Submit ``script`` as 2 tasks on the one test node and wait; returns the job's text."""
    env = {k: v for k, v in env.items() if k not in DERIVED}
    env.update(RUN_DIR=str(job_dir))
    # The scripts ask for GPUs and 32 CPUs per node; the command line overrides that for a
    # 2-core machine without GPUs, as a user would for a smaller partition.
    cmd = ["sbatch", "--parsable", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2",
           "--cpus-per-task=1", "--gpus-per-node=0", "--time=15",
           f"--output={job_dir}/job.out", script]
    job_dir.mkdir(parents=True)
    submit = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr
    state = _wait_for(submit.stdout.strip().split(";")[0], env)
    logs = sorted(glob.glob(str(job_dir / "logs" / "*-node*.log")))
    texts = [open(path).read() for path in [str(job_dir / "job.out")] + logs]
    assert state == "COMPLETED", state + "\n" + "\n".join(t[-3000:] for t in texts)
    assert [os.path.basename(p).split("-")[1] for p in logs] == ["node0.log", "node1.log"]
    return texts


@pytest.mark.slow
@pytest.mark.exhaustive  # ~50 s; the default run's requeue test runs the same sbatch script
def test_gpt2_sbatch_two_nodes_match_one_node(slurm, gpt2_data, gpt2_one_node_losses,
                                             tmp_path):
    env = launch_env(gpt2_data, tmp_path, GPUS_PER_NODE="2", **slurm)
    texts = _sbatch("examples/slurm/gpt2.sbatch", env, tmp_path / "job")
    assert "2 nodes x 2 processes" in texts[0], texts[0]
    one = gpt2_one_node_losses  # run_gpt2.sh with 4 processes on one node
    assert len(one) == 6 and log_losses(texts) == one  # same layout and seeds: same losses
    ckpt = tmp_path / "job" / "checkpoints" / "latest_checkpointed_iteration.txt"
    assert ckpt.read_text().strip() == "6"


def _t5_env(data, tmp_path, **overrides):
    env = dict(os.environ, OMP_NUM_THREADS="1", GPUS_PER_NODE="2", NNODES="1", NODE_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), mp_size="1",
               pp_size="1", NLAYERS="2", NHIDDEN="32", NHEADS="4", KV_HIDDEN="8",
               FF_HIDDEN="64", ENC_SEQLEN="32", DEC_SEQLEN="8", BATCHSIZE="2", GAS="2",
               TRAIN_ITERS="3", LR="5e-3", PRECISION="fp32", DATA_PATH=data["prefix"],
               TOKENIZER_MODEL=data["spm"], CHECKPOINT_PATH=str(tmp_path / "ckpt"),
               LOG_DIR=str(tmp_path / "logs"),
               EXTRA_ARGS="--log-interval 1 --make-vocab-size-divisible-by 64 "
                          "--split 98,2,0 --eval-iters 0 --hidden-dropout 0 "
                          "--attention-dropout 0")
    env.update(overrides)
    return env


@pytest.mark.slow
@pytest.mark.exhaustive  # the sbatch path is GPT-2's test's; run_t5.sh has its own tests
def test_t5_sbatch_two_nodes_match_one_node(slurm, t5_data, tmp_path):
    one = subprocess.Popen(["bash", "examples/run_t5.sh"], cwd=REPO,
                           env=_t5_env(t5_data, tmp_path / "one"), stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    one = log_losses(finish([one]))
    env = _t5_env(t5_data, tmp_path, GPUS_PER_NODE="1", **slurm)
    texts = _sbatch("examples/slurm/t5.sbatch", env, tmp_path / "job")
    assert "2 nodes x 1 processes" in texts[0], texts[0]
    assert len(one) == 3 and log_losses(texts) == one


#: Job states after which a job never runs again.
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED")


def _wait_for(job, env, timeout=900):
    """The state ``job`` ended in, polled every 0.25 s (``sbatch --wait`` polls at up to 10 s
    intervals: seconds of idle machine per job)."""
    deadline = time.monotonic() + timeout
    while True:
        state, _ = _job_state(job, env)
        if state in ENDED:
            return state
        assert time.monotonic() < deadline, f"job {job} still {state} after {timeout} s"
        time.sleep(0.25)


def _job_state(job, env):
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True,
                         text=True, timeout=30).stdout
    state = re.search(r"JobState=(\w+)", out)
    restarts = re.search(r"Restarts=(\d+)", out)
    return (state.group(1) if state else None), int(restarts.group(1)) if restarts else 0


@pytest.mark.slow
def test_usr1_saves_exits_0_and_the_job_requeues_itself_and_finishes(slurm, gpt2_data,
                                                                      tmp_path):
    """Slurm's warning signal (here sent at once with scancel --signal=USR1, which like
    --signal=USR1@120 reaches the job step's processes, not the batch shell): the run saves
    and exits 0, the script requeues the job, the requeued job resumes and finishes."""
    iters = 60  # ~0.1 s a step: the signal lands mid-run, the resumed run is short
    env = launch_env(gpt2_data, tmp_path, GPUS_PER_NODE="2", mp_size="1", pp_size="1",
                     TRAIN_ITERS=str(iters), **slurm)
    env = {k: v for k, v in env.items() if k not in DERIVED}
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    env.update(RUN_DIR=str(job_dir))
    submit = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--ntasks=1", "--ntasks-per-node=1",
         "--cpus-per-task=1", "--gpus-per-node=0", "--time=15", "--open-mode=append",
         f"--output={job_dir}/job.out", "examples/slurm/gpt2.sbatch"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]
    log = job_dir / "logs" / f"{job}-node0.log"
    deadline = time.monotonic() + 300
    try:
        while not (log.exists() and re.search(r"iteration\s+3/", log.read_text())):
            assert time.monotonic() < deadline, (job_dir / "job.out").read_text()[-3000:]
            time.sleep(0.2)
        subprocess.run(["scancel", "--signal=USR1", job], env=env, check=True, timeout=30)
        state, restarts, released, pending_since = None, 0, False, None
        while state != "COMPLETED":
            state, restarts = _job_state(job, env)
            assert state not in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), state
            if state == "PENDING" and restarts and not released:
                # Slurm holds a requeued job back (its begin time is set ~2 min ahead): a
                # scheduling policy, not part of what is tested; let it start now, but not
                # within the second of the requeue: slurmd then refuses the new launch
                # ("Job credential revoked", the old one's revocation has 1 s resolution)
                pending_since = pending_since or time.monotonic()
                if time.monotonic() - pending_since >= 2:
                    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"],
                                   env=env, timeout=30)
                    released = True
            assert time.monotonic() < deadline, (state, log.read_text()[-3000:])
            time.sleep(0.25)
    finally:
        subprocess.run(["scancel", job], env=env, timeout=30)
    text, out = log.read_text(), (job_dir / "job.out").read_text()
    assert restarts == 1, (restarts, out[-3000:])
    stop = re.search(r"> preempted: SIGUSR1 received by rank \d; stopped at iteration (\d+)",
                     text)
    assert stop, text[-3000:]
    at = int(stop.group(1))
    assert 3 <= at < iters
    assert f"stopped on a signal (iteration {at} signal SIGUSR1" in out, out[-3000:]
    assert re.search(rf"> loaded checkpoint from \S+ at iteration {at}\b", text), text[-3000:]
    ckpt = job_dir / "checkpoints"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(iters)
    assert not (ckpt / "preempted.txt").exists()
