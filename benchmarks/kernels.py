#!/usr/bin/env python
"""Fused-kernel benchmark: masked softmax, LayerNorm and RMSNorm: fused vs eager vs torch.compile.

    python benchmarks/kernels.py [--device auto|cpu|cuda] [--seqs 512,1024,2048,4096]
                                 [--hiddens 1024,2048,4096,8192] [--no-compile] [--json FILE]

One table per shape. Softmax: scores ``b x heads x s x s``, causal (no mask tensor, as the
GPT model's pure-causal case) and padding (a ``[b, 1, s, s]`` key-padding mask), forward
and backward timed separately. LayerNorm and RMSNorm: ``rows x hidden``, forward and
forward+backward (the fused norms whatever the device's default path).
Baselines, measured in the same run on the same inputs: "eager" is the PyTorch composition
the kernel replaces (megatron's fallback path: upcast, scale, mask, softmax, cast back;
``torch.nn.functional.layer_norm`` for LayerNorm, the fp32 composition for RMSNorm) and
"compile" is ``torch.compile`` of that same function.

Effective bandwidth counts the bytes the op must move at least: scores in and probabilities
out (plus the mask bytes for padding); for causal, only the lower triangle of the input is
needed, so only that is counted as read; backward reads probabilities and their gradient
and writes one gradient. The same byte count is used for every implementation, so GB/s
ratios are time ratios. On a GPU the table also gives the ratio to the device-to-device copy
bandwidth measured here (``dst.copy_(src)``, 2 bytes moved per byte copied), timed with CUDA
events after flushing L2; on a CPU only ratios are printed (absolute CPU times are not
comparable across shared machines).
"""
import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron import fused_kernels  # noqa: E402
from megatron.observability import run_plots  # noqa: E402
from megatron.model.fused_layer_norm import MixedFusedLayerNorm, MixedFusedRMSNorm  # noqa: E402
from megatron.model.fused_softmax import AttnMaskType, FusedScaleMaskSoftmax  # noqa: E402


def machine(device):
    """One line naming the hardware and software of this run."""
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    line = (f"{cpu}, {cores} cores available, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), Python {platform.python_version()}")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        line = (f"{props.name} ({props.multi_processor_count} SMs, "
                f"{props.total_memory / 2**30:.0f} GiB), CUDA {torch.version.cuda}; " + line)
    return line


class Timer:
    """Times several callables round-robin, so they share whatever else the machine is doing.

    GPU: CUDA events around each call after an L2 flush, median of the rounds. CPU: the best
    round (a shared CPU adds only positive noise; the same rule applies to every callable).
    """

    def __init__(self, device, repeats):
        self.device, self.repeats = device, repeats
        self.gpu = device.type == "cuda"
        self.flush_buf = torch.empty(256 * 2**20, dtype=torch.uint8, device=device) if self.gpu \
            else None

    def _once(self, fn):
        if not self.gpu:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        self.flush_buf.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def compare(self, fns):
        """``{name: seconds}`` for ``{name: callable}``."""
        for fn in fns.values():
            for _ in range(2):
                fn()
        times = {name: [] for name in fns}
        for _ in range(self.repeats):
            for name, fn in fns.items():
                times[name].append(self._once(fn))
        pick = statistics.median if self.gpu else min
        return {name: pick(values) for name, values in times.items()}

    def __call__(self, fn):
        return self.compare({"fn": fn})["fn"]


def copy_bandwidth(device, timer):
    """Device-to-device copy bandwidth in GB/s (read + write counted)."""
    n = 2**30 if device.type == "cuda" else 2**28
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = timer(lambda: dst.copy_(src))
    return 2 * n / seconds / 1e9


def compiled(fn, enabled):
    """torch.compile(fn), or None when disabled or unavailable (reported as n/a)."""
    if not enabled:
        return None
    # A fresh cache per case: every case compiles the same function (for new shapes and a
    # new module), and past dynamo's recompile limit it would silently run eager instead.
    torch._dynamo.reset()
    try:
        return torch.compile(fn, dynamic=False)
    except Exception as exc:  # e.g. no compiler for inductor on this machine
        print(f"  torch.compile unavailable: {type(exc).__name__}: {exc}")
        return None


def attention_mask_func(scores, mask):
    return scores.masked_fill_(mask, -10000.0)


def softmax_modules(causal, dtype):
    mask_type = AttnMaskType.causal if causal else AttnMaskType.padding
    make = lambda fusion: FusedScaleMaskSoftmax(  # noqa: E731
        dtype == torch.float16, dtype == torch.bfloat16, mask_type, fusion,
        attention_mask_func, True, 0.125)
    return make(True), make(False)


def softmax_bytes(b, h, s, elem, causal, backward):
    n = b * h * s * s
    read = n * elem * ((s + 1) / (2 * s) if causal else 1.0)
    if backward:
        return 2 * read + n * elem
    return read + n * elem + (0 if causal else b * s * s)


