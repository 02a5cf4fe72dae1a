"""Rank bodies and flags for the FP8 training tests (tests/test_fp8_training.py).

Each launch trains several runs in turn in the same processes (no start-up per run), a
dropout-free tiny GPT-2 (or the Llama example) on the real corpus under bf16, with or
without FP8, and returns each run's per-step losses.
"""
import math

from gpt2_runs import gpt2_argv

#: The FP8 curve's tolerance: at every step within this fraction of the bf16 run's final loss.
CURVE_TOL = 0.02
#: Over 300 steps: the means of each WINDOW steps within this fraction of the bf16 final loss.
#: Per step the curves of two runs part as their weights do (bf16 against bf16 at tp 2: 2.0%
#: of the final loss at the worst step, 1.0% in 25-step means; FP8: 1.4-2.7% in the means).
LONG_TOL, WINDOW = 0.03, 25
#: tp 2 against tp 1, both FP8: relative difference per step.
TP_TOL = 1e-3


def fp8_flags(recipe):
    """``"hybrid-rowwise"`` -> the FP8 flags; None -> none (the bf16 run)."""
    if recipe is None:
        return []
    fmt, name = recipe.split("-")
    return ["--fp8-format", fmt, "--fp8-recipe", name]


def gpt2_fp8_argv(data, recipe, steps, tp=1, pp=1, *extra, layers=2):
    """A bf16 run (FP8 as ``recipe`` says): 2 layers x 32, 4 heads, 32 tokens, 4 micro-batches
    of 2 per step (every GEMM dimension a multiple of 16), dropout 0."""
    return gpt2_argv(data, "--num-layers", str(layers), "--bf16", "--batch-size", "2",
                     "--global-batch-size", "8", "--train-iters", str(steps),
                     "--model-parallel-size", str(tp), "--pipe-parallel-size", str(pp),
                     "--hidden-dropout", "0", "--attention-dropout", "0",
                     "--log-interval", str(steps), *fp8_flags(recipe), *extra)


def llama_fp8_argv(data, recipe, steps, tp=1, pp=1, *extra):
    """The Llama example at sizes FP8 takes (head 8, 4 key-value heads, ffn 64), bf16."""
    from llama_runs import llama_argv

    return llama_argv(data, tp, pp, "--bf16", "--num-key-value-heads", "4",
                      "--ffn-hidden-size", "64", "--log-interval", str(steps),
                      *fp8_flags(recipe), *extra, steps=steps)


def train_runs(family, runs):
    """Rank body: each argv of ``runs`` in turn; returns their per-step losses."""
    out = []
    for argv in runs:
        if family == "llama":
            from llama_runs import train_llama

            out.append(list(train_llama(argv)))
        else:
            import pretrain_gpt2

            out.append(list(pretrain_gpt2.main(argv).losses))
    return out


def curve_problems(name, fp8, bf16, tol=CURVE_TOL):
    """What is wrong with an FP8 loss curve against the bf16 one (empty: nothing)."""
    problems = []
    if len(fp8) != len(bf16):
        return [f"{name}: {len(fp8)} steps, bf16 {len(bf16)}"]
    bad = [i for i, x in enumerate(fp8) if not math.isfinite(x)]
    if bad:
        problems.append(f"{name}: non-finite loss at steps {bad}")
    limit = tol * bf16[-1]
    worst = max(abs(a - b) for a, b in zip(fp8, bf16))
    if not worst <= limit:
        problems.append(f"{name}: {worst:.4f} from bf16 (allowed {limit:.4f} = {tol:.0%} of "
                        f"the final bf16 loss {bf16[-1]:.4f})")
    if not bf16[-1] < bf16[0] - 0.3:
        problems.append(f"{name}: the bf16 reference does not train ({bf16[0]} -> {bf16[-1]})")
    return problems


def window_problems(name, fp8, bf16, tol=LONG_TOL, window=WINDOW):
    """What is wrong with a long FP8 curve against bf16: a non-finite step, a window mean
    further than ``tol`` x the bf16 final loss from bf16's."""
    if len(fp8) != len(bf16):
        return [f"{name}: {len(fp8)} steps, bf16 {len(bf16)}"]
    problems = [f"{name}: non-finite loss at step {i}" for i, x in enumerate(fp8)
                if not math.isfinite(x)][:1]
    means = [[sum(c[i:i + window]) / window for i in range(0, len(c) - window + 1, window)]
             for c in (fp8, bf16)]
    worst = max(abs(a - b) for a, b in zip(*means))
    if not worst <= tol * bf16[-1]:
        problems.append(f"{name}: {window}-step means {worst:.4f} from bf16's (allowed "
                        f"{tol * bf16[-1]:.4f} = {tol:.0%} of its final loss)")
    return problems


def relative(a, b):
    """Largest per-step relative difference of two curves."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))
