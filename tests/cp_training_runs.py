"""Rank bodies and flags of the context-parallel training tests
(tests/test_context_parallel_training.py): GPT-2 and the Llama example trained through
pretrain(), several runs per launch."""
import os

from gpt2_runs import layout_argv
from llama_runs import llama_argv

STEPS, AT = 8, 4
DOCUMENTS = ("--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss")


def run_argv(data, family, tp, pp, cp, dp, *extra, comm="p2p", documents=False):
    """A dropout-free fp32 run of ``family`` (4 layers, hidden 32, 4 heads, sequences of 32,
    global batch 8 in micro-batches of 2) for STEPS steps, clipping on, at (tp, pp, cp, dp),
    evaluating 2 batches every AT steps."""
    flags = ["--clip-grad", "1.0", "--context-parallel-size", str(cp), "--cp-comm-type", comm,
             "--eval-interval", str(AT), "--eval-iters", "2",
             *(DOCUMENTS if documents else ()), *extra]
    if family == "llama":
        return llama_argv(data, tp, pp, *flags, steps=STEPS, micro=2, global_batch=8)
    return layout_argv(data, tp, pp, dp, *flags, steps=STEPS, micro=2, global_batch=8)


def _family(name):
    if name == "llama":
        from llama_model import LLAMA  # llama_runs put examples/llama on the path

        return LLAMA
    from megatron.families import get_family

    return get_family(name)


def train_runs(runs, count_syncs=()):
    """Rank body: each ``(family, argv, tracker)`` of ``runs`` in turn through pretrain().

    ``tracker``: None, or ``(checkpoint folder, iteration)`` to point the folder's tracker
    at before the run (rank 0 writes it; a resume from a step the saving run passed).
    ``count_syncs``: indices of runs whose host-device syncs are counted per step
    (tests/sync_count.py).

    Returns:
        per run ``("ok", per-step losses, [(iteration, validation loss)])`` (and with
        ``count_syncs`` the number of sync events of each step), or for a configuration
        error ``("error", message, whether mpu's groups were built)``.
    """
    import torch.distributed as dist

    from megatron import mpu
    from megatron.common.errors import ConfigError
    from megatron.training import pretrain

    out = []
    for number, (family, argv, tracker) in enumerate(runs):
        if tracker is not None:
            if dist.get_rank() == 0:  # replaced whole: the last run's closing line may read it
                path = os.path.join(tracker[0], "latest_checkpointed_iteration.txt")
                with open(path + ".tmp", "w") as handle:
                    handle.write(str(tracker[1]))
                os.replace(path + ".tmp", path)
            dist.barrier()
        mpu.destroy_model_parallel()  # the last run's groups: a refusal must build none
        try:
            if number in count_syncs:
                from sync_count import step_sync_counts

                states = []
                steps = step_sync_counts(
                    lambda a: states.append(pretrain(family=_family(family), argv=a)), argv)
                out.append(("ok", states[0].losses, states[0].eval_losses,
                            [len(events) for events in steps]))
            else:
                state = pretrain(family=_family(family), argv=argv)
                out.append(("ok", state.losses, state.eval_losses))
        except ConfigError as exc:
            out.append(("error", str(exc), mpu.model_parallel_is_initialized()))
    return out


def relative_error(losses, reference):
    assert len(losses) == len(reference), (losses, reference)
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
