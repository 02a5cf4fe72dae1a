#!/usr/bin/env python
"""Checkpoint stall per save: synchronous saves against ``--async-save``, same run otherwise.

    python benchmarks/async_save.py [--hidden 576] [--layers 8] [--iters 12] [--every 3]

A GPT-2 whose checkpoint (fp32 weights + Adam moments, 12 bytes a parameter) is over 300 MB
by default trains ``--iters`` steps on one process through pretrain_gpt2.py, saving every
``--every`` steps, once with synchronous saves and once with ``--async-save`` (each in a fresh
process, the same data and seed). Measured inside the training process:

- stall per save: time the training thread spends in each save (sync: the whole write;
  async: the host snapshot, plus waiting for the previous write if it is still going); the
  wait at the end of the run for the last background write (sync: none); and the two
  together per save;
- step time: the median step, and the median of the steps that ran while a background
  write was in flight (the writer competes with training for the CPU and the disk);
- the run's wall time from its first step to its return.

Ratios are async / sync from the same invocation. On a CPU-only machine, training and the
writer share the same cores, so the step-time and wall-time figures there are a lower bound
of what a GPU run (whose steps do not need the CPU cores the writer uses) gains.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from benchmarks.machine import cpu_model  # noqa: E402


def machine():
    import torch

    model = cpu_model()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{model}, {cores} cores available, {gpu}, torch {torch.__version__}"


def make_data(root):
    """The test suite's small corpus, tokenizer and indexed dataset (tools/ of this repo)."""
    corpus, tok, prefix = (os.path.join(root, "corpus.jsonl"), os.path.join(root, "tok"),
                           os.path.join(root, "corpus"))
    for cmd in (["tools/make_sample_corpus.py", "--output", corpus, "--max-mb", "0.4"],
                ["tools/train_tokenizer.py", "--type", "gpt2", "--input", corpus,
                 "--vocab-size", "500", "--output-dir", tok],
                ["tools/preprocess_data.py", "--input", corpus, "--tokenizer-type",
                 "GPT2BPETokenizer", "--vocab-file", os.path.join(tok, "vocab.json"),
                 "--merge-file", os.path.join(tok, "merges.txt"), "--append-eod",
                 "--output-prefix", prefix, "--workers", "1"]):
        subprocess.run([sys.executable, *cmd], cwd=REPO, check=True, capture_output=True)
    return {"prefix": f"{prefix}_text_document", "vocab": os.path.join(tok, "vocab.json"),
            "merges": os.path.join(tok, "merges.txt")}


def run_argv(data, args, save, asynchronous):
    argv = ["--num-layers", str(args.layers), "--hidden-size", str(args.hidden),
            "--num-attention-heads", "8", "--seq-length", "32", "--max-position-embeddings",
            "32", "--data-path", data["prefix"], "--vocab-file", data["vocab"], "--merge-file",
            data["merges"], "--tokenizer-type", "GPT2BPETokenizer", "--split", "98,2,0",
            "--make-vocab-size-divisible-by", "64", "--lr", "1e-4", "--batch-size", "2",
            "--train-iters", str(args.iters), "--save", save, "--save-interval",
            str(args.every), "--log-interval", str(args.iters), "--eval-iters", "0",
            "--seed", "1234"]
    return argv + (["--async-save"] if asynchronous else [])


def worker(argv):
    """In the training process: run pretrain_gpt2 with timers on saves and steps."""
    import megatron.resilience.fault_tolerance as ft
    import megatron.training.loop as loop

    saves, steps, marks = [], [], {}
    real_save, real_finish, real_step = ft.RunGuard.save, ft.RunGuard.finish, loop.train_step

    def save(self, *a, **k):
        start = time.perf_counter()
        real_save(self, *a, **k)
        saves.append(time.perf_counter() - start)

    def finish(self):
        start = time.perf_counter()
        real_finish(self)
        marks["final_wait"] = time.perf_counter() - start
        marks["end"] = time.perf_counter()

    def step(*a, **k):
        guard_busy = any(t.name.startswith("checkpoint-writer") for t in
                         __import__("threading").enumerate())
        start = time.perf_counter()
        marks.setdefault("start", start)
        out = real_step(*a, **k)
        steps.append((time.perf_counter() - start, guard_busy))
        return out

    ft.RunGuard.save, ft.RunGuard.finish, loop.train_step = save, finish, step
    import pretrain_gpt2

    pretrain_gpt2.main(argv)
    print("RESULT " + json.dumps({"saves": saves, "steps": steps, **marks}), flush=True)


def measure(data, args, tmp, asynchronous):
    save = os.path.join(tmp, "async" if asynchronous else "sync")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--",
           *run_argv(data, args, save, asynchronous)]
    env = dict(os.environ, PYTHONPATH=REPO, MEGATRON_TDS_NO_FUSED_KERNELS="1")
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"run failed:\n{out.stderr[-3000:]}")
    result = json.loads(next(line[7:] for line in out.stdout.splitlines()
                             if line.startswith("RESULT ")))
    first = os.path.join(save, f"iter_{args.every:07d}")
    result["ckpt_mb"] = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(first)
                            for f in fs) / 2**20
    return result


def summary(r):
    busy = [t for t, b in r["steps"] if b]
    return {"stall_per_save_s": statistics.mean(r["saves"]),
            "final_wait_s": r["final_wait"],
            "stall_with_end_s": (sum(r["saves"]) + r["final_wait"]) / len(r["saves"]),
            "step_median_s": statistics.median(t for t, _ in r["steps"]),
            "step_during_write_s": statistics.median(busy) if busy else None,
            "wall_s": r["end"] - r["start"], "ckpt_mb": r["ckpt_mb"]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.rest)
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"machine: {machine()}")
    with tempfile.TemporaryDirectory() as tmp:
        data = make_data(tmp)
        sync = summary(measure(data, args, tmp, False))
        asyn = summary(measure(data, args, tmp, True))
    print(f"checkpoint per save: {sync['ckpt_mb']:.0f} MB; {args.iters} steps, a save every "
          f"{args.every} ({args.iters // args.every} saves)")
    print(f"{'':24}{'sync':>10}{'async':>10}{'async/sync':>12}")
    for key, label in (("stall_per_save_s", "stall per save (s)"),
                       ("final_wait_s", "wait at the end (s)"),
                       ("stall_with_end_s", "stall/save, end incl."),
                       ("step_median_s", "median step (s)"),
                       ("step_during_write_s", "step during a write (s)"),
                       ("wall_s", "run wall time (s)")):
        a, s = asyn[key], sync[key]
        if s is None or a is None or s == 0:
            print(f"{label:24}{'-' if s is None else f'{s:.3f}':>10}"
                  f"{'-' if a is None else f'{a:.3f}':>10}{'-':>12}")
        else:
            print(f"{label:24}{s:10.3f}{a:10.3f}{a / s:12.3f}")


if __name__ == "__main__":
    main()
