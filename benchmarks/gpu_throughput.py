#!/usr/bin/env python
"""Training-step throughput of this project's GPT-2 and T5 against plain baselines, one run.

    python benchmarks/gpu_throughput.py                      # GPU: the issue 10 / 11 tables
    python benchmarks/gpu_throughput.py --profile prof/      # + torch.profiler traces
    python benchmarks/gpu_throughput.py --tiny               # CPU smoke run (tests)

Every case trains on the same device in the same process, tp = pp = dp = 1, bf16 on a GPU
(fp32 with ``--tiny`` on the CPU), dropout 0, synthetic batches already on the device:

- ``megatron``: the real training path, as pretrain() builds it: run configuration from
  flags, model from the family's hooks, :func:`megatron.training.backend.build_backend`
  (our AdamW wrapper or the DeepSpeed engine) and ``backend.train_step`` with the entry
  script's ``forward_step``; ``compile`` adds ``--compile``; ``deepspeed`` adds
  ``--deepspeed --zero-stage 1`` (only when deepspeed imports); ``unfused`` adds
  ``--no-layernorm-fusion --no-masked-softmax-fusion`` (PyTorch's LayerNorm and softmax);
  ``--kinds`` picks among them;
- ``plain``: benchmarks/plain_models.py's GPT-2 (SDPA, autocast, fused AdamW), eager and
  under ``torch.compile``; ``hf-t5``: transformers' T5ForConditionalGeneration, same.

Reported per case: ms/step (median), tokens/s, TFLOP/s (Megatron's formula, the same
count for every case of a size), MFU (the device's dense peak for the precision,
megatron/observability/training_log.py's table; ``--peak-tflops`` overrides), peak memory, and tokens/s relative to the compiled baseline.
"""
import argparse
import os
import re
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.plain_models import PlainGPT2, hf_t5  # noqa: E402

GPT2_SIZES = {"124M": (12, 768, 12), "345M": (24, 1024, 16)}  # layers, hidden, heads
T5_SIZES = {"t5-base": (12, 768, 3072, 12), "t5-large": (24, 1024, 4096, 16)}
TINY_GPT2 = {"tiny": (2, 64, 4)}
TINY_T5 = {"tiny-t5": (2, 64, 128, 4)}
#: The project's cases: flags added to the run's own.
KIND_FLAGS = {"eager": (), "compile": ("--compile",),
              "deepspeed": ("--deepspeed", "--zero-stage", "1"),
              "unfused": ("--no-layernorm-fusion", "--no-masked-softmax-fusion"),
              # CUDA graphs over the compiled regions (issue 42's flag)
              "compile-cudagraphs": ("--compile", "--cuda-graphs"),
              "compile-deepspeed": ("--compile", "--deepspeed", "--zero-stage", "1"),
              # the cuDNN A/B of issue 43: every masked SDPA call without cuDNN's kernel
              "compile-nocudnn": ("--compile",), "eager-nocudnn": ()}


def peak_tflops(device, override, dtype):
    """Per-device dense peak for ``dtype`` (megatron.observability.training_log's table: H100
    SXM / PCIe / NVL, H200, A100, ...), or None (CPU, unknown GPU) without ``--peak-tflops``."""
    if override:
        return override
    if device.type != "cuda":
        return None
    from megatron.observability.training_log import device_peak_tflops

    props = torch.cuda.get_device_properties(device)
    return device_peak_tflops(props.name, props.total_memory, dtype,
                              torch.get_float32_matmul_precision() != "highest")


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step, device, warmup, steps):
    """Median seconds per ``step()`` after ``warmup`` calls, and the peak memory (GiB)."""
    for _ in range(warmup):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    memory = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return statistics.median(times), memory


