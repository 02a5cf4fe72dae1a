"""A family written against the earlier API, whose serial model names its tensors unlike its
pipeline stages (tests/old_api_llama.py: the Llama example's layer specs as the pipeline, a
serial model with attributes of its own), has no key map: its pp 2 checkpoint resumes at pp 1
and at tp 2 (pp 1) by the match of the two models' structure (the same layer classes in the
same order, shapes and splits checked), with the losses of the uninterrupted run; a serial
model that creates its final norm before its layers is refused, on every rank, with what
could not be matched and the fix (megatron/checkpoint/structural_match.py)."""
from harness import run_distributed
from llama_runs import llama_argv
from gpt2_runs import relative_error

STEPS, AT = 4, 2


def _runs(data, ckpt):
    """Rank body (2 ranks): pp 2 for STEPS steps saving at AT; from AT at pp 1 (dp 2) and at
    tp 2; the ambiguous family at pp 1; each rank's losses (or message) per run."""
    import os

    import torch.distributed as dist

    from old_api_llama import train

    def argv(tp, pp, *extra):
        return llama_argv(data, tp, pp, "--log-interval", "1", *extra, steps=STEPS)

    runs = {"pp2": train(argv(1, 2, "--save", ckpt, "--save-interval", str(AT)))}
    dist.barrier()
    if dist.get_rank() == 0:  # back to AT (the run's last save was at STEPS)
        with open(os.path.join(ckpt, "tracker.tmp"), "w") as handle:
            handle.write(str(AT))
        os.replace(os.path.join(ckpt, "tracker.tmp"),
                   os.path.join(ckpt, "latest_checkpointed_iteration.txt"))
    dist.barrier()
    runs["pp1"] = train(argv(1, 1, "--load", ckpt))
    runs["tp2"] = train(argv(2, 1, "--load", ckpt))
    runs["ambiguous"] = train(argv(1, 1, "--load", ckpt), ambiguous=True)
    return runs


def test_an_older_api_family_resumes_across_pp_without_a_key_map(gpt2_data, tmp_path):
    per_rank = run_distributed(_runs, 2, gpt2_data, str(tmp_path / "ckpt"), timeout=600)
    full = per_rank[-1]["pp2"]
    assert isinstance(full, list) and len(full) == STEPS, full
    for rank, runs in enumerate(per_rank):
        for name in ("pp1", "tp2"):
            losses = runs[name]
            assert isinstance(losses, list) and len(losses) == STEPS - AT, (rank, name, losses)
            assert relative_error(losses, full[AT:]) < 1e-5, (rank, name, losses, full[AT:])
        message = runs["ambiguous"]
        assert isinstance(message, str), (rank, message)
        assert "matched by structure" in message and "another order" in message, message
        assert "final_norm.weight" in message or "input_layernorm.weight" in message, message
        assert "megatron.model.spec_model.SpecModel" in message, message
        assert "saved by another model" not in message, message
