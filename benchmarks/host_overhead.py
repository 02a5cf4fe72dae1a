#!/usr/bin/env python
"""Host overhead of a training step: the real ``pretrain()`` step against what a user writes.

    python benchmarks/host_overhead.py [--steps 30 --runs 2 --threads 1]

At sizes where compute is negligible (GPT-2: 4 layers, hidden 64, seq 64, micro-batch 8, gas 2,
vocab ~8000; T5: 2+2 layers, d 64, enc 64 / dec 16, micro-batch 8, gas 2), what is left of a
step is host work, the part that stays the same on a GPU: ops dispatched, Python run, syncs.
Each model is timed two ways, in one run:

- ``megatron``: ``pretrain_gpt2.main`` / ``pretrain_t5.main`` on data prepared with the project's
  own tools (one rank, fp32, dropout 0, clipping 1.0, no log line inside the timed steps);
  a step is the time from one ``train_step`` start to the next (the loop's bookkeeping too);
- ``plain``: benchmarks/plain_models.py's GPT-2 (nanoGPT-style) / transformers'
  T5ForConditionalGeneration, same sizes, same torch AdamW implementation and settings,
  ``clip_grad_norm_(1.0)``, the loss read every step (what such a loop does to print it).

Per step: median wall ms of the best run (runs alternate which goes first, in separate
processes) and median CPU ms of the training thread (steadier on a shared machine: it does
not count waiting for a core; the prefetch thread's reading is not in it), their ratios
megatron / plain, the aten ops dispatched (a TorchDispatchMode count) and the syncs (value
reads and host copies, tests/sync_count.py). ``--op-diff`` lists the ops
whose counts differ. Timings are CPU timings: only the ratios and counts are claims.
"""
import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))  # sync_count.py, the counter the tests use

MARK = "HOST_OVERHEAD_JSON "


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="gpt2,t5", help="comma-separated: gpt2, t5")
    p.add_argument("--steps", type=int, default=30, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--count-steps", type=int, default=2, help="steps whose ops are counted")
    p.add_argument("--runs", type=int, default=2, help="alternating runs (best one kept)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--gas", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=8000, help="tokenizers trained to this")
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "host_overhead"),
                   help="prepared corpus, tokenizers and indexed data (built once)")
    p.add_argument("--corpus-mb", type=float, default=2.0)
    p.add_argument("--gpt2-data", nargs=3, metavar=("PREFIX", "VOCAB", "MERGES"),
                   help="prepared GPT-2 data instead of --workdir's")
    p.add_argument("--t5-data", nargs=2, metavar=("PREFIX", "SPM_MODEL"),
                   help="prepared T5 (sentencepiece) data instead of --workdir's")
    p.add_argument("--op-diff", action="store_true", help="print ops whose counts differ")
    p.add_argument("--megatron-flags", default="",
                   help="extra flags for the megatron run, e.g. '--no-layernorm-fusion'")
    p.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one model, one run
    p.add_argument("--plain-first", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---------------------------------------------------------------- data (project tools)
def _tool(*argv):
    subprocess.run([sys.executable, *argv], check=True, cwd=REPO, capture_output=True)


def prepare_data(opts):
    """Corpus, GPT-2 BPE and sentencepiece tokenizers, indexed datasets (cached), unless
    ``--gpt2-data`` and ``--t5-data`` give prepared ones."""
    if opts.gpt2_data and opts.t5_data:
        (prefix, vocab, merges), (t5_prefix, spm) = opts.gpt2_data, opts.t5_data
        return {"gpt2": ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab,
                         "--merge-file", merges, "--data-path", prefix],
                "sentencepiece": ["--tokenizer-type", "SentencePieceTokenizer",
                                  "--tokenizer-model", spm, "--data-path", t5_prefix]}
    root = os.path.abspath(opts.workdir)
    os.makedirs(root, exist_ok=True)
    corpus = os.path.join(root, "corpus.jsonl")
    if not os.path.exists(corpus):
        _tool("tools/make_sample_corpus.py", "--output", corpus, "--max-mb", str(opts.corpus_mb))
    data = {}
    for kind, tok_flags in (("gpt2", ("--tokenizer-type", "GPT2BPETokenizer")),
                            ("sentencepiece", ("--tokenizer-type", "SentencePieceTokenizer"))):
        tok = os.path.join(root, f"{kind}_{opts.vocab_size}")
        if not os.path.isdir(tok):
            _tool("tools/train_tokenizer.py", "--type", kind, "--input", corpus,
                  "--vocab-size", str(opts.vocab_size), "--output-dir", tok)
        files = (("--vocab-file", f"{tok}/vocab.json", "--merge-file", f"{tok}/merges.txt")
                 if kind == "gpt2" else ("--tokenizer-model", f"{tok}/spm.model"))
        prefix = os.path.join(tok, "corpus")
        if not os.path.exists(prefix + "_text_document.bin"):
            _tool("tools/preprocess_data.py", "--input", corpus, *tok_flags, *files,
                  "--append-eod", "--output-prefix", prefix, "--workers", "1")
        data[kind] = [*tok_flags, *files, "--data-path", prefix + "_text_document"]
    return data


