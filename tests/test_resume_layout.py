"""Resume at another (tp, pp, dp) layout with the full optimizer state (issue 14).

10 steps at (tp, pp, dp) = (2, 2, 2), save, resume at other layouts with the same global
batch (through --gas): the next 10 losses must be those of the uninterrupted 20-step run.
The layouts cross both backends (tds's pipeline engine at pp > 1, DDP at pp = 1) and a
tensor-parallel size (4) whose padded vocabulary differs from the saved one.
"""
import os

import pytest
import torch

from gpt2_runs import layout_argv, relative_error as _relative, train_gpt2, user_error
from harness import run_distributed
from precision import requires_ds_fp16

STEPS, AT, MICRO, GLOBAL = 20, 10, 2, 8


def _argv(data, tp, pp, dp, *extra):
    return layout_argv(data, tp, pp, dp, "--eval-interval", "1000", *extra, steps=STEPS,
                       micro=MICRO, global_batch=GLOBAL)


def _point_tracker_at(ckpt, iteration):
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write(str(iteration))


def _listing(root):
    return sorted((d, sorted(f)) for d, _, f in os.walk(root))


@pytest.mark.slow
def test_resume_at_other_layouts_continues_the_uninterrupted_run(gpt2_data, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full = run_distributed(train_gpt2, 8, _argv(gpt2_data, 2, 2, 2, "--save", ckpt,
                                                "--save-interval", str(AT)),
                           timeout=500)[0][0]
    assert len(full) == STEPS
    _point_tracker_at(ckpt, AT)
    before = _listing(ckpt)
    for tp, pp, dp in [(1, 1, 1), (4, 1, 2), (1, 2, 4)]:
        per_rank = run_distributed(train_gpt2, tp * pp * dp,
                                   _argv(gpt2_data, tp, pp, dp, "--load", ckpt), timeout=500)
        for rank, (losses, _) in enumerate(per_rank):
            assert len(losses) == STEPS - AT, ((tp, pp, dp), rank, losses)
            err = _relative(losses, full[AT:])
            assert err < 1e-5, ((tp, pp, dp), rank, err, losses, full[AT:])
    assert _listing(ckpt) == before  # loading wrote nothing


@pytest.mark.slow
@pytest.mark.precision
@requires_ds_fp16
def test_fp16_zero1_engine_resumes_at_another_data_parallel_size(gpt2_data, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    extra = ("--deepspeed", "--fp16", "--zero-stage", "1", "--train-iters", "10")
    full = run_distributed(train_gpt2, 2, _argv(gpt2_data, 1, 1, 2, *extra, "--save", ckpt,
                                                "--save-interval", "5"), timeout=400)[0][0]
    _point_tracker_at(ckpt, 5)
    for dp in (1, 4):  # shrink and grow: DeepSpeed re-partitions master weights and moments
        per_rank = run_distributed(train_gpt2, dp, _argv(gpt2_data, 1, 1, dp, *extra,
                                                         "--load", ckpt), timeout=400)
        for rank, (losses, _) in enumerate(per_rank):
            assert len(losses) == 5, (dp, rank, losses)
            assert _relative(losses, full[5:]) < 1e-5, (dp, rank, losses, full[5:])


@pytest.mark.slow
def test_a_layout_that_cannot_hold_the_model_is_refused_before_anything_is_written(
        gpt2_data, tmp_path):
    ckpt = str(tmp_path / "ckpt")

    def argv(tp, pp):
        return _argv(gpt2_data, tp, pp, 1, "--num-layers", "2", "--train-iters", "4",
                     "--save", ckpt, "--save-interval", "2", "--load", ckpt)

    run_distributed(train_gpt2, 1, argv(1, 1)[:-2] + ["--train-iters", "2"])
    before = _listing(ckpt)
    heads = run_distributed(user_error, 3, argv(3, 1))  # 4 heads over 3 ranks
    assert all(m and "tensor-model-parallel size (3)" in m for m in heads), heads
    stages = run_distributed(user_error, 3, argv(1, 3))  # 3 stages for 2 layers
    assert all(m and "--pipe-parallel-size (3) is larger than --num-layers (2)" in m
               for m in stages), stages
    assert _listing(ckpt) == before


def test_named_adam_state_round_trips_into_a_reordered_optimizer():
    """Moments keyed by name land on the same parameters in an optimizer whose groups list
    them in another order (as another layout's stage would)."""
    from megatron.checkpoint.optimizer_names import (adam_state_dict,
                                                                  named_adam_state,
                                                                  param_names)

    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7),
                                torch.nn.Linear(7, 3))
    params = dict(model.named_parameters())
    decay = [params["0.weight"], params["2.weight"]]
    rest = [p for n, p in params.items() if n not in ("0.weight", "2.weight")]
    adam = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}],
                             lr=1e-2, betas=(0.8, 0.9))
    for _ in range(3):
        adam.zero_grad()
        model(torch.randn(4, 5)).square().mean().backward()
        adam.step()
    named, groups = named_adam_state(adam.state_dict(), param_names(model, adam))
    target = torch.optim.AdamW([{"params": decay[::-1]}, {"params": rest[::-1],
                                                          "weight_decay": 0.0}], lr=5.0)
    names = param_names(model, target)
    target.load_state_dict(adam_state_dict(named, groups, names,
                                           target.state_dict()["param_groups"]))
    for name, param in params.items():
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(target.state[param][moment], adam.state[param][moment]), name
    assert target.param_groups[0]["lr"] == 1e-2 and target.param_groups[0]["betas"] == (0.8, 0.9)


