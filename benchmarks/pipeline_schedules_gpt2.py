#!/usr/bin/env python
"""Pipeline schedules on real GPT-2 chunks: measured step time against the simulator.

    python benchmarks/pipeline_schedules_gpt2.py [--pp 4] [--micro-batches 8 4] [--rounds 2]

One launch of ``--pp`` gloo ranks on this machine (tp 1, dp 1, one torch thread each)
trains the same GPT-2 (``pretrain_gpt2.main``, fp32, dropout 0, the device the run picks:
the CPU here) under each schedule in turn: 1f1b, interleaved (v 2), zb-h1 and zbv, for
every ``--micro-batches`` m, ``--rounds`` times in turns. Inside each step the engine's
runner callbacks (``ScheduleStep.load / forward / backward / backward_input /
backward_weight``) and its p2p calls are timed with ``time.perf_counter`` (and
``time.thread_time``), and so is the runner's whole pass (``ScheduleRunner.run``, after a
barrier, so every rank starts together as the simulator assumes). Per timed step:

- the measured step: the pipelined part of the step (first rank's start to the last
  rank's end of ``ScheduleRunner.run``, on the machine's monotonic clock, which all the
  local ranks share);
- the costs: per (chunk, kind) the mean over the step's micro-batches; F = forward
  (+ chunk 0's batch load), B = input-gradient pass, W = weight pass, BW = fused backward;
  the p2p latency: a ping-pong of the boundary tuple between ranks 0 and 1 after each run
  (one way, the mean of the activation tuple and the gradient; median over the runs);
- the prediction: ``pipeline_simulator.simulate`` of the schedule's action lists with
  that step's costs and the latency;
- the bubble: 1 - busy / step per rank (busy = the rank's callback time inside the step),
  mean over ranks (the simulator's ``overall_bubble``), and the largest rank's.

The table holds medians over the timed steps (``--warmup`` steps of each run are dropped),
meas/pred the median of the per-step ratios. Also shown, not used in the prediction: the
p2p latency as the run saw it (per p2p call, its end minus the moment both ends of its
messages were posted: the simulator's definition of the latency, wake-up included) and
meas/pred with that latency instead; the runner's own time per action (outside the
callbacks and the p2p calls).

The optimizer step, the tied-weight and data-parallel reductions after the pipelined part
are outside the schedule and outside the comparison (shown as "rest").

CPU contention: with more ranks than free cores, ranks computing at the same time slow
each other, so a pass costs more where the pipeline is full than in its fill and drain.
The costs measured in the run carry that contention on average; "wall/cpu" (callback wall
time over its CPU time) shows how much, and "floor" (all ranks' CPU time per step / the
cores) is the least time the machine could take for the step's work, whatever the
schedule. docs/measurements/pipeline_schedules.md ("Measured with real GPT-2 chunks") says what
this means for the comparison.
"""
import argparse
import os
import platform
import shlex
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (REPO, os.path.join(REPO, "benchmarks"), os.path.join(REPO, "tests")):
    if _path not in sys.path:
        sys.path.insert(0, _path)

SCHEDULE_ORDER = ("1f1b", "interleaved", "zb-h1", "zbv")
KINDS = {"load": "L", "forward": "F", "backward": "BW", "backward_input": "B",
         "backward_weight": "W"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--micro-batches", type=int, nargs="+", default=[8, 4])
    p.add_argument("--schedules", nargs="+", choices=SCHEDULE_ORDER, default=list(SCHEDULE_ORDER))
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=2, help="samples per micro-batch")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first, per run")
    p.add_argument("--rounds", type=int, default=2,
                   help="runs per schedule, taken in turns (1f1b, interleaved, zb-h1, zbv, "
                        "1f1b, ...) so that a change in the machine's load hits all alike")
    p.add_argument("--workdir", default=os.path.join("/tmp", "tds_pipeline_gpt2_bench"),
                   help="where the sample corpus, tokenizer and dataset are built (cached)")
    p.add_argument("--timeout", type=float, default=1800)
    return p.parse_args(argv)


