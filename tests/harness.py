"""Multi-rank test harness: run a function on N CPU ranks with gloo.

    from harness import run_distributed

    def _check(x):               # module level, so the ranks can import it
        ...                      # torch.distributed is initialised here
        return something_picklable

    def test_it():
        results = run_distributed(_check, 4, 1.5)    # one entry per rank

How it works:
- Ranks are forked from a forkserver that has already imported torch (and
  torch._dynamo, which torch's optimizers import on first use: 1-2 s per rank
  otherwise), so a rank starts in milliseconds (8 ranks on 2 cores).
- The parent hosts the rendezvous TCPStore on a free port (port 0), so two
  tests never race for a port.
- Each rank writes stdout/stderr to its own log file. When a rank raises, its
  traceback and the tail of every rank's log are put in the failure message.
- A timeout turns a hang into a failure: the parent asks every rank still
  running to dump its Python stacks (faulthandler on SIGUSR1), then kills it.
- After the first rank fails, the others get a short grace period to report
  their own errors (so "raises on every rank" is visible), then are killed.
"""
import faulthandler
import multiprocessing
import os
import pickle
import queue
import signal
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "numpy", "deepspeed",
                              "tds", "megatron.training"])

#: Seconds the other ranks get to report after the first rank failed.
ERROR_GRACE_S = 5.0
#: Seconds the ranks of a successful run get to tear down and exit before they are killed.
TEARDOWN_WAIT_S = 5.0
#: Lines of each rank's log shown in a failure message.
LOG_TAIL_LINES = 40


class DistributedTestFailure(AssertionError):
    """One or more ranks raised, crashed or timed out."""


def _worker(fn, rank, world_size, port, log_path, result_q, env, threads, args, kwargs):
    log = open(log_path, "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
         "LOCAL_WORLD_SIZE": str(world_size)}
    )
    os.environ.update(env)
    torch.set_num_threads(threads)
    try:
        if os.environ.get("MEGATRON_TDS_TEST_CPU_FP16"):
            from precision import emulate_cpu_fp16_if_asked

            emulate_cpu_fp16_if_asked()  # as in the pytest process (tests/precision.py)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=600))
        # gloo's set-up is no barrier: a rank whose fn fails at once would exit and close its
        # connections while a slower peer still builds its mesh (that peer then fails in
        # init_process_group, not with the error under test)
        dist.barrier()
        result = fn(*args, **kwargs)
        # By value: the queue's pickler would pass a tensor as a handle to this process's
        # shared memory, which the parent can no longer open once this rank has exited.
        result_q.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # report everything, including SystemExit
        result_q.put((rank, "error", traceback.format_exc()))
        return
    _teardown()


def _teardown():
    try:
        from megatron import mpu

        mpu.destroy_model_parallel()
    except Exception:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()


def _tail(path, n=LOG_TAIL_LINES):
    try:
        with open(path, errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return "<no log>"
    return "\n".join(lines[-n:]) if lines else "<empty log>"


def _collect(procs, result_q, timeout):
    """Wait for every rank's report; returns (results, errors, timed_out)."""
    results, errors = {}, {}
    deadline = time.monotonic() + timeout
    timed_out = False
    while len(results) + len(errors) < len(procs):
        now = time.monotonic()
        if now >= deadline:
            timed_out = not errors
            break
        try:
            rank, status, payload = result_q.get(timeout=min(0.2, deadline - now))
        except queue.Empty:
            for rank, proc in enumerate(procs):
                if rank in results or rank in errors or proc.is_alive():
                    continue
                try:  # its report may still be in the pipe
                    r, status, payload = result_q.get(timeout=1.0)
                    if status == "ok":
                        results[r] = pickle.loads(payload)
                    else:
                        errors[r] = payload
                except queue.Empty:
                    errors[rank] = f"rank {rank} exited with code {proc.exitcode} without reporting"
            if errors:
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
            continue
        if status == "ok":
            results[rank] = pickle.loads(payload)
        else:
            errors[rank] = payload
            deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
    for rank, proc in enumerate(procs):  # ranks that died while the grace period ran out
        if rank not in results and rank not in errors and proc.exitcode not in (None, 0):
            errors[rank] = f"rank {rank} exited with code {proc.exitcode} without reporting"
    return results, errors, timed_out


def _stop(procs, failed):
    """End every rank. After a failure, the ones still running first dump their stacks to
    their logs (for the report); after success they are only tearing down: a short wait for
    them to exit, no dump."""
    alive = [p for p in procs if p.is_alive()]
    if failed:
        for p in alive:
            os.kill(p.pid, signal.SIGUSR1)  # dump stacks to the rank's log
        if alive:
            time.sleep(0.5)
    else:
        deadline = time.monotonic() + TEARDOWN_WAIT_S
        for p in alive:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=10)


def run_distributed(fn, world_size, *args, timeout=180, env=None, threads=1, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` gloo ranks; return the per-rank results.

    Args:
        fn: a module-level function (the ranks import it by name).
        world_size: number of ranks.
        timeout: seconds before a hang is reported as a failure.
        env: extra environment variables for every rank.
        threads: torch intra-op threads per rank (1 keeps 8 ranks on 2 cores sane).

    Raises:
        DistributedTestFailure: a rank raised, crashed or the run timed out; the
            message holds each failing rank's traceback and every rank's log tail.
    """
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    result_q = _CTX.Queue()
    with tempfile.TemporaryDirectory(prefix="mrank_") as logdir:
        logs = [os.path.join(logdir, f"rank{r}.log") for r in range(world_size)]
        procs = [
            _CTX.Process(
                target=_worker,
                args=(fn, r, world_size, store.port, logs[r], result_q, dict(env or {}),
                      threads, args, kwargs),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results, errors, timed_out = {}, {}, True
        try:
            results, errors, timed_out = _collect(procs, result_q, timeout)
        finally:
            _stop(procs, failed=bool(errors) or timed_out or len(results) < world_size)
        if errors or timed_out or len(results) < world_size:
            raise DistributedTestFailure(_report(fn, world_size, errors, results, timed_out,
                                                 timeout, logs))
    del store
    return [results[r] for r in range(world_size)]


def _report(fn, world_size, errors, results, timed_out, timeout, logs):
    name = getattr(fn, "__qualname__", repr(fn))
    lines = [f"{name} on {world_size} ranks failed"]
    if timed_out:
        missing = sorted(set(range(world_size)) - set(results))
        lines[0] += f": timed out after {timeout}s, ranks {missing} did not finish"
    for rank in sorted(errors):
        lines.append(f"\n----- rank {rank} raised -----\n{errors[rank].rstrip()}")
    for rank, path in enumerate(logs):
        lines.append(f"\n----- rank {rank} log (tail) -----\n{_tail(path)}")
    return "\n".join(lines)
