"""Per-rank activation memory of GPT-2 345M blocks with and without --sequence-parallel.

Measured, not computed: each tensor-parallel rank (gloo processes on the CPU) runs the
forward of ``--layers`` GPT-2 345M blocks (h 1024, 16 heads, ffn 4096) on one sample of
``--seq`` tokens under ``torch.autograd.graph.saved_tensors_hooks``, and sums the bytes of
the distinct activation storages autograd keeps for the backward (parameters excluded).
"LN/dropout" is the part saved inside the LayerNorm and hidden-dropout modules, the
region sequence parallelism shards. Full 24 layers at seq 2048 do not fit next to four
other jobs in this machine's 24 GiB, so one block is the default: activations per block
are the same in every block, so the per-rank total is ``layers x`` the figure printed.
fp32 here; fp16/bf16 halve every figure and leave the ratios unchanged. On a GPU the same
split is visible as ``torch.cuda.max_memory_allocated``.

    python benchmarks/sequence_parallel_memory.py [--tp 2 4] [--seq 2048] [--layers 1]
"""
import argparse
import os
import platform
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

HIDDEN, HEADS, FFN = 1024, 16, 4096  # GPT-2 345M (24 layers)


def _measure(layers, seq, sequence_parallel, dropout):
    """Bytes saved for backward on this rank: (all activations, LN/dropout regions)."""
    from megatron import mpu
    from megatron.model.transformer import ParallelTransformerLayer, TransformerConfig
    from megatron.model.utils import causal_attention_mask

    config = TransformerConfig(num_layers=layers, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               kv_channels=HIDDEN // HEADS, ffn_hidden_size=FFN,
                               hidden_dropout=dropout, attention_dropout=dropout,
                               sequence_parallel=sequence_parallel)
    blocks = [ParallelTransformerLayer(config, i + 1) for i in range(layers)]
    params = {p.untyped_storage().data_ptr() for b in blocks for p in b.parameters()}
    hidden = torch.randn(seq, 1, HIDDEN)
    if sequence_parallel:
        hidden = mpu.scatter_to_sequence_parallel_region(hidden)
    hidden.requires_grad_()
    depth, seen, region = [0], {}, set()

    def enter(*_):
        depth[0] += 1

    def leave(*_):
        depth[0] -= 1

    for block in blocks:
        for module in (block.input_layernorm, block.post_attention_layernorm,
                       block.hidden_dropout):
            module.register_forward_pre_hook(enter)
            module.register_forward_hook(leave)

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in params:  # count each activation storage once, whoever saves it
            seen[key] = storage.nbytes()
            if depth[0]:
                region.add(key)
        return t

    mask = causal_attention_mask(seq, hidden.device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = hidden
        for block in blocks:
            out = block(out, mask)
    del out
    return sum(seen.values()), sum(seen[k] for k in region)


def _rank(rank, tp, port, opts, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=tp)
    from megatron import mpu

    mpu.initialize_model_parallel(tp, 1)
    mpu.model_parallel_cuda_manual_seed(1234)
    result = {sp: _measure(opts.layers, opts.seq, sp, opts.dropout) for sp in (False, True)}
    if rank == 0:
        queue.put(result)
    dist.barrier()
    dist.destroy_process_group()


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--dropout", type=float, default=0.1)
    opts = parser.parse_args(argv)
    print("command: python benchmarks/sequence_parallel_memory.py " + " ".join(
        sys.argv[1:] if argv is None else argv))
    print(f"machine: {platform.machine()} {platform.processor() or ''} "
          f"{os.cpu_count()} cores, torch {torch.__version__}, CPU/gloo, fp32")
    print(f"GPT-2 345M blocks (h {HIDDEN}, {HEADS} heads, ffn {FFN}), seq {opts.seq}, "
          f"micro batch 1, {opts.layers} layer(s), dropout {opts.dropout}")
    print(f"{'tp':>3} {'SP':>4} {'activations/rank MiB':>21} {'LN+dropout MiB':>15} "
          f"{'total vs no-SP':>15} {'LN+dropout vs no-SP':>20}")
    ctx = mp.get_context("spawn")
    for tp in opts.tp:
        queue = ctx.Queue()
        port = _free_port()
        procs = [ctx.Process(target=_rank, args=(r, tp, port, opts, queue)) for r in range(tp)]
        for proc in procs:
            proc.start()
        result = queue.get(timeout=1800)
        for proc in procs:
            proc.join()
        base_total, base_region = result[False]
        for sp in (False, True):
            total, region = result[sp]
            print(f"{tp:>3} {'on' if sp else 'off':>4} {total / 2**20:>21.1f} "
                  f"{region / 2**20:>15.1f} {total / base_total:>15.3f} "
                  f"{region / base_region:>20.3f}")


if __name__ == "__main__":
    main()