# ---------------------------------------------------------------- the two steps
GPT2 = dict(layers=4, hidden=64, heads=4, seq=64)
T5 = dict(layers=2, hidden=64, heads=4, kv=16, ffn=256, enc=64, dec=16)


def megatron_argv(model, opts, data, iters):
    common = ["--batch-size", str(opts.micro_batch), "--gas", str(opts.gas),
              "--train-iters", str(iters), "--lr", "1e-4", "--min-lr", "1e-5",
              "--warmup", "0.1", "--clip-grad", "1.0", "--hidden-dropout", "0",
              "--attention-dropout", "0", "--log-interval", str(10**6),
              "--eval-interval", str(10**6), "--eval-iters", "0", "--split", "100,0,0",
              "--make-vocab-size-divisible-by", "64", "--seed", "1234",
              *shlex.split(opts.megatron_flags)]
    if model == "gpt2":
        g = GPT2
        return common + data["gpt2"] + [
            "--num-layers", str(g["layers"]), "--hidden-size", str(g["hidden"]),
            "--num-attention-heads", str(g["heads"]), "--seq-length", str(g["seq"]),
            "--max-position-embeddings", str(g["seq"])]
    t = T5
    return common + data["sentencepiece"] + [
        "--num-layers", str(t["layers"]), "--hidden-size", str(t["hidden"]),
        "--num-attention-heads", str(t["heads"]), "--kv-hidden-size", str(t["kv"]),
        "--ff-hidden-size", str(t["ffn"]), "--enc-seq-length", str(t["enc"]),
        "--dec-seq-length", str(t["dec"])]


def time_megatron(model, opts, data):
    """Run the real pretrain(); per-step times (start to start) and the counted steps."""
    from sync_count import SyncCounter

    from megatron.training import loop

    warm, timed, counted = opts.warmup, opts.steps, opts.count_steps
    starts, counters, original = [], [], loop.train_step

    def step(*args, **kwargs):
        starts.append((time.perf_counter(), time.thread_time()))
        if len(starts) <= warm + timed + 1:  # the last timed step ends at this start
            return original(*args, **kwargs)
        with SyncCounter(count_ops=True) as counter:
            out = original(*args, **kwargs)
        counters.append(counter)
        return out

    loop.train_step = step
    try:
        entry = __import__("pretrain_gpt2" if model == "gpt2" else "pretrain_t5")
        entry.main(megatron_argv(model, opts, data, warm + timed + 1 + counted))
    finally:
        loop.train_step = original
    from megatron.common.global_vars import get_args

    times = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(starts[warm:warm + timed],
                                                          starts[warm + 1:])]
    return times, counters, get_args().padded_vocab_size


def plain_setup(model, vocab, opts):
    """(module, loss function of a batch, batch factory) for the plain baseline."""
    import torch

    from benchmarks.plain_models import PlainGPT2, hf_t5

    mb = opts.micro_batch
    if model == "gpt2":
        g = GPT2
        net = PlainGPT2(vocab, g["seq"], g["hidden"], g["heads"], g["layers"])

        def batch():
            text = torch.randint(0, vocab, (mb, g["seq"] + 1))  # [b, s + 1]
            return text[:, :-1], text[:, 1:]

        return net, lambda m, b: m(*b), batch
    t = T5
    net = hf_t5(vocab, t["layers"], t["hidden"], t["ffn"], t["heads"], t["kv"])

    def batch():
        return (torch.randint(0, vocab, (mb, t["enc"])), torch.randint(0, vocab, (mb, t["dec"])),
                torch.randint(0, vocab, (mb, t["dec"])))

    def loss(m, b):
        return m(input_ids=b[0], decoder_input_ids=b[1], labels=b[2]).loss

    return net, loss, batch


def time_plain(model, vocab, opts):
    """The loop a user writes: gas micro-batches, clip 1.0, AdamW, loss printed each step."""
    import torch

    from sync_count import SyncCounter

    torch.manual_seed(1234)
    net, loss_fn, batch = plain_setup(model, vocab, opts)
    net.train()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4, weight_decay=0.01)
    batches = [batch() for _ in range(4 * opts.gas)]

    def step(i):
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for j in range(opts.gas):
            loss = loss_fn(net, batches[(i * opts.gas + j) % len(batches)]) / opts.gas
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        return float(total)  # the loss a plain loop prints

    times, counters = [], []
    for i in range(opts.warmup + opts.steps):
        start, cpu = time.perf_counter(), time.thread_time()
        step(i)
        if i >= opts.warmup:
            times.append((time.perf_counter() - start, time.thread_time() - cpu))
    for i in range(opts.count_steps):
        with SyncCounter(count_ops=True) as counter:
            step(i)
        counters.append(counter)
    return times, counters


