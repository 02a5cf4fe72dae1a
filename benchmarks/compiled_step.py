#!/usr/bin/env python
"""The compiled training step, counted on a CPU: what a GPU step of it launches and moves.

    python benchmarks/compiled_step.py                 # GPT-2 345M's structure (24 layers)
    python benchmarks/compiled_step.py --model t5 --layers 12 --kinds compile,layers,eager,hf
    python benchmarks/compiled_step.py --layers 2 --hidden 64 --heads 4   # a smoke run

On a GPU the gap between this project's ``--compile`` step and a plain GPT-2 compiled whole
was outside the layers (issue 42): compiled-region calls, kernels launched outside any
compiled graph, the loss path's memory traffic. Those are counts, the same on every device,
so they are measured here, on the CPU, at tp = pp = dp = 1, for:

- ``megatron compile``: the real training path with ``--compile`` (each chunk one region,
  the loss inside; benchmarks/gpu_throughput.py's ``project_step``);
- ``megatron layers``: the same, each transformer layer compiled on its own (what
  ``--compile`` did before issue 42: the configuration the H100 profile was taken of);
- ``megatron eager``; ``plain compiled``: benchmarks/plain_models.py's GPT-2 under
  ``torch.compile``, clipping at 1.0 like our run scripts, torch's AdamW;
- with ``--model t5`` (T5, ``--layers`` per stack, encoder ``--seq``, decoder ``--dec-seq``):
  ``hf compiled``, transformers' T5ForConditionalGeneration at the same sizes under
  ``torch.compile`` instead of the plain GPT-2 (issue 43);
- ``fp8`` / ``fp8-eager``: ``megatron compile`` / ``eager`` with ``--fp8-format`` and
  ``--fp8-recipe`` as ``--fp8 FORMAT-RECIPE`` says (needs ``--bf16``): the FP8 casts and amax
  reductions must all be inside the compiled graphs, so ``fp8``'s kernels outside them are
  ``compile``'s; FP8 GEMMs (``aten::_scaled_mm``) are counted with the GEMMs.

Per optimizer step (one micro-batch), from ``torch.profiler`` on the CPU: compiled-graph
calls (``## Call CompiledFxGraph`` events: forward and backward graphs), kernels launched
outside compiled graphs (leaf ``aten::`` operators with no compiled graph above them, views
and other metadata-only operators left out), GEMM and attention calls anywhere, Python
function calls (``sys.setprofile``), calls of this project's custom operators
(``megatron_tds::``, inside compiled graphs and outside), and dynamo's graphs and breaks. Then the loss path
alone: bytes read and written by its compiled kernels (inductor's scheduler, fused nodes)
for ours and for a compiled ``F.cross_entropy``, and, for reference, ours in eager mode (the
operators' tensor bytes), per logits byte at the shape given. Ratios against the plain
model (and against ``F.cross_entropy``) are printed with the command and the machine. Only
counts are claims; CPU times are not.
"""
import argparse
import os
import platform
import shlex
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

#: Operators that launch no kernel on a GPU (metadata, views, allocation).
NO_KERNEL = {"aten::view", "aten::reshape", "aten::as_strided", "aten::t", "aten::transpose",
             "aten::permute", "aten::expand", "aten::unsqueeze", "aten::squeeze",
             "aten::slice", "aten::select", "aten::detach", "aten::alias", "aten::empty",
             "aten::empty_strided", "aten::empty_like", "aten::_unsafe_view", "aten::split",
             "aten::chunk", "aten::unbind", "aten::resolve_conj", "aten::resolve_neg",
             "aten::lift_fresh", "aten::_reshape_alias", "aten::narrow", "aten::view_as",
             "aten::split_with_sizes", "aten::numpy_T", "aten::contiguous",
             "aten::_has_compatible_shallow_copy_type", "aten::set_", "aten::result_type",
             "aten::is_nonzero", "aten::_local_scalar_dense", "aten::to", "aten::record_stream"}
GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm"}
COMPILED_GRAPH = "## Call CompiledFxGraph"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=("gpt2", "t5"), default="gpt2")
    p.add_argument("--layers", type=int, default=24, help="T5: per stack")
    p.add_argument("--dec-seq", type=int, default=16, help="T5's decoder length")
    p.add_argument("--ff", type=int, default=256, help="T5's d_ff")
    p.add_argument("--hidden", type=int, default=64, help="counts do not depend on it")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024, help="the step's vocabulary")
    p.add_argument("--loss-shape", type=int, nargs=2, default=(2048, 50304),
                   metavar=("TOKENS", "VOCAB"), help="the loss path's logits")
    p.add_argument("--kinds", default="compile,layers,eager,plain",
                   help="compile, layers, eager; plain (GPT-2) or hf (T5) compiled; fp8, "
                        "fp8-eager (compile / eager with --fp8)")
    p.add_argument("--fp8", default="hybrid-tensorwise", metavar="FORMAT-RECIPE",
                   help="the fp8 kinds' --fp8-format and --fp8-recipe")
    p.add_argument("--bf16", action="store_true", help="autocast to bf16, as on the GPU")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--adamw", choices=("fused", "default"), default="fused",
                   help="fused: torch's fused AdamW for every case, as on a GPU (a few "
                        "operators per step instead of several per parameter)")
    return p.parse_args(argv)


def _force_fused_adamw():
    """Every AdamW of the run fused (ours through megatron.optimizer.adamw, the plain
    model's through torch.optim.AdamW), as both are on a GPU."""
    import megatron.optimizer.adamw as adamw

    adamw.adamw_kwargs = lambda params, impl="auto": {"fused": True}
    original = torch.optim.AdamW.__init__

    def init(self, params, *a, **k):
        k["fused"] = True
        original(self, params, *a, **k)

    torch.optim.AdamW.__init__ = init


# ------------------------------------------------------------------ the steps
def _opts(args):
    return argparse.Namespace(device=torch.device("cpu"), seq=args.seq, vocab=args.vocab,
                              dtype=torch.bfloat16 if args.bf16 else torch.float32,
                              kinds=[], baselines=[], warmup=1, steps=1)


def make_step(kind, args):
    """``step()`` of one case (the real training path for ours)."""
    from benchmarks.gpu_throughput import (_common_flags, gpt2_batch_fn, plain_step,
                                           project_step)
    from benchmarks.plain_models import PlainGPT2

    opts = _opts(args)
    if args.model == "t5":
        return _t5_step(kind, args, opts)
    if kind == "plain":
        batch = gpt2_batch_fn(args.batch, args.seq, args.vocab)(opts.device)["text"]
        model = PlainGPT2(args.vocab, args.seq, args.hidden, args.heads, args.layers)
        return plain_step(model, lambda m: m(batch[:, :-1], batch[:, 1:]), opts, opts.device,
                          compiled=True)
    flags = _common_flags(opts, args.layers, args.hidden, args.heads, args.batch,
                          ["--seq-length", str(args.seq), "--max-position-embeddings",
                           str(args.seq), *_fp8_flags(kind, args)])
    project = "compile" if kind in ("compile", "fp8") else "eager"
    step, cfg = project_step(project, "gpt2", flags, args.vocab,
                             gpt2_batch_fn(args.batch, args.seq, args.vocab), opts.device)
    if kind == "layers":  # each layer its own region: --compile before issue 42
        from megatron.model.compile import compile_layers

        compile_layers(step.backend.module())
    return _name_optimizer_step(step)


def _fp8_flags(kind, args):
    """``--fp8-format`` / ``--fp8-recipe`` for the fp8 kinds (none for the others)."""
    if not kind.startswith("fp8"):
        return []
    fmt, recipe = args.fp8.split("-")
    return ["--fp8-format", fmt, "--fp8-recipe", recipe]


def _name_optimizer_step(step):
    """Run our optimizer's step (clipping included) inside the profiler range the plain
    steps use, so the counts can tell the optimizer's kernels from the model's."""
    from benchmarks.gpu_throughput import OPTIMIZER_RANGE

    optimizer = step.backend.optimizer
    original = optimizer.step

    def named():
        with torch.profiler.record_function(OPTIMIZER_RANGE):
            return original()

    optimizer.step = named
    return step