def profile_step(step, device, path, name):
    """One profiled step: a chrome trace under ``path``, the top kernels and the share of the
    step's wall time the device was busy (a low share: the step is host-bound)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    _sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        step()
        _sync(device)
    wall = time.perf_counter() - start
    os.makedirs(path, exist_ok=True)
    prof.export_chrome_trace(os.path.join(path, f"{name}.json"))
    events = prof.key_averages()
    on_device = device.type == "cuda"
    key = "self_device_time_total" if on_device else "self_cpu_time_total"
    if on_device and not hasattr(events[0], key):  # older torch
        key = "self_cuda_time_total"
    # the kernels alone (an operator's device time is its kernels' again)
    busy = sum(getattr(e, key) for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA) / 1e6 if on_device else None
    print(f"--- profile: {name}: wall {wall * 1e3:.1f} ms (profiled)"
          + (f", device busy {busy * 1e3:.1f} ms ({busy / wall:.0%})" if on_device else ""))
    print(events.table(sort_by=key, row_limit=15, max_name_column_width=60))
    if on_device:  # where the host's time goes (a host-bound step)
        print(events.table(sort_by="self_cpu_time_total", row_limit=12,
                           max_name_column_width=60))


# ------------------------------------------------------------------ this project's steps
_DIST_READY = False


def _init_project(argv, family, vocab, eod):
    """Run configuration + distributed state as initialize_megatron builds them (synthetic
    data: no tokenizer files, the vocabulary size is given)."""
    global _DIST_READY
    from megatron import mpu
    from megatron.config import build_run_config
    from megatron.common.global_vars import reset_globals, set_globals
    from megatron.initialize import _load_kernels, init_distributed, set_random_seed
    from megatron.common.timers import Timers

    cfg, _ = build_run_config(argv, family, check_files=False, world_size=1, rank=0)
    cfg = cfg.replace(padded_vocab_size=vocab, true_vocab_size=vocab)
    if not _DIST_READY:
        init_distributed(cfg)
        _DIST_READY = True
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(1, 1)
    set_random_seed(cfg.seed)
    _load_kernels(cfg)
    reset_globals()
    tokenizer = argparse.Namespace(eod=eod, pad=0, vocab_size=vocab)
    set_globals(args=cfg, tokenizer=tokenizer, timers=Timers(), tensorboard_writer=None)
    return cfg


def _common_flags(opts, layers, hidden, heads, batch, extra):
    flags = ["--num-layers", str(layers), "--hidden-size", str(hidden),
             "--num-attention-heads", str(heads), "--batch-size", str(batch), "--gas", "1",
             "--train-iters", "1000", "--lr", "1e-4", "--hidden-dropout", "0",
             "--attention-dropout", "0", "--log-interval", "1000000"]
    if opts.dtype == torch.bfloat16:
        flags.append("--bf16")
    return flags + list(extra)


def project_step(kind, family, flags, vocab, batch_fn, device):
    """``step()`` of the real training path for ``family`` (``gpt2`` / ``t5``)."""
    from megatron.families import get_family
    from megatron.common.global_vars import get_tokenizer
    from megatron.training.backend_factory import build_backend

    model_family = get_family(family)
    argv = flags + list(KIND_FLAGS[kind])
    cfg = _init_project(argv, model_family, vocab, eod=vocab - 1)
    backend = build_backend(cfg, lambda pipeline: model_family.build_model(cfg, pipeline))
    forward_step = model_family.forward_step(model_family.make_batch_fn(cfg, get_tokenizer()))
    backend.train()
    batch = batch_fn(device)

    def data():
        while True:
            yield batch

    iterator = data()

    def step():
        backend.train_step(forward_step, iterator)

    if kind.endswith("-nocudnn"):
        step = _without_cudnn(step)
    step.backend = backend
    return step, cfg


def _without_cudnn(step):
    """``step`` with cuDNN's kernel left out of every masked SDPA call on CUDA (whatever the
    dtype), as before issue 43: one side of the cuDNN A/B, in the same process."""
    from megatron.model import attention

    chosen = attention.sdpa_backends_for

    def masked_without_cudnn(device_type, has_mask, dtype):
        if has_mask and device_type == "cuda":
            return attention.MASKED_SDPA_BACKENDS
        return chosen(device_type, has_mask, dtype)

    def run():
        attention.sdpa_backends_for = masked_without_cudnn
        try:
            step()
        finally:
            attention.sdpa_backends_for = chosen

    return run


# ------------------------------------------------------------------ baseline steps
#: The profiler range around an optimizer step (clipping included) in the steps here.
OPTIMIZER_RANGE = "optimizer step (clip + AdamW)"



def plain_step(model, loss_fn, opts, device, compiled):
    """``step()`` of a plain model: autocast forward, backward, gradient clipping at 1.0 (as
    our run scripts and default flags clip), fused AdamW step."""
    model = model.to(device).train()
    fused = {"fused": True} if device.type == "cuda" else {}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01, **fused)
    run = torch.compile(model) if compiled else model

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=opts.dtype, enabled=opts.dtype != torch.float32):
            loss = loss_fn(run)
        loss.backward()
        with torch.profiler.record_function(OPTIMIZER_RANGE):  # named in profiles
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()

    return step


# ------------------------------------------------------------------ cases
def gpt2_batch_fn(batch, seq, vocab):
    def make(device):
        g = torch.Generator(device="cpu").manual_seed(1234)
        return {"text": torch.randint(0, vocab - 1, (batch, seq + 1), generator=g).to(device)}
    return make


def t5_batch_fn(batch, enc, dec, vocab):
    def make(device):
        g = torch.Generator(device="cpu").manual_seed(1234)
        ids = lambda n: torch.randint(2, vocab - 1, (batch, n), generator=g)  # noqa: E731
        out = {"text_enc": ids(enc), "text_dec": ids(dec), "labels": ids(dec),
               "enc_real": torch.ones(batch, enc, dtype=torch.int64),
               "loss_mask": torch.ones(batch, dec, dtype=torch.int64)}
        return {k: v.to(device) for k, v in out.items()}
    return make


def gpt2_flops(batch, seq, layers, hidden, vocab):
    """Megatron's count for one step (the same for every case of a size)."""
    from megatron.config import saved_run_config
    from megatron.families.gpt2 import flops_per_step

    return flops_per_step(saved_run_config(dict(global_batch_size=batch, seq_length=seq,
                                                num_layers=layers, hidden_size=hidden,
                                                padded_vocab_size=vocab)))


