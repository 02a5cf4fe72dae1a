#!/usr/bin/env python
"""GPT-2 training-step time: GPT2Model (tp = dp = 1) against a plain PyTorch GPT-2, one run.

    python benchmarks/gpt2_step.py [--layers 4 --hidden 256 --heads 8 --seq 256 --batch 4]

A step is zero_grad + forward + mean next-token loss + backward + AdamW step, fp32, same
sizes, same batch, same dropout, same optimizer settings. GPT2Model runs in a world-size-1
gloo group through megatron.mpu with whatever fused-kernel paths the run would use (the
status line says which; ``--no-fused`` forces the PyTorch paths). The baseline below is an
ordinary GPT-2 in ``[b, s, h]`` layout: nn.Embedding, nn.LayerNorm, nn.Linear (fused QKV),
masked_fill + softmax attention, tanh GeLU, tied output layer, F.cross_entropy.

The two alternate step by step (ABBA order) after warm-up, so they share the machine's
noise; the figure is the ratio of median step times (GPT2Model / baseline). Target <= 1.10.
Process CPU time per step is reported too: on a shared, loaded machine it is the steadier
measure of the work each step does (with ``--threads 1`` it excludes waiting for a core).
"""
import argparse
import math
import os
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.machine import cpu_model  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


class Block(nn.Module):
    """Pre-LN GPT-2 block, ``[b, s, h]``."""

    def __init__(self, hidden, heads, dropout):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc, self.out = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def attention(self, x, causal):
        b, s, h = x.shape
        q, k, v = self.qkv(x).split(h, dim=-1)  # each [b, s, h]
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))  # [b,n,s,d]
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])  # [b, n, s, s]
        probs = self.drop(torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1))
        context = (probs @ v).transpose(1, 2).reshape(b, s, h)
        return self.proj(context)

    def forward(self, x, causal):
        x = x + self.drop(self.attention(self.ln_1(x), causal))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln_2(x)), approximate="tanh")))


class PlainGPT2(nn.Module):
    """The baseline: embeddings, blocks, final LN, logits against the word embedding."""

    def __init__(self, vocab, positions, hidden, heads, layers, dropout):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, hidden), nn.Embedding(positions, hidden)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(hidden, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids, labels):  # [b, s] -> mean loss
        s = ids.shape[1]
        causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).triu_(1)
        x = self.drop(self.wte(ids) + self.wpe(torch.arange(s, device=ids.device)))
        for block in self.blocks:
            x = block(x, causal)
        logits = self.ln_f(x) @ self.wte.weight.t()  # [b, s, v]
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1))


def build_megatron(args):
    """GPT2Model in a world-size-1 gloo group (tp = dp = 1)."""
    import torch.distributed as dist

    from megatron import fused_kernels, mpu
    from megatron.model.gpt2_model import GPT2Model
    from megatron.model.transformer import TransformerConfig

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29511")
        dist.init_process_group("gloo", rank=0, world_size=1)
    mpu.initialize_model_parallel(1, 1)
    mpu.model_parallel_cuda_manual_seed(args.seed)
    status = fused_kernels.load(None)
    config = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden,
                               num_attention_heads=args.heads,
                               kv_channels=args.hidden // args.heads,
                               ffn_hidden_size=4 * args.hidden, hidden_dropout=args.dropout,
                               attention_dropout=args.dropout, seed=args.seed)
    return GPT2Model(config, args.vocab, args.seq), status


def copy_weights(megatron, plain, heads):
    """Give the baseline GPT2Model's weights (to check that both compute the same function)."""
    from megatron.checkpoint_conversion.hf_gpt2 import qkv_to_hf

    src = megatron.state_dict()
    names = {"wte.weight": "embedding.word_embeddings.weight",
             "wpe.weight": "embedding.position_embeddings.weight",
             "ln_f.weight": "transformer.final_layernorm.weight",
             "ln_f.bias": "transformer.final_layernorm.bias"}
    block = {"ln_1": "input_layernorm", "ln_2": "post_attention_layernorm",
             "qkv": "attention.query_key_value", "proj": "attention.dense",
             "fc": "mlp.dense_h_to_4h", "out": "mlp.dense_4h_to_h"}
    for i in range(len(plain.blocks)):
        for ours, theirs in block.items():
            for kind in ("weight", "bias"):
                names[f"blocks.{i}.{ours}.{kind}"] = f"transformer.layers.{i}.{theirs}.{kind}"
    state = {k: src[v] for k, v in names.items()}
    for key in state:
        if ".qkv." in key:  # per-head [heads, (q, k, v), d] -> [q_all | k_all | v_all]
            state[key] = qkv_to_hf(state[key], heads)
    plain.load_state_dict(state)