def _t5_step(kind, args, opts):
    from benchmarks.gpu_throughput import _common_flags, plain_step, project_step, t5_batch_fn
    from benchmarks.plain_models import hf_t5

    heads, d_kv = args.heads, args.hidden // args.heads
    batch_fn = t5_batch_fn(args.batch, args.seq, args.dec_seq, args.vocab)
    if kind == "hf":
        data = batch_fn(opts.device)
        model = hf_t5(args.vocab, args.layers, args.hidden, args.ff, heads, d_kv)

        def loss(m):
            return m(input_ids=data["text_enc"], decoder_input_ids=data["text_dec"],
                     labels=data["labels"]).loss

        return plain_step(model, loss, opts, opts.device, compiled=True)
    flags = _common_flags(opts, args.layers, args.hidden, heads, args.batch,
                          ["--enc-seq-length", str(args.seq), "--dec-seq-length",
                           str(args.dec_seq), "--ff-hidden-size", str(args.ff),
                           "--kv-hidden-size", str(d_kv)])
    step, _ = project_step("compile" if kind == "compile" else "eager", "t5", flags,
                           args.vocab, batch_fn, opts.device)
    if kind == "layers":
        from megatron.model.compile import compile_layers

        compile_layers(step.backend.module())
    return _name_optimizer_step(step)


# ------------------------------------------------------------------ counting
def _under(event, prefix):
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefix):
            return True
        parent = parent.cpu_parent
    return False


def _under_compiled_graph(event):
    return _under(event, COMPILED_GRAPH)


def count_step(step):
    """Counts of one ``step()`` (after warm-up): see the module docstring."""
    from torch._dynamo.utils import counters
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu_throughput import OPTIMIZER_RANGE

    graphs_before = counters["stats"]["unique_graphs"]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = prof.events()
    outside = Counter()
    counts = Counter()
    for e in events:
        if e.name.startswith(COMPILED_GRAPH):
            counts["compiled graph calls"] += 1
        if e.name.startswith("megatron_tds::"):
            inside = _under_compiled_graph(e)
            counts[f"custom-op calls {'inside' if inside else 'outside'} compiled graphs"] += 1
            if "norm" in e.name and inside:
                counts["norm custom-op calls inside compiled graphs"] += 1
        if not e.name.startswith("aten::"):
            continue
        if e.name in GEMMS and not any(c.name in GEMMS for c in e.cpu_children) and \
                not _under(e, "aten::_scaled_mm"):  # the CPU's _scaled_mm runs an mm inside
            counts["GEMM calls"] += 1
        if "scaled_dot_product" in e.name and not any("scaled_dot_product" in c.name
                                                      for c in e.cpu_children):
            counts["attention calls"] += 1
        leaf = not any(c.name.startswith("aten::") for c in e.cpu_children)
        if leaf and e.name not in NO_KERNEL and not _under_compiled_graph(e):
            outside[e.name] += 1
            if _under(e, OPTIMIZER_RANGE):
                counts["  of which the optimizer step's"] += 1
    counts["kernels outside compiled graphs"] = sum(outside.values())
    calls = [0]

    def tracer(frame, event, arg):
        if event == "call":
            calls[0] += 1

    sys.setprofile(tracer)
    try:
        step()
    finally:
        sys.setprofile(None)
    counts["Python calls"] = calls[0]
    counts["graphs compiled after warm-up"] = counters["stats"]["unique_graphs"] - graphs_before
    counts["graph breaks"] = sum(counters["graph_break"].values())
    return counts, outside


# ------------------------------------------------------------------ the loss path
class _SchedulerBytes:
    """Bytes read and written by inductor's (fused) scheduler nodes while compiling."""

    def __init__(self):
        import torch._inductor.scheduler as scheduler

        self.total, self._scheduler = 0, scheduler.Scheduler
        self._original = scheduler.Scheduler.codegen
        outer = self

        def codegen(sched):
            outer.total += sum(n.get_read_write_buffers_sizes() for n in sched.nodes)
            return outer._original(sched)

        scheduler.Scheduler.codegen = codegen

    def close(self):
        self._scheduler.codegen = self._original