def gpt2_cases(opts, name, layers, hidden, heads, batch):
    """(label, step factory) pairs for one GPT-2 size and micro-batch."""
    seq, vocab = opts.seq, opts.vocab
    flags = _common_flags(opts, layers, hidden, heads, batch,
                          ["--seq-length", str(seq), "--max-position-embeddings", str(seq)])
    batch_fn = gpt2_batch_fn(batch, seq, vocab)
    text = batch_fn(opts.device)["text"]

    def plain_loss(model):
        return model(text[:, :-1], text[:, 1:])

    cases = [(f"megatron {k}", lambda k=k: project_step(k, "gpt2", flags, vocab, batch_fn,
                                                        opts.device)[0]) for k in opts.kinds]
    for compiled in opts.baselines:
        cases.append((f"plain {'compiled' if compiled else 'eager'}",
                      lambda c=compiled: plain_step(PlainGPT2(vocab, seq, hidden, heads, layers),
                                                    plain_loss, opts, opts.device, c)))
    return cases, batch * seq, gpt2_flops(batch, seq, layers, hidden, vocab)


def t5_cases(opts, name, layers, d_model, d_ff, heads, batch):
    """(label, step factory) pairs for one T5 size."""
    enc, dec, vocab, d_kv = opts.enc_seq, opts.dec_seq, opts.t5_vocab, d_model // heads
    flags = _common_flags(opts, layers, d_model, heads, batch,
                          ["--enc-seq-length", str(enc), "--dec-seq-length", str(dec),
                           "--ff-hidden-size", str(d_ff), "--kv-hidden-size", str(d_kv)])
    batch_fn = t5_batch_fn(batch, enc, dec, vocab)
    data = batch_fn(opts.device)

    def hf_loss(model):
        return model(input_ids=data["text_enc"], decoder_input_ids=data["text_dec"],
                     labels=data["labels"]).loss

    cases = [(f"megatron {k}", lambda k=k: project_step(k, "t5", flags, vocab, batch_fn,
                                                        opts.device)[0]) for k in opts.kinds]
    if hf_t5(vocab, 1, 8, 8, 1, 8) is not None:
        for compiled in opts.baselines:
            cases.append((f"hf-t5 {'compiled' if compiled else 'eager'}",
                          lambda c=compiled: plain_step(
                              hf_t5(vocab, layers, d_model, d_ff, heads, d_kv), hf_loss, opts,
                              opts.device, c)))
    from megatron.config import saved_run_config
    from megatron.families import get_family
    from megatron.families.t5 import flops_per_step

    cfg = saved_run_config(dict(
        num_layers=layers, hidden_size=d_model, num_attention_heads=heads, kv_channels=d_kv,
        ffn_hidden_size=d_ff, padded_vocab_size=vocab, hidden_dropout=0.0,
        attention_dropout=0.0, compute_dtype=opts.dtype, enc_seq_length=enc,
        dec_seq_length=dec, global_batch_size=batch), get_family("t5"))
    return cases, batch * (enc + dec), flops_per_step(cfg)