def summary(times, counters):
    from collections import Counter

    ops = Counter()
    for c in counters:
        ops.update(c.ops)
    n = max(len(counters), 1)
    return {"ms": statistics.median(t for t, _ in times) * 1e3,
            "cpu_ms": statistics.median(c for _, c in times) * 1e3,
            "ops": sum(ops.values()) / n,
            "syncs": sum(c.count for c in counters) / n,
            "op_counts": {k: v / n for k, v in ops.items()}}


def worker(opts):
    """One model, one run, in this process: megatron and plain, in the order asked."""
    import torch

    torch.set_num_threads(opts.threads)
    data = json.loads(os.environ["HOST_OVERHEAD_DATA"])
    result = {}
    if opts.plain_first:  # the plain step needs the padded vocabulary: take it from the flags
        from megatron.config import build_run_config
        from megatron.families import get_family

        cfg, _ = build_run_config(megatron_argv(opts.worker, opts, data, 1),
                                  get_family(opts.worker))
        result["plain"] = summary(*time_plain(opts.worker, cfg.model.padded_vocab_size, opts))
    times, counters, vocab = time_megatron(opts.worker, opts, data)
    result["megatron"] = summary(times, counters)
    if not opts.plain_first:
        result["plain"] = summary(*time_plain(opts.worker, vocab, opts))
    print(MARK + json.dumps(result), flush=True)


# ---------------------------------------------------------------- the parent
def run_worker(model, opts, data, plain_first):
    argv = [sys.executable, os.path.abspath(__file__), "--worker", model,
            "--steps", str(opts.steps), "--warmup", str(opts.warmup),
            "--count-steps", str(opts.count_steps), "--threads", str(opts.threads),
            "--micro-batch", str(opts.micro_batch), "--gas", str(opts.gas),
            f"--megatron-flags={opts.megatron_flags}"]
    if plain_first:
        argv.append("--plain-first")
    env = dict(os.environ, HOST_OVERHEAD_DATA=json.dumps(data),
               OMP_NUM_THREADS=str(opts.threads), PYTHONPATH=REPO)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, env=env)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith(MARK)), None)
    if out.returncode or line is None:
        raise RuntimeError(f"worker {model} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(line[len(MARK):])


def best(runs, case):
    """The run with the lowest median for ``case`` (counts are the same in every run)."""
    return min((r[case] for r in runs), key=lambda s: s["ms"])


def report(model, runs, opts):
    ours, plain = best(runs, "megatron"), best(runs, "plain")
    name = {"gpt2": "plain GPT-2 (benchmarks/plain_models.py)",
            "t5": "transformers T5ForConditionalGeneration"}[model]
    print(f"\n{model}: megatron pretrain() step vs {name}")
    print("| case | ms/step | ratio | thread CPU ms/step | ratio | aten ops/step | ops ratio "
          "| syncs/step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, s in (("megatron", ours), ("plain", plain)):
        print(f"| {label} | {s['ms']:.2f} | {s['ms'] / plain['ms']:.3f} | {s['cpu_ms']:.2f} | "
              f"{s['cpu_ms'] / plain['cpu_ms']:.3f} | {s['ops']:.0f} | "
              f"{s['ops'] / plain['ops']:.3f} | {s['syncs']:.1f} |")
    print(f"RESULT {model} ms_ratio={ours['ms'] / plain['ms']:.4f} "
          f"cpu_ratio={ours['cpu_ms'] / plain['cpu_ms']:.4f} "
          f"ops_megatron={ours['ops']:.0f} ops_plain={plain['ops']:.0f} "
          f"syncs_megatron={ours['syncs']:.1f} syncs_plain={plain['syncs']:.1f}")
    if opts.op_diff:
        keys = sorted(set(ours["op_counts"]) | set(plain["op_counts"]))
        diff = [(ours["op_counts"].get(k, 0) - plain["op_counts"].get(k, 0), k) for k in keys]
        for delta, key in sorted(diff, key=lambda d: -abs(d[0])):
            if delta:
                print(f"  {delta:+7.1f}  {key} (megatron {ours['op_counts'].get(key, 0):.0f}, "
                      f"plain {plain['op_counts'].get(key, 0):.0f})")


def main(argv=None):
    opts = parse_args(argv)
    if opts.worker:
        return worker(opts)
    import torch

    print("command: python " + " ".join(shlex.quote(a) for a in [
        os.path.relpath(os.path.abspath(__file__), REPO), *(sys.argv[1:] if argv is None
                                                             else argv)]))
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"torch {torch.__version__}, {opts.threads} thread(s), python "
          f"{platform.python_version()}")
    data = prepare_data(opts)
    for model in opts.models.split(","):
        runs = [run_worker(model, opts, data, plain_first=bool(i % 2))
                for i in range(opts.runs)]
        report(model, runs, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