# ---------------------------------------------------------------- data and flags
def prepare_data(workdir):
    """Sample corpus, GPT-2 BPE (vocab 500) and indexed dataset with the project's tools
    (benchmarks/async_save.make_data, cached in ``workdir``); returns the data flags."""
    from benchmarks.async_save import make_data

    root = os.path.abspath(workdir)
    os.makedirs(root, exist_ok=True)
    tok, prefix = os.path.join(root, "tok"), os.path.join(root, "corpus_text_document")
    if os.path.exists(prefix + ".bin"):
        data = {"prefix": prefix, "vocab": os.path.join(tok, "vocab.json"),
                "merges": os.path.join(tok, "merges.txt")}
    else:
        data = make_data(root)
    return data_flags(data["prefix"], data["vocab"], data["merges"])


def data_flags(prefix, vocab, merges):
    return ["--data-path", prefix, "--vocab-file", vocab, "--merge-file", merges,
            "--tokenizer-type", "GPT2BPETokenizer"]


def model_argv(opts, data, schedule, m):
    """pretrain_gpt2 flags: the model, pp ranks, m micro-batches, warmup + steps steps."""
    argv = ["--num-layers", str(opts.layers), "--hidden-size", str(opts.hidden),
            "--num-attention-heads", str(opts.heads), "--seq-length", str(opts.seq),
            "--max-position-embeddings", str(opts.seq), "--batch-size", str(opts.micro_batch),
            "--gas", str(m), "--train-iters", str(opts.warmup + opts.steps),
            "--pipe-parallel-size", str(opts.pp), "--pipeline-schedule", schedule,
            "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-4",
            "--min-lr", "1e-5", "--warmup", "0.1", "--split", "100,0,0",
            "--make-vocab-size-divisible-by", "64", "--log-interval", str(10**6),
            "--eval-interval", str(10**6), "--eval-iters", "0", "--seed", "1234", *data]
    if schedule in ("interleaved", "zbv"):
        argv += ["--virtual-pipeline-model-parallel-size", "2"]
    return argv


# ---------------------------------------------------------------- in the ranks
class Recorder:
    """Times the runner's callbacks, p2p calls and passes on this rank (class patches)."""

    def __init__(self):
        from tds.pipe.runner import ScheduleRunner
        from tds.pipe.schedule_step import ScheduleStep

        self.targets = [(ScheduleStep, name) for name in KINDS] + \
            [(ScheduleRunner, "_communicate"), (ScheduleRunner, "run"),
             (ScheduleStep, "train_batch")]
        self.originals = {t: getattr(*t) for t in self.targets}
        self.steps, self.meta, self.device = [], None, None  # steps: {"run", "actions", ...}

    def __enter__(self):
        for cls, name in self.targets:
            setattr(cls, name, self._wrap(cls, name, self.originals[(cls, name)]))
        return self

    def __exit__(self, *exc):
        for (cls, name), fn in self.originals.items():
            setattr(cls, name, fn)

    def _wrap(self, cls, name, fn):
        import torch.distributed as dist

        rec = self

        def timed(obj, *args):
            if name == "run":
                dist.barrier()  # every rank starts the schedule together (the simulator's t = 0)
            if name == "train_batch":
                rec.steps.append({"actions": [], "comm": 0.0, "calls": []})
                rec.device = obj.engine.device
            _sync(rec.device)
            t0, c0 = time.perf_counter(), time.thread_time()
            out = fn(obj, *args)
            _sync(rec.device)
            t1, c1 = time.perf_counter(), time.thread_time()
            step = rec.steps[-1]
            if name in KINDS:
                chunk, mb = (0, args[0]) if name == "load" else args[:2]
                step["actions"].append((KINDS[name], chunk, mb, t0, t1, c1 - c0))
            elif name == "_communicate":  # the messages, named on both ends alike
                step["comm"] += t1 - t0
                step["calls"].append(([message_key(op) for op in args[0]], t0, t1))
            elif name == "run":
                step["run"] = (t0, t1)
                step["num_actions"] = len(obj.actions)
            else:
                step["train"] = t1 - t0
                rec.meta = rec.meta or obj.boundaries[0].meta
            return out

        return timed


def _sync(device):
    """On an accelerator, wait for the queued work so that host timers see it (a timing
    run only: the engine itself never waits in a step); nothing on the CPU."""
    import torch

    if device is not None and torch.device(device).type != "cpu":
        torch.accelerator.synchronize(device)


def message_key(op):
    """("A" activation / "G" gradient, chunk, mb): the same on the sender and the receiver."""
    from tds.pipe.schedules import RecvAct, SendAct

    return ("A" if isinstance(op, (SendAct, RecvAct)) else "G", op.chunk, op.mb)


