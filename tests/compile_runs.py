"""Rank bodies for the compiled-step tests (tests/test_compile_regions.py).

Each launch trains several runs of one family in turn (eager and ``--compile`` at a layout),
recording per step what dynamo did: graphs compiled so far (``counters["stats"]
["unique_graphs"]``), frames compiled (``counters["frames"]["total"]``), graph breaks
(``counters["graph_break"]``), the weight-gradient GEMMs a zero-bubble step's weight passes
ran, and at the end each compiled region's cache entries (1 =
compiled once, never recompiled).
"""
import importlib

ENTRY = {"gpt2": "pretrain_gpt2", "t5": "pretrain_t5"}


def _step_hook(record):
    """Wrap megatron.training.loop.train_step to call ``record(backend)`` after each step."""
    from megatron.training import loop

    original = loop.train_step

    def train_step(forward_step_func, data_iterator, backend):
        out = original(forward_step_func, data_iterator, backend)
        record(backend)
        return out

    loop.train_step = train_step
    return lambda: setattr(loop, "train_step", original)


def _dynamo_counts():
    from torch._dynamo.utils import counters

    return (counters["stats"]["unique_graphs"], counters["frames"]["total"],
            sum(counters["graph_break"].values()))


def _main(family):
    if family == "llama":
        from llama_runs import train_llama  # noqa: F401 (puts examples/llama on the path)
        from llama_model import LLAMA

        from megatron.training import pretrain

        return lambda argv: pretrain(family=LLAMA, argv=argv)
    return importlib.import_module(ENTRY[family]).main


def train_runs(family, runs):
    """Rank body: each argv of ``runs`` in turn. Per run: ``(losses, per-step dynamo counts
    (graphs, frames, breaks, deferred GEMMs), region cache entries, graph-break reasons)``."""
    import torch
    from torch._dynamo.utils import counters

    from megatron.model.compile import region_cache_entries

    out = []
    for argv in runs:
        torch._dynamo.reset()
        counters.clear()
        steps, entries = [], {}

        def record(backend):
            schedule = getattr(backend, "schedule", None)
            deferred = schedule.deferred_gemms if schedule is not None else 0
            steps.append(_dynamo_counts() + (deferred,))
            entries.clear()
            entries.update(region_cache_entries(backend.model))

        restore = _step_hook(record)
        try:
            state = _main(family)(argv)
        finally:
            restore()
        reasons = sorted(str(k)[:160] for k in counters["graph_break"])
        out.append((list(state.losses), steps, dict(entries), reasons))
    return out