def backward_fn(fn, inputs, grad_out):
    """A callable running only the backward: one forward builds the graph, kept for reuse."""
    out = fn(*inputs)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)


def bench_softmax_case(timer, device, dtype, b, h, s, causal, use_compile):
    fused_mod, eager_mod = softmax_modules(causal, dtype)
    x = torch.randn(b, h, s, s, device=device).to(dtype).requires_grad_()
    mask = None
    if not causal:  # key padding: a random length per batch
        lengths = torch.randint(s // 2, s + 1, (b,), device=device)
        mask = (torch.arange(s, device=device)[None, :] >= lengths[:, None])[:, None, None, :]
        mask = mask.expand(b, 1, s, s).contiguous()
    if fused_mod.kernel_unavailable_reason(mask, b, h, s, s, dtype, device) is not None:
        return None
    # The modules as the model calls them (eligibility check included); compile gets the
    # fallback's function itself.
    impls = {"fused": fused_mod, "eager": eager_mod,
             "compile": compiled(eager_mod.forward_torch_softmax, use_compile)}
    impls = {name: fn for name, fn in impls.items() if fn is not None}
    dy = torch.randn_like(x)
    rows = []
    with torch.no_grad():
        times = timer.compare({name: (lambda fn=fn: fn(x, mask)) for name, fn in impls.items()})
    assert fused_mod.last_path.startswith("fused"), fused_mod.last_path
    rows.append(("causal" if causal else "padding", "fwd", times,
                 softmax_bytes(b, h, s, x.element_size(), causal, False)))
    times = timer.compare({name: backward_fn(fn, (x, mask), dy) for name, fn in impls.items()})
    rows.append(("causal" if causal else "padding", "bwd", times,
                 softmax_bytes(b, h, s, x.element_size(), causal, True)))
    return rows


def bench_layer_norm_case(timer, device, dtype, rows, hidden, use_compile, rms=False):
    """LayerNorm (``rms``: RMSNorm) forward and forward+backward: the fused kernel against
    the PyTorch path the model takes without it (``F.layer_norm``; RMSNorm: fp32 math,
    megatron.mpu.norms.rms_norm_reference) and that path compiled."""
    from megatron.mpu.norms import norm_kernel_unavailable_reason, rms_norm_reference

    cls = MixedFusedRMSNorm if rms else MixedFusedLayerNorm
    fused = cls(hidden, params_dtype=dtype, device=device)
    x = torch.randn(rows, hidden, device=device).to(dtype).requires_grad_()
    if norm_kernel_unavailable_reason(x, fused.weight, rms=rms) is not None:
        return None
    if rms:
        w, bias = fused.weight, None

        def eager(x, w, bias):
            return rms_norm_reference(x, w, fused.eps, (hidden,))
    else:
        w, bias = fused.weight, fused.bias

        def eager(x, w, bias):
            return torch.nn.functional.layer_norm(x, (hidden,), w, bias, 1e-5)

    impls = {"fused": lambda x, w, bias: fused(x), "eager": eager,
             "compile": compiled(eager, use_compile)}
    impls = {name: fn for name, fn in impls.items() if fn is not None}
    dy = torch.randn_like(x)
    n = rows * hidden * x.element_size()
    wanted = (x, w) if bias is None else (x, w, bias)
    with torch.no_grad():
        fwd = timer.compare({name: (lambda fn=fn: fn(x, w, bias)) for name, fn in impls.items()})
    both = timer.compare({name: (lambda fn=fn: torch.autograd.grad(fn(x, w, bias), wanted, dy))
                          for name, fn in impls.items()})
    op = "rms_norm" if rms else "layer_norm"
    return [(op, "fwd", fwd, 2 * n), (op, "fwd+bwd", both, 5 * n)]


def print_table(title, rows, copy_bw, gpu, results):
    print(f"\n{title}")
    head = f"  {'op':<10} {'pass':<8} {'impl':<8}"
    head += f" {'time ms':>9} {'GB/s':>8} {'of copy':>8}" if gpu else ""
    print(head + f" {'vs eager':>9} {'vs compile':>11}")
    for op, direction, times, nbytes in rows:
        for name, seconds in times.items():
            line = f"  {op:<10} {direction:<8} {name:<8}"
            bw = nbytes / seconds / 1e9
            if gpu:
                line += f" {seconds * 1e3:9.3f} {bw:8.1f} {bw / copy_bw:8.1%}"
            vs_eager = times["eager"] / seconds
            vs_compile = times["compile"] / seconds if "compile" in times else float("nan")
            print(line + f" {vs_eager:8.2f}x {vs_compile:10.2f}x")
            results.append(dict(table=title, op=op, direction=direction, impl=name,
                                seconds=seconds, gbps=bw, vs_eager=vs_eager,
                                vs_compile=vs_compile,
                                of_copy=bw / copy_bw if copy_bw else None))


def check_targets(results, gpu):
    """The issue's targets, judged on this run's numbers (printed, never adjusted)."""
    print("\ntargets:")
    fused = [r for r in results if r["impl"] == "fused"]
    lines = []
    for r in fused:
        seq = int(r["table"].split(" x ")[-1].split()[0]) if "norm" not in r["op"] else 0
        if gpu and r["op"] == "causal" and seq >= 1024:
            ok = r["of_copy"] >= 0.8 and r["vs_eager"] >= 1.5
            lines.append((ok, f"causal {r['direction']} {r['table']}: {r['of_copy']:.0%} of copy "
                              f"(>= 80%), {r['vs_eager']:.2f}x eager (>= 1.5x)"))
        elif gpu and "norm" in r["op"] and r["direction"] == "fwd+bwd":
            lines.append((r["vs_eager"] >= 1.0, f"{r['op']} fwd+bwd {r['table']}: "
                                                f"{r['vs_eager']:.2f}x PyTorch's (>= 1x)"))
        elif not gpu and r["op"] in ("causal", "padding"):
            lines.append((r["vs_eager"] >= 1.5, f"{r['op']} {r['direction']} {r['table']}: "
                                                f"{r['vs_eager']:.2f}x eager (>= 1.5x)"))
    for ok, text in lines:
        print(f"  {'met ' if ok else 'MISS'} {text}")
    return all(ok for ok, _ in lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtypes", default=None,
                   help="comma list (default: bf16,fp16 on GPU; fp32,bf16 on CPU)")
    p.add_argument("--seqs", default="512,1024,2048,4096", help="softmax s ('' for none)")
    p.add_argument("--hiddens", default="1024,2048,4096,8192", help="norms' hidden ('' for none)")
    p.add_argument("--batch", type=int, default=None, help="softmax b (GPU 4, CPU 1)")
    p.add_argument("--heads", type=int, default=None, help="softmax heads (GPU 16, CPU 2)")
    p.add_argument("--rows", type=int, default=None, help="LayerNorm rows (GPU 16384, CPU 2048)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (GPU 20, CPU 7)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--plot", default=None,
                   help="also draw the tables (speed-up vs eager) into this PNG (needs matplotlib)")
    return p.parse_args(argv)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv=None):
    args = parse_args(argv)
    if args.plot:  # fail on a missing matplotlib before the benchmark, not after it
        run_plots.check_matplotlib()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    os.environ["MEGATRON_DEVICE"] = device.type
    dtypes = [DTYPES[d] for d in (args.dtypes or ("bf16,fp16" if gpu else "fp32,bf16")).split(",")]
    b, h = args.batch or (4 if gpu else 1), args.heads or (16 if gpu else 2)
    rows, repeats = args.rows or (16384 if gpu else 2048), args.repeats or (20 if gpu else 7)
    if args.threads:
        torch.set_num_threads(args.threads)
    print("command: python " + " ".join(shlex.quote(a) for a in sys.argv))
    print(f"machine: {machine(device)}")
    # the fused norms are measured whatever the device's default path (--layernorm-fusion)
    status = fused_kernels.load(argparse.Namespace(masked_softmax_fusion=True,
                                                   layernorm_fusion=True))
    print(f"kernels: {status}")
    timer = Timer(device, repeats)
    copy_bw = copy_bandwidth(device, timer) if gpu else None
    if gpu:
        print(f"device-to-device copy: {copy_bw:.0f} GB/s")
    results = []
    for dtype in dtypes:
        name = str(dtype).replace("torch.", "")
        for s in (int(v) for v in args.seqs.split(",") if v):
            table = []
            for causal in (True, False):
                case = bench_softmax_case(timer, device, dtype, b, h, s, causal,
                                          not args.no_compile)
                table += case or []
            if table:
                print_table(f"softmax {name} {b} x {h} x {s} x {s}", table, copy_bw, gpu, results)
            else:
                print(f"\nsoftmax {name} {b} x {h} x {s} x {s}: no fused kernel for this case")
        for hidden in (int(v) for v in args.hiddens.split(",") if v):
            for rms in (False, True):
                op = "rms_norm" if rms else "layer_norm"
                case = bench_layer_norm_case(timer, device, dtype, rows, hidden,
                                             not args.no_compile, rms=rms)
                if case:
                    print_table(f"{op} {name} {rows} x {hidden}", case, copy_bw, gpu, results)
                else:
                    print(f"\n{op} {name} {rows} x {hidden}: no fused kernel for this case")
    met = check_targets(results, gpu)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(command=sys.argv, machine=machine(device), copy_gbps=copy_bw,
                           results=results, targets_met=met), f, indent=1)
    if args.plot:
        run_plots.plot_tables(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