def p2p_latency(meta, device, repeats=40):
    """One-way seconds of the activation tuple and of the gradient (position 0), ranks 0-1,
    each message one ``batch_isend_irecv`` as in the runner."""
    import torch
    import torch.distributed as dist

    rank, result = dist.get_rank(), []
    for positions in (range(len(meta)), [0]):
        bufs = [torch.zeros(meta[i][0], dtype=meta[i][1], device=device) for i in positions]
        dist.barrier()
        start = time.perf_counter()
        for _ in range(repeats if rank in (0, 1) else 0):
            for sender in (0, 1):
                make = dist.isend if rank == sender else dist.irecv
                ops = [dist.P2POp(make, b, 1 - rank) for b in bufs]
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
        result.append((time.perf_counter() - start) / (2 * repeats))
        dist.barrier()
    return result


def rank_body(runs):
    """Rank body: ``pretrain_gpt2.main`` per (schedule, m, argv); returns per run the
    recorded steps and the p2p latencies (activation, gradient) measured right after it."""
    import pretrain_gpt2

    out = []
    for schedule, m, argv in runs:
        with Recorder() as rec:
            pretrain_gpt2.main(argv)
        out.append((rec.steps, p2p_latency(rec.meta, rec.device)))
    return out


# ---------------------------------------------------------------- analysis
def analyse(name, pp, m, runs, warmup, cores):
    """One row: measured and predicted step and bubble, costs, contention.

    Each timed step is predicted from its own measured costs (a step that a burst of the
    machine's load slowed is compared with costs that burst inflated too); a run's figures
    are medians over its timed steps (meas/pred: of the per-step ratios). The row is the
    schedule's run least slowed by contention (lowest callback wall / CPU time), so that a
    burst of other jobs' work during one run does not decide it; ``row["runs"]`` keeps
    every run.

    Args:
        runs: per run of this (schedule, m), per rank (recorded steps, p2p latencies).
    """
    from tds.pipe.schedules import build_schedule

    vpp = 2 if name in ("interleaved", "zbv") else 1
    actions, placement = build_schedule(name, pp, vpp, m)
    summaries = [_analyse_run(actions, placement, per_rank, warmup, cores) for per_rank in runs]
    row = dict(min(summaries, key=lambda run: run["wall_cpu"]))
    row.update(name=name, v=vpp, m=m, runs=summaries)
    return row


def _analyse_run(actions, placement, per_rank, warmup, cores):
    from pipeline_simulator import Costs, simulate

    act, grad = per_rank[0][1]
    latency = (act + grad) / 2  # the simulator has one latency per message
    per_step = []
    for ranks in list(zip(*(r[0] for r in per_rank)))[warmup:]:
        step = _measure_step(ranks, cores)
        sim = simulate(actions, placement, Costs.from_chunks(step["costs"], p2p=latency))
        in_run = simulate(actions, placement,
                          Costs.from_chunks(step["costs"], p2p=step["in_run_latency"]))
        replay = simulate(actions, placement, Replay(ranks, latency))
        step.update(pred=sim.step_time, ratio=step["step"] / sim.step_time,
                    pred_bubble=sim.overall_bubble, pred_bubble_max=max(sim.bubble),
                    ratio_in_run=step["step"] / in_run.step_time,
                    ratio_replay=step["step"] / replay.step_time)
        per_step.append(step)
    run = {k: statistics.median(s[k] for s in per_step) for k in per_step[0] if k != "costs"}
    run.update(sd=_sd([s["step"] for s in per_step]), latency=(act, grad),
               costs=_median_costs([s["costs"] for s in per_step]))
    return run


class Replay:
    """Simulator costs that are every action's own measured time in one step (not the
    mean per chunk and kind): what the simulator predicts when it knows each pass."""

    def __init__(self, ranks, p2p):
        from tds.pipe.schedules import Backward, BackwardInput, BackwardWeight, Forward

        kinds = {"L": Forward, "F": Forward, "B": BackwardInput, "W": BackwardWeight,
                 "BW": Backward}
        self.p2p, self.times = p2p, {}
        for r in ranks:
            for kind, chunk, mb, t0, t1, _ in r["actions"]:
                key = (kinds[kind], chunk, mb)  # a load adds to chunk 0's forward
                self.times[key] = self.times.get(key, 0.0) + t1 - t0

    def of(self, action, vpp_size):
        return self.times[(type(action), action.chunk, action.mb)]


