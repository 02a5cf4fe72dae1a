"""Checkpoints of expert-parallel runs: each ep rank's folder, exact resumes, bad layouts.

The resumes at another ep (with a tp or pp change, from the distributed optimizer) are in
test_moe_training.py; here: the file layout and an exact resume at the saved ep (the
replicated and the distributed optimizer), at another dp, a missing ep folder refused on
every rank (at the saved ep and at another), and the conversion of an ep 2 checkpoint.
The default run keeps the refusal at another ep and the conversion; the training runs are
exhaustive (the default run's covering resume: test_resume_ep2_as_ep1_with_a_tp_change).
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


def _resume_at_ep2(data, tmp_path, optimizer):
    """ep 2 over dp 2, 2 steps, save, resume, 2 steps == 4 steps; each ep rank wrote its
    own folder (the distributed optimizer: each data-parallel rank's file in its ep
    rank's), every file in the manifest. Returns the checkpoint folder."""
    from megatron.checkpoint.verify import verify

    extra = ["--use-distributed-optimizer"] if optimizer == "distributed" else []
    ckpt = str(tmp_path / "ckpt")
    full, resumed = full_and_resumed(train_gpt2, 2, _argv(data, 2, *extra), ckpt, STEPS // 2)
    expected = ["manifest.json", "mp_rank_00_000_000/model_optim_rng.pt",
                "mp_rank_00_000_001/model_optim_rng.pt"]
    if optimizer == "distributed":
        expected += ["mp_rank_00_000_000/optim_dp_rank_000.pt",
                     "mp_rank_00_000_001/optim_dp_rank_001.pt"]
    assert [n for n in _names(ckpt, STEPS // 2) if not n.startswith(".")] == sorted(expected)
    (report,) = verify(ckpt, STEPS // 2)  # tools/verify_checkpoint.py: every file listed
    assert report.ok and report.files == len(expected) - 1, report.lines()
    assert len(resumed[0]) == STEPS
    assert max(abs(a - b) for a, b in zip(full[0], resumed[0])) <= 1e-6, (full, resumed)
    return ckpt


@pytest.mark.slow
@pytest.mark.exhaustive
def test_ep2_resume_is_exact_and_a_missing_ep_folder_fails_on_every_rank(gpt2_data, tmp_path):
    """The distributed optimizer's exact resume at ep 2; then, without ep rank 1's folder,
    every rank raises the same CheckpointError naming it (only rank 1 misses its file)."""
    ckpt = _resume_at_ep2(gpt2_data, tmp_path, "distributed")  # the tracker names step 2
    shutil.rmtree(os.path.join(ckpt, f"iter_{STEPS // 2:07d}", "mp_rank_00_000_001"))
    errors = run_distributed(user_error, 2, _argv(gpt2_data, 2, "--load", ckpt,
                                                  "--no-verify-checkpoint"), timeout=300)
    assert all(e is not None and "mp_rank_00_000_001" in e for e in errors), errors
    assert len(set(errors)) == 1, errors


@pytest.mark.slow
@pytest.mark.exhaustive
def test_ep2_resume_with_the_replicated_optimizer_is_exact(gpt2_data, tmp_path):
    _resume_at_ep2(gpt2_data, tmp_path, "replicated")


@pytest.mark.slow
def test_a_missing_ep_folder_fails_at_another_ep(gpt2_data, tmp_path):
    """An ep 2 checkpoint holding ep rank 0's folder only, resumed at ep 1 (the layout
    change, which reads every folder): every rank raises the same CheckpointError naming
    the missing folder, before any weight is loaded."""
    import torch

    from megatron.checkpoint import checkpoint_name, write_tracker

    ckpt = str(tmp_path / "ckpt")
    path = checkpoint_name(ckpt, STEPS, 0, 0, 0)
    os.makedirs(os.path.dirname(path))
    torch.save({"iteration": STEPS, "model": {}, "sharding": {},
                "args": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1,
                         "expert_model_parallel_size": 2}}, path)
    write_tracker(ckpt, STEPS)
    errors = run_distributed(user_error, 2, _argv(gpt2_data, 1, "--load", ckpt,
                                                  "--no-verify-checkpoint"), timeout=300)
    assert all(e is not None and "mp_rank_00_000_001, which are missing" in e
               for e in errors), errors
    assert len(set(errors)) == 1, errors


def _save_toy_ep2(root, seed):
    """A tp 1 x ep 2 checkpoint of a toy model (family "toy", recorded sharding), written as
    training writes one: each ep rank's folder holds 2 of the 4 experts and the dense
    tensors' copy. Returns the whole tensors."""
    import torch

    from megatron.checkpoint import checkpoint_name, write_tracker

    gen = torch.Generator().manual_seed(seed)
    whole = {"experts.weight1": torch.randn(4, 6, 3, generator=gen),
             "dense.weight": torch.randn(3, 5, generator=gen)}
    record = {"experts.weight1": [1, 1, 0, 0, 0, 4], "dense.weight": [-1, 1, 0, 0, 0, 0]}
    args = {"num_layers": 1, "hidden_size": 6, "num_attention_heads": 2,
            "padded_vocab_size": 12, "true_vocab_size": 12, "make_vocab_size_divisible_by": 2,
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 2}
    for ep_rank in range(2):
        path = checkpoint_name(root, 3, 0, 0, ep_rank)
        os.makedirs(os.path.dirname(path))
        model = {"experts.weight1": whole["experts.weight1"][2 * ep_rank:2 * ep_rank + 2].clone(),
                 "dense.weight": whole["dense.weight"].clone()}
        torch.save({"iteration": 3, "args": args, "family": "toy", "sharding": record,
                    "model": model, "consumed_train_samples": 24}, path)
    write_tracker(root, 3)
    return whole


def test_an_ep2_checkpoint_converts_to_ep1_with_every_expert(seed, tmp_path):
    """tools/convert_checkpoint.py reads an ep 2 checkpoint (the experts of both ep folders,
    in ep order) and writes a native ep 1 one at tp 2 (the experts' dim 1 split)."""
    import torch

    from megatron.checkpoint import checkpoint_name
    from test_conversion_recorded import _convert

    src, out = str(tmp_path / "src"), str(tmp_path / "out")
    whole = _save_toy_ep2(src, seed)
    _convert("--input", src, "--output", out, "--target-tensor-parallel-size", 2)
    for t in range(2):
        state = torch.load(checkpoint_name(out, 3, t, 0), weights_only=True)
        assert state["args"]["expert_model_parallel_size"] == 1
        assert torch.equal(state["model"]["experts.weight1"],
                           whole["experts.weight1"][:, 3 * t:3 * t + 3])
        assert torch.equal(state["model"]["dense.weight"], whole["dense.weight"])
    assert not os.path.exists(os.path.join(out, "iter_0000003", "mp_rank_00_000_001"))


@pytest.mark.slow
@pytest.mark.exhaustive
def test_ep2_distributed_optimizer_resumes_at_another_dp(gpt2_data, tmp_path):
    """The same ep and global batch at another dp (2 -> 4: the expert-data-parallel group
    doubles): the distributed optimizer's slices re-cut by name from every ep folder; the
    losses continue the uninterrupted run."""
    ckpt = str(tmp_path / "ckpt")

    def argv(dp, *more):
        flags = _argv(gpt2_data, 2, "--use-distributed-optimizer", *more)
        flags[flags.index("--gas") + 1] = str(4 // dp)  # global batch 8 at both dp
        return flags

    full = run_distributed(train_gpt2, 2, argv(2, "--save", ckpt, "--save-interval", "2"),
                           timeout=300)[0][0]
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write("2")
    later = run_distributed(train_gpt2, 4, argv(4, "--load", ckpt), timeout=300)[0][0]
    resumed = full[:2] + later
    assert len(resumed) == STEPS
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed, full)) < 1e-5, (full, later)
