"""Rank bodies and layouts for the zero-bubble equivalence tests (tests/test_zero_bubble.py).

Each launch trains several layouts of one family in turn (one process per rank), recording
per step what the pipeline engine saw: the peak chunk-micro-batches in flight on this rank
and the weight-gradient GEMMs its weight passes ran.
"""
import importlib

from interleaved_runs import family_argv

STEPS = 8
CLIP = ("--clip-grad", "1.0")
ENTRY = {"gpt2": "pretrain_gpt2", "t5": "pretrain_t5"}
STACKS = {"gpt2": 1, "t5": 2, "llama": 1}


def layers_for(family, pp):
    """Transformer layers of a model every layout of the test can cut: 2 x pp chunks of
    one layer (ZB-V), and for T5 both stacks together."""
    return 2 * pp // STACKS[family]


def argv(family, data, layers, tp, pp, m, schedule, dp=1, *extra):
    """A dropout-free tiny run of ``family`` for STEPS steps, clipping on, at (tp, pp, dp)
    with m micro-batches of one sample per step on each data-parallel rank."""
    flags = ["--pipeline-schedule", schedule, *CLIP, *extra]
    if family == "llama":
        from llama_runs import llama_argv

        return llama_argv(data, tp, pp, "--num-layers", str(layers), *flags, steps=STEPS,
                          micro=1, global_batch=m * dp)
    return family_argv(family, data, layers, "--train-iters", str(STEPS),
                       "--model-parallel-size", str(tp), "--pipe-parallel-size", str(pp),
                       "--gas", str(m), *flags)


def _engine_stats():
    """Wrap ScheduleStep.train to record (peak in flight, deferred GEMMs) per step."""
    from tds.pipe.schedule_step import ScheduleStep

    stats = []
    original = ScheduleStep.train

    def train(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        stats.append((self.schedule, self.placement.chunks(self.stage.stage_id),
                      self.peak_in_flight, self.deferred_gemms))
        return result

    ScheduleStep.train = train
    return stats, lambda: setattr(ScheduleStep, "train", original)


def train_layouts(family, runs):
    """Rank body: each argv of ``runs`` in turn; per run (losses, per-step engine stats)."""
    stats, restore = _engine_stats()
    out = []
    try:
        for run in runs:
            del stats[:]
            out.append((_train(family, run), list(stats)))
    finally:
        restore()
    return out


def _train(family, run):
    if family == "llama":
        from llama_runs import train_llama

        return train_llama(run)
    return importlib.import_module(ENTRY[family]).main(run).losses