def _measure_step(ranks, cores):
    """One step's figures from every rank's record (times on the shared monotonic clock)."""
    start = min(r["run"][0] for r in ranks)
    step = max(r["run"][1] for r in ranks) - start
    busy = [sum(a[4] - a[3] for a in r["actions"]) for r in ranks]
    cpu = [sum(a[5] for a in r["actions"]) for r in ranks]
    overhead = statistics.mean((r["run"][1] - r["run"][0] - b - r["comm"]) / r["num_actions"]
                               for r, b in zip(ranks, busy))
    return {"step": step, "bubble": 1 - sum(busy) / (len(busy) * step),
            "bubble_max": max(1 - b / step for b in busy),
            "rest": max(r["train"] - (r["run"][1] - r["run"][0]) for r in ranks),
            "wall_cpu": sum(busy) / sum(cpu), "floor": sum(cpu) / min(cores, len(ranks)),
            "overhead": overhead, "costs": _fill_kinds(_step_costs(ranks)),
            "in_run_latency": statistics.median(_message_delays(ranks))}


def _message_delays(ranks):
    """Per p2p call: its end minus the moment its last message could start
    (both ends posted), the simulator's p2p latency as this step saw it."""
    posted = {}  # message -> the times its two ends were posted
    for r in ranks:
        for keys, t0, _ in r["calls"]:
            for key in keys:
                posted.setdefault(key, []).append(t0)
    delays = []
    for r in ranks:
        for keys, t0, t1 in r["calls"]:
            ready = max(max(posted[key]) for key in keys)  # both ends of every message
            delays.append(t1 - max(t0, ready))
    return delays


def _step_costs(ranks):
    """{chunk: {kind: mean seconds over the step's micro-batches}} (F includes the load)."""
    sums = {}
    for r in ranks:
        for kind, chunk, _, t0, t1, _ in r["actions"]:
            sums.setdefault(chunk, {}).setdefault(kind, []).append(t1 - t0)
    out = {}
    for chunk, kinds in sums.items():
        out[chunk] = {k: sum(v) / len(v) for k, v in kinds.items() if k != "L"}
        if "L" in kinds:  # chunk 0's batch load runs just before its forward
            out[chunk]["F"] += sum(kinds["L"]) / len(kinds["L"])
    return out


def _fill_kinds(costs):
    """The fused backward's schedules (1F1B, interleaved) measure BW only, which is all the
    simulator uses for them: give B = BW, W = 0 so that ``Costs.from_chunks`` takes it."""
    for kinds in costs.values():
        if "BW" in kinds:
            kinds.setdefault("B", kinds["BW"])
            kinds.setdefault("W", 0.0)
    return costs


def _median_costs(cost_steps):
    """Median over steps per (chunk, kind)."""
    return {chunk: {k: statistics.median(s[chunk][k] for s in cost_steps) for k in kinds}
            for chunk, kinds in cost_steps[0].items()}


def _sd(xs):
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def table(rows):
    """The comparison table; step/1F1B against the 1F1B row of the same m."""
    head = (f"{'schedule':>11} {'v':>1} {'m':>2} {'meas ms':>8} {'+-sd':>5} {'pred ms':>8} "
            f"{'meas/pred':>9} {'bubble':>6} {'pred':>5} {'max':>5} {'pred':>5} "
            f"{'/1F1B meas':>10} {'pred':>5} {'wall/cpu':>8} {'floor ms':>8} {'rest ms':>7} "
            f"{'ovh/act ms':>10}")
    lines = [head]
    base = {r["m"]: r for r in rows if r["name"] == "1f1b"}
    for r in rows:
        b = base.get(r["m"])
        ratio = (f"{r['step'] / b['step']:>10.3f} {r['pred'] / b['pred']:>5.3f}" if b
                 else f"{'-':>10} {'-':>5}")
        lines.append(
            f"{r['name']:>11} {r['v']:>1} {r['m']:>2} {r['step'] * 1e3:>8.1f} "
            f"{r['sd'] * 1e3:>5.1f} {r['pred'] * 1e3:>8.1f} {r['ratio']:>9.3f} "
            f"{r['bubble']:>6.3f} {r['pred_bubble']:>5.3f} {r['bubble_max']:>5.3f} "
            f"{r['pred_bubble_max']:>5.3f} {ratio} {r['wall_cpu']:>8.2f} "
            f"{r['floor'] * 1e3:>8.1f} {r['rest'] * 1e3:>7.1f} {r['overhead'] * 1e3:>10.2f}")
    return lines


