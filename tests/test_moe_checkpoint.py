"""Checkpoints of expert-parallel runs: each ep rank's folder, exact resumes, bad layouts.

The resumes at another ep (with a tp or pp change, from the distributed optimizer) are in
test_moe_training.py; here: the file layout, an exact resume at the saved layout (the
replicated and the distributed optimizer), and a missing ep folder refused on every rank.
"""
import os
import shutil

import pytest

from gpt2_runs import full_and_resumed, gpt2_argv, train_gpt2, user_error
from harness import run_distributed

STEPS = 4
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
       "--moe-ffn-hidden-size", "32"]


def _argv(data, ep, *extra):
    return gpt2_argv(data, "--expert-model-parallel-size", str(ep), "--batch-size", "2",
                     "--gas", "1", "--train-iters", str(STEPS), "--hidden-dropout", "0",
                     "--attention-dropout", "0", "--log-interval", "1", *MOE, *extra)


def _names(ckpt, iteration):
    folder = os.path.join(ckpt, f"iter_{iteration:07d}")
    return sorted(os.path.relpath(os.path.join(d, f), folder)
                  for d, _, files in os.walk(folder) for f in files)


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["replicated", "distributed"])
def test_ep2_resume_is_exact(gpt2_data, tmp_path, optimizer):
    """ep 2 over dp 2: each ep rank writes its own folder (the distributed optimizer: each
    data-parallel rank's file in its ep rank's); 2 steps, save, resume, 2 steps == 4 steps."""
    extra = ["--use-distributed-optimizer"] if optimizer == "distributed" else []
    ckpt = str(tmp_path / "ckpt")
    full, resumed = full_and_resumed(train_gpt2, 2, _argv(gpt2_data, 2, *extra), ckpt,
                                     STEPS // 2)
    expected = ["manifest.json", "mp_rank_00_000_000/model_optim_rng.pt",
                "mp_rank_00_000_001/model_optim_rng.pt"]
    if optimizer == "distributed":
        expected += ["mp_rank_00_000_000/optim_dp_rank_000.pt",
                     "mp_rank_00_000_001/optim_dp_rank_001.pt"]
    assert [n for n in _names(ckpt, STEPS // 2) if not n.startswith(".")] == sorted(expected)
    assert len(resumed[0]) == STEPS
    assert max(abs(a - b) for a, b in zip(full[0], resumed[0])) <= 1e-6, (full, resumed)


@pytest.mark.slow
def test_a_missing_ep_folder_fails_on_every_rank(gpt2_data, tmp_path):
    """An ep 2 checkpoint without ep rank 1's folder: every rank raises the same
    CheckpointError naming the missing folder, at the saved layout and at another ep."""
    ckpt = str(tmp_path / "ckpt")
    run_distributed(train_gpt2, 2, _argv(gpt2_data, 2, "--save", ckpt, "--save-interval",
                                         str(STEPS)), timeout=300)
    shutil.rmtree(os.path.join(ckpt, f"iter_{STEPS:07d}", "mp_rank_00_000_001"))
    for ep in (2, 1):
        errors = run_distributed(user_error, 2, _argv(gpt2_data, ep, "--load", ckpt,
                                                      "--no-verify-checkpoint"), timeout=300)
        assert all(e is not None and "mp_rank_00_000_001" in e for e in errors), errors
        assert len(set(errors)) == 1, errors
