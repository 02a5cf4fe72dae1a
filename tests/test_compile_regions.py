"""``--compile``: each pipeline chunk is one compiled region, and trains like eager.

For GPT-2, T5 and the Llama example, each layout is trained eagerly and with ``--compile``
(inductor) in one launch, 8 steps, fp32, dropout 0, ``--clip-grad 1.0``. Per rank:

- the compiled losses equal the eager ones within 1e-5 relative, every step;
- after the first step dynamo has compiled exactly one graph per local chunk (pp 1: one for
  the whole model with its loss) and broken none (no declared break at dropout 0);
- steps 2 .. 8 compile nothing more (dynamo's ``unique_graphs`` and ``frames`` counters
  unchanged), and at the end every region holds one graph in dynamo's cache (a
  recompilation would add one); evaluation (``--eval-interval 4``) compiles its own region
  once, at its first call;
- under a zero-bubble schedule the weight passes run as many deferred GEMMs as eager's.

The default run covers tp 2, pp 1 and 2, the zero-bubble schedules, sequence parallelism
with recompute and data parallelism across the three families, one layout each
(:data:`DEFAULT`); ``-m exhaustive`` runs every family at every layout of the matrix
(:data:`MATRIX`), 1F1B and interleaved among them.
"""
import pytest

from compile_runs import train_runs
from harness import run_distributed
from interleaved_runs import family_argv

STEPS = 8
EVAL_INTERVAL = 4
SPSR = ("--sequence-parallel", "--checkpoint-activations")
#: (tp, pp, schedule, extra flags): the acceptance matrix of issue 42.
MATRIX = [(tp, 2, schedule, ()) for tp in (1, 2)
          for schedule in ("1f1b", "interleaved", "zb-h1", "zbv")] + \
    [(1, 1, "1f1b", ()), (2, 1, "1f1b", ()), (2, 1, "1f1b", SPSR), (2, 2, "zbv", SPSR),
     (2, 2, "1f1b", SPSR)]
#: One launch per family in the default run (world size, layouts): one layout each, so
#: that a cold Inductor cache (a fresh CI machine: each kernel a C++ build) costs the default
#: run ~60 s a family. Between them: tp 2 with SP + recompute, pp 2 under ZB-V (two chunks
#: a rank) and ZB-H1, pp 1's whole model with its loss under data parallelism (Llama, dp
#: 2: both ranks compile the same graphs, once). The matrix has every other layout.
DEFAULT = {
    "gpt2": (4, [(2, 2, "zbv", SPSR)]),
    "t5": (4, [(2, 2, "zb-h1", SPSR)]),
    "llama": (2, [(1, 1, "1f1b", ())]),
}


def _argv(family, data, tp, pp, schedule, extra, world, compiled):
    dp = world // (tp * pp)
    flags = ["--pipeline-schedule", schedule, "--clip-grad", "1.0", "--eval-interval",
             str(EVAL_INTERVAL), "--eval-iters", "1", *extra]
    if schedule == "interleaved":
        flags += ["--virtual-pipeline-model-parallel-size", "2"]
    if compiled:
        flags.append("--compile")
    if family == "llama":
        from llama_runs import llama_argv

        return llama_argv(data, tp, pp, *flags, steps=STEPS, micro=1, global_batch=4 * dp)
    layers = 4 if family == "gpt2" else 2
    return family_argv(family, data, layers, "--train-iters", str(STEPS),
                       "--model-parallel-size", str(tp), "--pipe-parallel-size", str(pp),
                       "--gas", "4", *flags)


def _check(family, layout, eager, compiled):
    tp, pp, schedule, _ = layout
    name = f"{family} tp {tp} pp {pp} {schedule}"
    (eager_losses, eager_steps, _, _), (losses, steps, entries, breaks) = eager, compiled
    assert len(losses) == len(eager_losses) == STEPS, name
    error = max(abs(a - b) / abs(b) for a, b in zip(losses, eager_losses))
    assert error < 1e-5, f"{name}: compiled losses {error:.2e} from eager"
    train = {k: v for k, v in entries.items() if "train" in k and "loss" in k or
             k.startswith("tds_") and k.endswith("_train")}
    chunks = sum(1 for k in train if k.startswith("tds_")) or 1
    graphs, frames, broken, _ = steps[0]
    assert (graphs, broken) == (chunks, 0), (name, steps[0], breaks)
    assert all(s[:3] == steps[0][:3] for s in steps[1:EVAL_INTERVAL - 1]), (name, steps)
    assert set(entries.values()) <= {0, 1} and all(v == 1 for v in train.values()), \
        (name, entries)
    evals = [v for k, v in entries.items() if "eval" in k]
    assert sum(evals) >= 1, (name, entries)  # evaluation ran compiled, once per region
    assert steps[-1][1] == sum(entries.values()), (name, steps[-1], entries)
    assert [s[3] for s in steps] == [s[3] for s in eager_steps], name  # deferred GEMMs
    if schedule in ("zb-h1", "zbv"):
        assert steps[0][3] > 0, name


def _run_family(family, data, world, layouts):
    runs = []
    for layout in layouts:
        tp, pp, schedule, extra = layout
        runs += [_argv(family, data, tp, pp, schedule, extra, world, compiled)
                 for compiled in (False, True)]
    results = run_distributed(train_runs, world, family, runs, timeout=1500)
    for rank_results in results:
        for i, layout in enumerate(layouts):
            _check(family, layout, rank_results[2 * i], rank_results[2 * i + 1])


def _data(family, gpt2_data, t5_data):
    return t5_data if family == "t5" else gpt2_data


#: In the default run GPT-2's layout only (about 100 s on a cold Inductor cache; T5's 200 s,
#: the Llama example's 100 s run under -m exhaustive, as the full matrix does).
DEFAULT_RUN = ("gpt2",)


@pytest.mark.slow
@pytest.mark.parametrize("family", [f if f in DEFAULT_RUN else
                                    pytest.param(f, marks=pytest.mark.exhaustive)
                                    for f in sorted(DEFAULT)])
def test_compiled_chunks_train_like_eager_with_one_graph_each(family, gpt2_data, t5_data):
    world, layouts = DEFAULT[family]
    _run_family(family, _data(family, gpt2_data, t5_data), world, layouts)


@pytest.mark.exhaustive
@pytest.mark.parametrize("family", ["gpt2", "t5", "llama"])
def test_every_layout_and_schedule_compiled(family, gpt2_data, t5_data):
    _run_family(family, _data(family, gpt2_data, t5_data), 4,
                [layout for layout in MATRIX if layout[0] * layout[1] <= 4])


@pytest.mark.parametrize("flags,message", [
    (("--cuda-graphs",), r"--cuda-graphs replays the regions --compile builds: add --compile"),
    (("--cuda-graphs", "--compile"), r"--cuda-graphs needs a CUDA device"),
    (("--cuda-graphs", "--compile", "--pipe-parallel-size", "2"),
     r"--cuda-graphs is not supported with pipeline parallelism"),
])
def test_cuda_graphs_are_refused_where_they_cannot_run(flags, message):
    import torch

    from megatron.config.parser import parse_args
    from megatron.common.errors import ConfigError

    if "CUDA device" in message and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    base = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "1",
            "--train-iters", "2", "--lr", "1e-3"]
    with pytest.raises(ConfigError, match=message):
        parse_args(base + list(flags), world_size=2, rank=0, check_files=False)