def _eager_bytes(fn, *args):
    """Tensor bytes every operator of ``fn(*args)`` and its backward reads and writes."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Bytes(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__ not in ("detach.default", "view.default", "t.default",
                                     "transpose.int", "expand.default", "unsqueeze.default",
                                     "squeeze.dim", "select.int", "slice.Tensor",
                                     "_unsafe_view.default", "empty.memory_format",
                                     "empty_like.default", "empty_strided.default"):
                for t in tree_leaves((args, kwargs, out)):
                    if torch.is_tensor(t):
                        Bytes.total += t.numel() * t.element_size()
            return out

    with Bytes():
        fn(*args).backward()
    return Bytes.total


def loss_path_bytes(tokens, vocab, dtype):
    """Bytes per logits byte of the loss forward + backward: ours compiled, ours eager,
    ``F.cross_entropy`` compiled (the plain model's)."""
    import torch.distributed as dist

    from megatron import mpu
    from megatron.model.language_model import masked_lm_loss

    if not dist.is_initialized():  # the loss's tensor-parallel group (of one)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
        dist.init_process_group("gloo", rank=0, world_size=1)
    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(1, 1)

    def ours(logits, labels, mask):  # the model's [b, s, v] view of [s, b, v]
        return masked_lm_loss(logits.transpose(0, 1), (labels, mask))

    def plain(logits, labels, mask):
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 labels.t().flatten())

    s = 8
    b = tokens // s
    g = torch.Generator().manual_seed(0)
    make = lambda: torch.randn(s, b, vocab, generator=g).to(dtype).requires_grad_()  # noqa
    labels = torch.randint(0, vocab, (b, s), generator=g)
    mask = torch.ones(b, s)
    logits_bytes = tokens * vocab * torch.tensor([], dtype=dtype).element_size()
    out = {}
    for name, fn in (("ours compiled", ours), ("F.cross_entropy compiled", plain)):
        torch._dynamo.reset()
        counter = _SchedulerBytes()
        try:  # compiled afresh: a cached graph would skip the scheduler that counts
            with torch._inductor.config.patch(force_disable_caches=True):
                torch.compile(fn, dynamic=False)(make(), labels, mask).backward()
        finally:
            counter.close()
        out[name] = counter.total / logits_bytes
    out["ours eager"] = _eager_bytes(ours, make(), labels, mask) / logits_bytes
    return out


# ------------------------------------------------------------------ main
def machine():
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, " \
           f"torch {torch.__version__}"


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"machine: {machine()}")
    what = (f"T5, {args.layers} + {args.layers} layers, d_ff {args.ff}, decoder seq "
            f"{args.dec_seq}, " if args.model == "t5" else f"GPT-2, {args.layers} layers, ")
    print(f"model: {what}hidden {args.hidden}, {args.heads} heads, seq "
          f"{args.seq}, micro-batch {args.batch}, vocab {args.vocab}, "
          f"{'bf16 autocast' if args.bf16 else 'fp32'}, tp = pp = dp = 1, clip 1.0, "
          f"{args.adamw} AdamW")
    if args.adamw == "fused":
        _force_fused_adamw()
    results, outside = {}, {}
    for kind in args.kinds.split(","):
        torch._dynamo.reset()
        from torch._dynamo.utils import counters

        counters.clear()
        step = make_step(kind, args)
        for _ in range(args.warmup):
            step()
        results[kind], outside[kind] = count_step(step)
        del step
    names = sorted({k for r in results.values() for k in r}, key=lambda n: n.strip())
    print(f"\n{'per step':36s}" + "".join(f"{k:>14s}" for k in results))
    for name in names:
        print(f"{name:36s}" + "".join(f"{results[k][name]:>14d}" for k in results))
    if "fp8" in results and "compile" in results:
        for name in ("compiled graph calls", "kernels outside compiled graphs", "GEMM calls"):
            base = results["compile"][name]
            if base:
                print(f"ratio fp8 / compile, {name}: {results['fp8'][name] / base:.2f}")
        extra = outside["fp8"] - outside["compile"]
        print(f"kernels outside compiled graphs that fp8 adds to compile: {dict(extra)}")
    baseline = "hf" if args.model == "t5" else "plain"
    if baseline in results:
        for kind in (k for k in results if k != baseline):
            for name in ("compiled graph calls", "kernels outside compiled graphs",
                         "GEMM calls", "Python calls"):
                base = results[baseline][name]
                if base:
                    print(f"ratio {kind} / {baseline}, {name}: "
                          f"{results[kind][name] / base:.2f}")
    for kind, ops in outside.items():
        print(f"\nkernels outside compiled graphs, {kind}:", dict(ops.most_common(10)))
    if args.model == "t5":
        return results, None
    tokens, vocab = args.loss_shape
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    loss = loss_path_bytes(tokens, vocab, dtype)
    print(f"\nloss path (logits {tokens} x {vocab}, {dtype}), bytes moved per logits byte:")
    for name, value in loss.items():
        print(f"  {name:28s} {value:6.2f}")
    print(f"ratio ours compiled / F.cross_entropy compiled: "
          f"{loss['ours compiled'] / loss['F.cross_entropy compiled']:.2f}")
    return results, loss


if __name__ == "__main__":
    main()