@pytest.mark.slow
def test_zero1_state_moves_to_another_tensor_and_pipeline_size(gpt2_data, tmp_path):
    """The distributed optimizer's slices (each data-parallel rank's, named by parameter and
    offset) reassembled by parameter name: a pipeline ZeRO-1 run at (1, 2, 2) resumes as a
    ZeRO-1 DeepSpeed run at (2, 1, 1) and as a replicated run at (1, 1, 1)."""
    ckpt = str(tmp_path / "ckpt")
    steps = ("--train-iters", "10")
    full = run_distributed(train_gpt2, 4, _argv(gpt2_data, 1, 2, 2, *steps, "--zero-stage",
                                                "1", "--save", ckpt, "--save-interval", "5"),
                           timeout=400)[0][0]
    _point_tracker_at(ckpt, 5)
    shard = torch.load(os.path.join(ckpt, "iter_0000005", "mp_rank_00_001",
                                    "optim_dp_rank_001.pt"), weights_only=False)
    assert shard["distributed_optimizer"] and len(shard["pieces"]) == \
        len(shard["optimizer"]["state"])
    for tp, more in [(2, ("--deepspeed", "--zero-stage", "1")), (1, ())]:
        per_rank = run_distributed(train_gpt2, tp, _argv(gpt2_data, tp, 1, 1, *steps, *more,
                                                         "--load", ckpt), timeout=400)
        for rank, (losses, _) in enumerate(per_rank):
            assert len(losses) == 5, (tp, rank, losses)
            assert _relative(losses, full[5:]) < 1e-5, (tp, more, rank, losses, full[5:])


def test_optimizer_state_that_cannot_move_is_refused_with_the_way_out(tmp_path):
    """DeepSpeed's fp16/bf16 optimizer without ZeRO, and checkpoints that do not name their
    parameters, are refused with a message naming --no-load-optim."""
    from megatron.common.errors import CheckpointError
    from megatron.checkpoint.format import optimizer_shard_name
    from megatron.checkpoint.layout_change import named_optimizer_state

    root = str(tmp_path)
    path = optimizer_shard_name(root, 7, 0, 0, 0)
    os.makedirs(os.path.dirname(path))
    torch.save({"optimizer_state_dict": {}, "fp32_groups_flat": [torch.zeros(3)]}, path)
    with pytest.raises(CheckpointError, match="fp16/bf16 optimizer without ZeRO.*--no-load-optim"):
        named_optimizer_state({"model": {}, "optimizer_param_names": ["w"]}, root, 7, 0, 0)
    adam = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))]).state_dict()
    with pytest.raises(CheckpointError, match="parameter names.*--no-load-optim"):
        named_optimizer_state({"model": {}, "optimizer": {"optimizer": adam}}, root, 7, 0, 0)


@pytest.mark.slow
def test_t5_resumes_at_another_tensor_and_pipeline_size(t5_data, tmp_path):
    """T5 v1.1 (untied head, gated-GeLU, relative-bias tables copied to every stage of
    their stack): saved at (1, 4, 1), resumed at (2, 1, 1) and (2, 2, 1)."""
    from t5_runs import t5_argv, train_t5

    def argv(tp, pp, *extra):
        return t5_argv(t5_data, "--model-parallel-size", str(tp), "--pipe-parallel-size",
                       str(pp), "--batch-size", "2", "--gas", "4", "--train-iters", "10",
                       "--t5-ff", "gated-gelu", "--untie-embeddings", "--hidden-dropout",
                       "0", "--attention-dropout", "0", *extra)

    ckpt = str(tmp_path / "ckpt")
    full = run_distributed(train_t5, 4, argv(1, 4, "--save", ckpt, "--save-interval", "5"),
                           timeout=400)[0][0]
    _point_tracker_at(ckpt, 5)
    for tp, pp in [(2, 1), (2, 2)]:
        for rank, (losses, _) in enumerate(run_distributed(
                train_t5, tp * pp, argv(tp, pp, "--load", ckpt), timeout=400)):
            assert _relative(losses, full[5:]) < 1e-5, ((tp, pp), rank, losses, full[5:])