def megatron_loss(model, ids, labels):
    from megatron.model.utils import causal_attention_mask

    b, s = ids.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    return model(ids, positions, causal_attention_mask(s, ids.device), labels=labels).mean()


def make_step(model, loss_fn, lr=1e-4):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)

    def step(ids, labels):
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model, ids, labels)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def check_same_function(megatron, plain, args):
    """Both models, dropout off, same weights and batch: the losses must agree."""
    g = torch.Generator().manual_seed(args.seed + 1)
    text = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    ids, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    megatron.eval(), plain.eval()
    with torch.no_grad():
        a, b = megatron_loss(megatron, ids, labels).item(), plain(ids, labels).item()
    megatron.train(), plain.train()
    print(f"same function: loss {a:.6f} (GPT2Model) vs {b:.6f} (plain), same weights, "
          f"dropout off")
    if abs(a - b) > 1e-4 * abs(b):
        raise SystemExit("the two models do not compute the same function; fix the baseline")


def machine():
    model = cpu_model()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return (f"{model}, {cores} cores available{load}, torch {torch.__version__} "
            f"({torch.get_num_threads()} intra-op threads)")


def timed(step, ids, labels):
    """(wall seconds, CPU seconds of this process) for one step."""
    wall, cpu = time.perf_counter(), time.process_time()
    step(ids, labels)
    return time.perf_counter() - wall, time.process_time() - cpu


def run(args):
    """Returns ``{"megatron": [(wall, cpu)...], "plain": [...]}`` per step, measured ABBA."""
    torch.manual_seed(args.seed)
    megatron, status = build_megatron(args)
    plain = PlainGPT2(args.vocab, args.seq, args.hidden, args.heads, args.layers, args.dropout)
    print(f"fused kernels: {status}")
    counts = [sum(p.numel() for p in m.parameters()) for m in (megatron, plain)]
    print(f"parameters: GPT2Model {counts[0]:,}, plain {counts[1]:,}")
    copy_weights(megatron, plain, args.heads)
    check_same_function(megatron, plain, args)
    steps = {"megatron": make_step(megatron, megatron_loss),
             "plain": make_step(plain, lambda m, i, l: m(i, l))}
    g = torch.Generator().manual_seed(args.seed)
    text = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    ids, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    for _ in range(args.warmup):
        for step in steps.values():
            step(ids, labels)
    times = {name: [] for name in steps}
    for i in range(args.steps):
        order = ["megatron", "plain"] if i % 2 == 0 else ["plain", "megatron"]
        for name in order:
            times[name].append(timed(steps[name], ids, labels))
    return times


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192, help="already padded")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="measured steps per model")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--no-fused", action="store_true", help="PyTorch paths for GPT2Model")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    if args.no_fused:
        os.environ["MEGATRON_TDS_NO_FUSED_KERNELS"] = "1"
    if args.threads:
        torch.set_num_threads(args.threads)
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"machine: {machine()}")
    print(f"model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq "
          f"{args.seq}, batch {args.batch}, vocab {args.vocab}, dropout {args.dropout}, fp32")
    times = run(args)
    ratios = {}
    for kind, index in (("wall", 0), ("CPU", 1)):
        med = {name: statistics.median(t[index] for t in steps) for name, steps in times.items()}
        for name, label in (("megatron", "GPT2Model (tp=dp=1)"), ("plain", "plain PyTorch GPT-2")):
            values = [t[index] for t in times[name]]
            print(f"{label:20s} {kind:4s}: median {med[name] * 1e3:8.1f} ms/step  "
                  f"(min {min(values) * 1e3:.1f}, max {max(values) * 1e3:.1f}, "
                  f"{len(values)} steps)")
        ratios[kind] = med["megatron"] / med["plain"]
    ratio = ratios["wall"]
    print(f"ratio GPT2Model / plain, median step: wall {ratio:.3f}, process CPU time "
          f"{ratios['CPU']:.3f}  [target <= 1.10 (wall): {'met' if ratio <= 1.10 else 'NOT met'}]")
    return ratio


if __name__ == "__main__":
    main()
