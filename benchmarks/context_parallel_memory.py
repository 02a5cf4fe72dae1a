"""Per-rank activation memory, peak and step time of GPT-2 blocks at context-parallel size
1, 2 and 4, for long sequences (tiny hidden size).

Measured, not computed: each context-parallel rank (gloo processes on the CPU) runs the
forward and backward of ``--layers`` GPT-2 blocks (h ``--hidden``, ``--heads`` heads, ffn 4h,
fp32, no dropout) on its two chunks of one sample of ``--seq`` tokens (the token layout in
the mask slot, as a cp run's batch gives it; cp 1 runs the same way: causal SDPA). Per rank:

- ``saved``: the distinct storages autograd keeps for the backward at the end of the
  forward (``saved_tensors_hooks``, parameters excluded): the activations;
- ``peak``: the most tensor-storage bytes alive at once during the forward and backward
  (tests/peak_tracker.py's ``LivePeak``: inputs, activations, the ring's buffers, score
  tiles, gradients), minus what was alive before (the parameters);
- ``step``: the median wall time of a forward + backward over ``--reps`` repetitions.

The backward starts from a random gradient of the blocks' output (what a head would give
back). Next to each measurement, the memory model's prediction (megatron/memory: the
blocks' saved bytes and their peak, ``saved + the backward's working set``, or the
forward's with the ring's buffers where larger) and the step-time model's per-rank work
relative to cp 1 (its compute terms on a device whose links cost nothing: this CPU's gloo
transfers are not modelled). Ratios are against cp 1 measured in the same run. Absolute
times are of this CPU only.

    python benchmarks/context_parallel_memory.py [--seq 2048 4096 8192 16384] [--cp 1 2 4]
"""
import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]


def _blocks(opts):
    from megatron.model.transformer import ParallelTransformerLayer, TransformerConfig

    config = TransformerConfig(num_layers=opts.layers, hidden_size=opts.hidden,
                               num_attention_heads=opts.heads,
                               kv_channels=opts.hidden // opts.heads,
                               ffn_hidden_size=4 * opts.hidden, hidden_dropout=0.0,
                               attention_dropout=0.0, token_layout=True, seed=1234)
    return [ParallelTransformerLayer(config, i + 1) for i in range(opts.layers)]


def _inputs(seq, opts):
    from megatron import mpu

    layout = mpu.split_for_context_parallel(mpu.token_layout(torch.arange(seq)[None]), 2)
    hidden = mpu.split_for_context_parallel(torch.randn(seq, 1, opts.hidden), 0)
    return hidden.requires_grad_(), layout


def _forward(blocks, hidden, layout):
    out = hidden
    for block in blocks:
        out = block(out, layout)
    return out


def _saved_bytes(blocks, hidden, layout):
    params = {p.untyped_storage().data_ptr() for b in blocks for p in b.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = _forward(blocks, hidden, layout)
    del out
    return sum(seen.values())


def _peak_bytes(blocks, hidden, layout):
    from peak_tracker import LivePeak

    grad = torch.randn_like(hidden)
    with LivePeak() as tracker:
        _forward(blocks, hidden, layout).backward(grad)
    return tracker.peak - tracker.baseline


def _step_seconds(blocks, hidden, layout, reps):
    times = []
    grad = torch.randn_like(hidden)
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        _forward(blocks, hidden, layout).backward(grad)
        dist.barrier()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank(rank, cp, port, opts, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, opts.threads // cp))
    dist.init_process_group("gloo", rank=rank, world_size=cp)
    from megatron import mpu

    mpu.initialize_model_parallel(1, 1, context_parallel_size=cp)
    blocks = _blocks(opts)
    out = {}
    for seq in opts.seq:
        hidden, layout = _inputs(seq, opts)
        saved = _saved_bytes(blocks, hidden, layout)
        peak = _peak_bytes(blocks, hidden, layout)
        step = _step_seconds(blocks, hidden, layout, opts.reps)
        out[seq] = (saved, peak, step)
    queue.put((rank, out))
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(cp, opts):
    """``{seq: (saved, peak, step)}``: the largest per-rank bytes and the slowest rank."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, cp, port, opts, queue)) for r in range(cp)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=3600) for _ in procs]
    for p in procs:
        p.join()
    per_rank = [r for _, r in sorted(results)]
    return {seq: tuple(max(r[seq][i] for r in per_rank) for i in range(3)) for seq in opts.seq}


def _spec(seq, cp, opts):
    from megatron.memory.spec import MemorySpec

    return MemorySpec(family="gpt2", num_layers=opts.layers, hidden=opts.hidden,
                      heads=opts.heads, kv_channels=opts.hidden // opts.heads,
                      ffn=4 * opts.hidden, vocab=opts.hidden, seq=seq, max_positions=seq,
                      micro_batch=1, num_micro_batches=1, cp=cp, dtype="fp32", device="cpu",
                      attention_dropout=0.0, hidden_dropout=0.0)


def predict(seq, cp, opts):
    """``(saved, peak, work)``: the memory model's bytes of the blocks on one rank and the
    step-time model's seconds of their forward and backward on a device with free links
    (only ratios between them mean anything here)."""
    from megatron.memory.chunks import part_bytes
    from megatron.memory.stages import StageLayers
    from megatron.memory.step_time import Device, step_time

    spec = _spec(seq, cp, opts)
    part = part_bytes(spec, StageLayers(0, False, opts.layers, 0, False, False, False))
    peak = part.saved + max(part.transient_first, part.forward)
    dev = Device(peak_tflops=1.0, hbm_gbps=50.0, intra_gbps=1e9, inter_gbps=1e9,
                 latency_s=0.0, kernel_floor_s=0.0)
    work = step_time(spec, dev, 8, [(opts.layers, 0, False)], 0).compute
    return part.saved, peak, work


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="CPU threads shared by the ranks of one cp size")
    parser.add_argument("--json", default=None, help="also write the figures here")
    opts = parser.parse_args(argv)
    print(f"# python benchmarks/context_parallel_memory.py {' '.join(argv or sys.argv[1:])}")
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, gloo; GPT-2 blocks: {opts.layers} x h {opts.hidden}, "
          f"{opts.heads} heads, fp32, micro-batch 1")
    figures = {cp: measure(cp, opts) for cp in opts.cp}
    base = figures[opts.cp[0]]
    print("| seq | cp | saved MiB/rank (model) | peak MiB/rank (model) | step s | saved vs cp 1 "
          "| peak vs cp 1 (model) | step vs cp 1 (model) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    mib = 2**20
    for seq in opts.seq:
        p1 = predict(seq, opts.cp[0], opts)
        for cp in opts.cp:
            saved, peak, step = figures[cp][seq]
            b, p = base[seq], predict(seq, cp, opts)
            print(f"| {seq} | {cp} | {saved / mib:.1f} ({p[0] / mib:.1f}) | {peak / mib:.1f} "
                  f"({p[1] / mib:.1f}) | {step:.3f} | {saved / b[0]:.3f} | {peak / b[1]:.3f} "
                  f"({p[1] / p1[1]:.3f}) | {step / b[2]:.2f} ({p[2] / p1[2]:.2f}) |")
    if opts.json:
        with open(opts.json, "w") as handle:
            json.dump({str(cp): {str(s): {"measured": v, "predicted": predict(s, cp, opts)}
                                 for s, v in f.items()} for cp, f in figures.items()},
                      handle, indent=1)


if __name__ == "__main__":
    main()