def cost_lines(rows):
    """Per schedule the measured per-chunk costs in ms (F / B / W, or F / BW)."""
    lines = []
    for r in rows:
        parts = []
        for chunk, k in sorted(r["costs"].items()):
            split = f"{k['B'] * 1e3:.1f}/{k['W'] * 1e3:.1f}" if "BW" not in k \
                else f"{k['BW'] * 1e3:.1f}"
            parts.append(f"c{chunk} {k['F'] * 1e3:.1f}/{split}")
        kinds = "F/BW" if r["name"] in ("1f1b", "interleaved") else "F/B/W"
        act, grad = r["latency"]
        lines.append(f"  {r['name']} m={r['m']} costs ms ({kinds}): " + ", ".join(parts) +
                     f"; p2p ping-pong {act * 1e3:.2f} (activation) {grad * 1e3:.2f} "
                     f"(gradient), in the run {r['in_run_latency'] * 1e3:.2f} (meas/pred "
                     f"with it {r['ratio_in_run']:.3f}); meas/replay {r['ratio_replay']:.3f}")
        runs = r["runs"]
        lines.append(f"    every run: meas ms {_each(runs, 'step', 1e3, '.0f')}; meas/pred "
                     f"{_each(runs, 'ratio')}; bubble {_each(runs, 'bubble')} (pred "
                     f"{_each(runs, 'pred_bubble')}); wall/cpu {_each(runs, 'wall_cpu', 1, '.2f')}")
    return lines


def _each(runs, key, scale=1, fmt=".3f"):
    return " ".join(f"{run[key] * scale:{fmt}}" for run in runs)


def machine_line():
    import torch

    u = platform.uname()
    return (f"machine: {u.system} {u.release} {u.machine}, {os.cpu_count()} cores, "
            f"python {platform.python_version()}, torch {torch.__version__}, load average "
            f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")


def run(opts, data):
    """Launch the ranks (every schedule and m, ``--rounds`` times in turns); the rows."""
    from harness import run_distributed

    cases = [(name, m) for m in opts.micro_batches for name in opts.schedules]
    runs = [(name, m, model_argv(opts, data, name, m))
            for _ in range(opts.rounds) for name, m in cases]
    per_rank = run_distributed(rank_body, opts.pp, runs, timeout=opts.timeout)
    rows = []
    for name, m in cases:
        mine = [[r[i] for r in per_rank] for i, run in enumerate(runs) if run[:2] == (name, m)]
        rows.append(analyse(name, opts.pp, m, mine, opts.warmup, os.cpu_count()))
    return rows


def main(argv=None):
    opts = parse_args(argv)
    print(f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(machine_line() + " (before)")
    data = prepare_data(opts.workdir)
    print(f"model: GPT-2, {opts.layers} layers, hidden {opts.hidden}, {opts.heads} heads, "
          f"seq {opts.seq}, micro-batch {opts.micro_batch}, vocab 512 (padded), fp32; pp "
          f"{opts.pp}, tp 1, dp 1, 1 torch thread per rank, gloo; {opts.rounds} runs per "
          f"schedule in turns, each {opts.warmup} warm-up + {opts.steps} timed steps")
    start = time.perf_counter()
    rows = run(opts, data)
    print("\n".join(table(rows)))
    print("\n".join(cost_lines(rows)))
    print("each row: the schedule's run with the least contention (lowest wall/cpu; every "
          "run listed under the costs); meas: pipelined part of the step (ScheduleRunner.run, "
          "first start to last end), median over the run's steps; pred: simulator with each "
          "step's measured costs and the ping-pong latency, meas/pred: median per step; "
          "replay: the simulator given each pass's own time in the step instead of the mean "
          "per chunk and kind; "
          "bubble: 1 - busy/step, mean over ranks (max: the largest rank's); wall/cpu: "
          "callback wall over CPU time (contention); floor: all ranks' callback CPU time / "
          "cores; rest: optimizer step and reductions after the pipelined part; ovh/act: "
          "runner time outside callbacks and p2p per action, mean over ranks")
    print(f"{machine_line()} (after; {time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
