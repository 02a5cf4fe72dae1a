#!/usr/bin/env python
"""Cost of hashing checkpoint files while they are written (and of verifying them on load).

    python benchmarks/checkpoint_digest.py [--size-mb 1024] [--rounds 5] [--dir /tmp]

Saves one state dict of ``--size-mb`` MB of fp32 tensors (16 MB each, as a model's weights
and Adam moments are) through the checkpoint write path, flushed to disk as every save is
(``write_atomic``: temporary name, ``fsync``, rename, ``fsync`` of the folder), in these
variants, interleaved round after round in a rotating order so that a change of the disk's or
the machine's load hits all of them alike:

- ``plain``: ``torch.save`` to a path, the save path without digests (the baseline);
- ``file object``: ``torch.save`` through a Python file object, no hash (the wrapper's cost);
- ``xxh3_128`` (the project's choice), ``crc32``, ``blake2b``: ``torch.save`` through
  :class:`~megatron.checkpoint.digest.DigestingWriter` with that hash, large records hashed on
  a helper thread while they are written
  (:func:`~megatron.checkpoint.format.write_checkpoint_file` for ``xxh3_128``);
- ``xxh3_128 serial``: the same with each record hashed before it is written.

It prints each variant's median and fastest save time and four ratios to ``plain`` (of the
medians, of the fastest saves, the median of the per-round ratios, which pairs saves made
moments apart, and of the median CPU time of the saving process, which other processes on a
shared machine disturb least; the goal for the chosen hash: under 1.05), each hash's own
speed on the data in memory, and on the load side the time to verify the file
(:func:`~megatron.checkpoint.digest.file_digest`, a streamed read) against a ``torch.load``
of it.
"""
import argparse
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint.digest import (ALGORITHMS, DEFAULT_ALGORITHM,  # noqa: E402
                                        file_digest, new_hash, save_with_digest)
from megatron.checkpoint.format import write_atomic, write_checkpoint_file  # noqa: E402

TENSOR_MB = 16


class _PlainFile:
    """``torch.save`` through a Python file object, no hash."""

    def __init__(self, raw):
        self.raw = raw

    def write(self, data):
        return self.raw.write(data)

    def flush(self):
        self.raw.flush()


def _state(size_mb):
    count = max(1, size_mb // TENSOR_MB)
    numel = TENSOR_MB * (1 << 20) // 4
    gen = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(numel, generator=gen) for i in range(count)}


def _save_plain(state, path):
    write_atomic(path, lambda tmp: torch.save(state, tmp))


def _save_file_object(state, path):
    def write(tmp):
        with open(tmp, "wb") as raw:
            torch.save(state, _PlainFile(raw))
    write_atomic(path, write)


def _save_hashed(algorithm, overlap=True):
    if algorithm == DEFAULT_ALGORITHM and overlap:
        return lambda state, path: write_checkpoint_file(path, state)  # the project's path
    return lambda state, path: write_atomic(
        path, lambda tmp: save_with_digest(state, tmp, algorithm, overlap))


def _variants():
    variants = {"plain": _save_plain, "file object": _save_file_object}
    for algorithm in [DEFAULT_ALGORITHM] + sorted(set(ALGORITHMS) - {DEFAULT_ALGORITHM}):
        variants[algorithm] = _save_hashed(algorithm)
    variants[f"{DEFAULT_ALGORITHM} serial"] = _save_hashed(DEFAULT_ALGORITHM, overlap=False)
    return variants


def _time_saves(state, folder, rounds):
    variants = _variants()
    names = list(variants)
    times = {name: [] for name in names}
    cpu = {name: [] for name in names}
    path = os.path.join(folder, "model_optim_rng.pt")
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order
            start, start_cpu = time.perf_counter(), time.process_time()
            variants[name](state, path)
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
            os.remove(path)
    return times, cpu


def _hash_speed(state, algorithm):
    digest = new_hash(algorithm)
    start = time.perf_counter()
    for tensor in state.values():
        digest.update(memoryview(tensor.numpy()).cast("B"))
    return time.perf_counter() - start


def _load_side(state, folder, rounds):
    path = os.path.join(folder, "model_optim_rng.pt")
    write_checkpoint_file(path, state)
    verify, load = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        file_digest(path)
        verify.append(time.perf_counter() - start)
        start = time.perf_counter()
        torch.load(path, map_location="cpu", weights_only=True)
        load.append(time.perf_counter() - start)
    os.remove(path)
    return statistics.median(verify), statistics.median(load)


def _cpu_name():
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="checkpoint size")
    parser.add_argument("--rounds", type=int, default=5, help="saves per variant")
    parser.add_argument("--dir", default=None, help="where to write (default: the temp dir)")
    args = parser.parse_args(argv)
    state = _state(args.size_mb)
    size_gb = sum(t.numel() * t.element_size() for t in state.values()) / 1e9
    given = sys.argv[1:] if argv is None else argv
    print(f"command: python benchmarks/checkpoint_digest.py {shlex.join(given)}".rstrip())
    print(f"machine: {_cpu_name()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, python {platform.python_version()}; "
          f"fsync {'on' if os.environ.get('MEGATRON_TDS_FSYNC', '1') != '0' else 'off'}")
    folder = tempfile.mkdtemp(prefix="digest_bench_", dir=args.dir)
    try:
        times, cpu = _time_saves(state, folder, args.rounds)
        verify, load = _load_side(state, folder, max(1, args.rounds // 2))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    base = statistics.median(times["plain"])
    print(f"checkpoint: {size_gb:.3f} GB ({len(state)} fp32 tensors), {args.rounds} saves "
          f"per variant, interleaved")
    print(f"{'variant':<15} {'median save s':>14} {'min s':>8} {'median / plain':>15} "
          f"{'min / plain':>12} {'per-round / plain':>18} {'CPU s / plain':>14} "
          f"{'hash s/GB (memory)':>19}")
    for name, values in times.items():
        speed = f"{_hash_speed(state, name) / size_gb:.3f}" if name in ALGORITHMS else "-"
        paired = statistics.median(v / p for v, p in zip(values, times["plain"]))
        fastest = min(values) / min(times["plain"])
        work = statistics.median(cpu[name]) / statistics.median(cpu["plain"])
        print(f"{name:<15} {statistics.median(values):>14.3f} {min(values):>8.3f} "
              f"{statistics.median(values) / base:>15.3f} {fastest:>12.3f} "
              f"{paired:>18.3f} {work:>14.3f} {speed:>19}")
    print(f"load side: verify {verify:.3f} s, torch.load {load:.3f} s, verify / load "
          f"{verify / load:.3f}")
    return times


if __name__ == "__main__":
    main()