# ------------------------------------------------------------------ report
def run_table(title, cases, tokens_per_step, flops, opts):
    """Time every case of one size; print ms/step, tokens/s, TFLOP/s, MFU, memory, ratio."""
    peak = peak_tflops(opts.device, opts.peak_tflops, opts.dtype)
    rows = []
    for label, factory in cases:
        torch._dynamo.reset()  # every compiled case compiles afresh (no recompile limit hit)
        step = factory()
        seconds, memory = time_steps(step, opts.device, opts.warmup, opts.steps)
        if opts.profile:
            profile_step(step, opts.device, opts.profile,
                         re.sub(r"[^A-Za-z0-9.-]+", "_", f"{title}-{label}"))
        tflops = flops / seconds / 1e12
        rows.append((label, seconds, tokens_per_step / seconds, tflops,
                     tflops / peak if peak else None, memory))
        del step
        if opts.device.type == "cuda":
            torch.cuda.empty_cache()
    base = max((r for r in rows if r[0].startswith(("plain", "hf-t5"))), key=lambda r: r[2],
               default=None)
    print(f"\n### {title}")
    print("| case | ms/step | tokens/s | TFLOP/s | MFU | peak GiB | tokens/s vs best baseline |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, seconds, tokens, tflops, mfu, memory in rows:
        ratio = f"{tokens / base[2]:.2f}" if base else "n/a"
        print(f"| {label} | {seconds * 1e3:.1f} | {tokens:.0f} | {tflops:.2f} | "
              f"{f'{mfu * 100:.1f}%' if mfu is not None else 'n/a'} | "
              f"{f'{memory:.1f}' if memory is not None else 'n/a'} | {ratio} |")
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny sizes, fp32 on CPU (smoke run)")
    p.add_argument("--models", default="gpt2,t5", help="comma list: gpt2, t5")
    p.add_argument("--batches", default="8,16", help="GPT-2 micro-batches")
    p.add_argument("--gpt2-sizes", default=",".join(GPT2_SIZES), help="comma list of GPT-2 sizes")
    p.add_argument("--t5-sizes", default="t5-base", help="comma list of T5 sizes")
    p.add_argument("--kinds", default="eager,compile,deepspeed",
                   help=f"the project's cases, comma list of {', '.join(KIND_FLAGS)}")
    p.add_argument("--baselines", default="eager,compiled",
                   help="the plain / transformers baselines: eager, compiled")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--no-deepspeed", dest="deepspeed", action="store_false")
    p.add_argument("--profile", default=None, help="folder for torch.profiler traces")
    p.add_argument("--peak-tflops", type=float, default=None)
    p.add_argument("--plot", default=None,
                   help="also draw each table (tokens/s vs the best baseline) into this PNG")
    opts = p.parse_args(argv)
    opts.kinds = [k for k in opts.kinds.split(",") if k]
    unknown = [k for k in opts.kinds if k not in KIND_FLAGS]
    if unknown:
        p.error(f"--kinds: unknown {unknown}; choose from {', '.join(KIND_FLAGS)}")
    baselines = [b for b in opts.baselines.split(",") if b]
    if set(baselines) - {"eager", "compiled"}:
        p.error(f"--baselines: {baselines}; choose from eager, compiled")
    opts.baselines = [b == "compiled" for b in baselines]
    if not opts.compile:
        opts.kinds = [k for k in opts.kinds if not k.startswith("compile")]
        opts.baselines = [b for b in opts.baselines if not b]
    opts.device = torch.device("cuda" if torch.cuda.is_available() and not opts.tiny else "cpu")
    opts.dtype = torch.bfloat16 if opts.device.type == "cuda" else torch.float32
    tiny = opts.tiny
    opts.seq, opts.vocab = (32, 512) if tiny else (1024, 50304)
    opts.enc_seq, opts.dec_seq, opts.t5_vocab = (32, 8, 512) if tiny else (512, 128, 32128)
    if tiny:
        opts.batches, opts.steps, opts.warmup = "2", min(opts.steps, 2), 1
    if opts.deepspeed:
        try:
            import deepspeed  # noqa: F401
        except ImportError:
            opts.deepspeed = False
    if not opts.deepspeed:
        opts.kinds = [k for k in opts.kinds if "deepspeed" not in k]
    if opts.device.type != "cuda":  # CUDA graphs and the cuDNN A/B need a GPU
        opts.kinds = [k for k in opts.kinds if not k.endswith(("-cudagraphs", "-nocudnn"))]
    return opts


def plot(tables, output):
    """Each table's tokens/s against its best baseline (the last column), as bar charts."""
    from megatron.observability.run_plots import plot_tables

    results = []
    for title, rows in tables.items():
        base = max((r[2] for r in rows if r[0].startswith(("plain", "hf-t5"))), default=None)
        base = base or rows[0][2]  # no baseline case run: against the first row
        results += [{"table": title, "op": "tokens/s", "direction": "", "impl": label,
                     "ratio": tokens / base} for label, _, tokens, *_ in rows]
    plot_tables(results, output, value="ratio", label="tokens/s vs best baseline (x)")
    print(f"wrote {output}")


def main(argv=None):
    opts = parse_args(argv)
    if opts.plot:  # fail on a missing matplotlib before the benchmark, not after it
        from megatron.observability.run_plots import check_matplotlib

        check_matplotlib()
    os.environ.setdefault("MEGATRON_DEVICE", opts.device.type)
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)  # one process; DeepSpeed's engine asks for them
    name = torch.cuda.get_device_name() if opts.device.type == "cuda" else "CPU"
    print(f"command: python {' '.join(sys.argv)}")
    print(f"device: {name}; torch {torch.__version__}; {opts.dtype}; steps {opts.steps} "
          f"(warmup {opts.warmup}); absolute times count only on a GPU")
    models = opts.models.split(",")
    tables = {}
    if "gpt2" in models:
        sizes = TINY_GPT2 if opts.tiny else {k: GPT2_SIZES[k] for k in opts.gpt2_sizes.split(",")}
        for size, (layers, hidden, heads) in sizes.items():
            for batch in (int(b) for b in opts.batches.split(",")):
                cases, tokens, flops = gpt2_cases(opts, size, layers, hidden, heads, batch)
                title = f"GPT-2 {size}, micro-batch {batch}, seq {opts.seq}"
                tables[title] = run_table(title, cases, tokens, flops, opts)
    if "t5" in models:
        sizes = TINY_T5 if opts.tiny else {k: T5_SIZES[k] for k in opts.t5_sizes.split(",")}
        for size, (layers, d_model, d_ff, heads) in sizes.items():
            batch = 2 if opts.tiny else 16
            cases, tokens, flops = t5_cases(opts, size, layers, d_model, d_ff, heads, batch)
            title = f"{size}, micro-batch {batch}, enc {opts.enc_seq} / dec {opts.dec_seq}"
            tables[title] = run_table(title, cases, tokens, flops, opts)
    if opts.plot:
        plot(tables, opts.plot)
    return tables


if __name__ == "__main__":
    main()
