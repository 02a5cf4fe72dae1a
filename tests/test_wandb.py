"""--wandb-project: the W&B run (offline) holds the same scalars as TensorBoard, read back
from the run's .wandb file; W&B flags without a project fail before training."""
import glob
import sys

import pytest

from gpt2_runs import gpt2_argv, user_error
from harness import run_distributed
from megatron.common.errors import ConfigError
from wandb_records import read_config, read_history


def _train(argv):
    import pretrain_gpt2

    state = pretrain_gpt2.main(argv)
    return state.losses, state.eval_losses


def _tensorboard_scalars(path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(path))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


@pytest.mark.slow
def test_wandb_offline_run_has_the_tensorboard_scalars(gpt2_data, tmp_path):
    pytest.importorskip("wandb", reason="pip install -e '.[test]' installs wandb")
    argv = gpt2_argv(gpt2_data, "--batch-size", "2", "--train-iters", "4", "--log-interval", "2",
                     "--eval-interval", "2", "--tensorboard-dir", str(tmp_path / "tb"),
                     "--wandb-project", "tds-test", "--wandb-exp-name", "tiny-gpt2",
                     "--wandb-save-dir", str(tmp_path / "wb"))
    # the ranks' environment (set there: the harness's fork server may predate this test)
    (losses, evals), = run_distributed(_train, 1, argv,
                                       env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
    (run_dir,) = glob.glob(str(tmp_path / "wb" / "wandb" / "offline-run-*"))
    history = read_history(run_dir)
    tb = _tensorboard_scalars(tmp_path / "tb")
    assert sorted(history) == sorted(tb)
    assert {"train/lm-loss", "train/tokens-per-second", "validation/lm-loss"} <= set(tb)
    for tag, points in tb.items():
        # TensorBoard stores float32; W&B keeps the Python float.
        assert [s for s, _ in history[tag]] == [s for s, _ in points], tag
        assert [v for _, v in history[tag]] == pytest.approx([v for _, v in points], rel=1e-6)
    # independent of TensorBoard: the logged loss is the mean of the interval's step losses
    assert [v for _, v in history["train/lm-loss"]] == \
        pytest.approx([sum(losses[:2]) / 2, sum(losses[2:]) / 2], rel=1e-12)
    assert [v for _, v in history["validation/lm-loss"]] == \
        pytest.approx([loss for _, loss in evals], rel=1e-12)
    config = read_config(run_dir)
    assert config["train_iters"] == 4 and config["wandb_exp_name"] == "tiny-gpt2"


def test_wandb_flags_without_project_fail_before_training(gpt2_data):
    import pretrain_gpt2

    with pytest.raises(ConfigError, match="need --wandb-project"):
        pretrain_gpt2.main(gpt2_argv(gpt2_data, "--batch-size", "2", "--train-iters", "1",
                                     "--wandb-exp-name", "x"))


def test_wandb_project_without_wandb_installed_says_how_to_install(gpt2_data, monkeypatch):
    import pretrain_gpt2

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'megatron-tds\[wandb\]'"):
        pretrain_gpt2.main(gpt2_argv(gpt2_data, "--batch-size", "2", "--train-iters", "1",
                                     "--wandb-project", "p"))


@pytest.mark.slow
def test_wandb_failing_on_the_logging_rank_stops_every_rank(gpt2_data, tmp_path):
    pytest.importorskip("wandb", reason="pip install -e '.[test]' installs wandb")
    # online mode without an API key: wandb.init fails on the last rank only
    argv = gpt2_argv(gpt2_data, "--batch-size", "2", "--train-iters", "1",
                     "--wandb-project", "p", "--wandb-save-dir", str(tmp_path))
    env = {"WANDB_MODE": "online", "WANDB_API_KEY": "", "WANDB_SILENT": "true",
           "NETRC": str(tmp_path / "no_netrc"), "WANDB_CONFIG_DIR": str(tmp_path / "cfg")}
    messages = run_distributed(user_error, 2, argv, env=env, timeout=120)
    assert all(m and "W&B did not start on the logging rank" in m for m in messages), messages
    assert "wandb login" in messages[0]
