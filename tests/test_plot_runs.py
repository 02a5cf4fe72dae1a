"""tools/plot_runs.py on a real tiny run: the series read from TensorBoard events and from
the printed log equal what training logged, and the PNG is a real image of the set size."""
import struct
import subprocess
import sys

import pytest

from gpt2_runs import REPO, gpt2_argv
from harness import run_distributed
from megatron.observability.run_plots import read_run
from test_training_log import _train_logged


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24]), len(data)


@pytest.fixture(scope="module")
def tiny_run(gpt2_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("plot_run")
    # a tiny peak so that CPU MFU is tens of percent, not 0.0% once printed
    argv = gpt2_argv(gpt2_data, "--batch-size", "2", "--train-iters", "6", "--log-interval", "2",
                     "--eval-interval", "3", "--peak-tflops", "0.01",
                     "--tensorboard-dir", str(root / "tb"))
    (losses, evals, out), = run_distributed(_train_logged, 1, argv)
    (root / "train.log").write_text(out)
    return root, losses, evals


@pytest.mark.slow
def test_series_equal_the_logged_values(tiny_run):
    root, losses, evals = tiny_run
    tb, log = read_run(str(root / "tb")), read_run(str(root / "train.log"))
    means = [sum(losses[i:i + 2]) / 2 for i in (0, 2, 4)]
    for series, rel in ((tb, 1e-6), (log, 1e-6)):  # float32 events; 7 digits printed
        assert [s for s, _ in series["loss"]] == [2, 4, 6]
        assert [v for _, v in series["loss"]] == pytest.approx(means, rel=rel)
        assert series["validation loss"] == [(i, pytest.approx(v, rel=rel)) for i, v in evals]
        assert [s for s, _ in series["tokens/s"]] == [s for s, _ in series["MFU"]] == [2, 4, 6]
    # the log prints tokens/s as an integer and MFU in percent with one decimal
    assert [v for _, v in log["tokens/s"]] == \
        pytest.approx([v for _, v in tb["tokens/s"]], abs=0.51)
    assert [v for _, v in log["MFU"]] == pytest.approx([v for _, v in tb["MFU"]], abs=5.1e-4)
    assert all(v > 0.0 for _, v in tb["MFU"])


@pytest.mark.slow
def test_plot_command_writes_a_png(tiny_run, tmp_path):
    root, _, _ = tiny_run
    out = tmp_path / "runs.png"
    done = subprocess.run([sys.executable, "tools/plot_runs.py", str(root / "tb"),
                           str(root / "train.log"), "--labels", "events", "log", "-o", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "events: loss 3, validation loss 2, tokens/s 3, MFU 3 points" in done.stdout
    (width, height), size = _png_size(out)
    assert (width, height) == (1200, 800) and size > 20_000  # 12 x 8 in at 100 dpi, drawn


def test_missing_run_is_a_clear_error(tmp_path):
    done = subprocess.run([sys.executable, "tools/plot_runs.py", str(tmp_path / "nope"),
                           "-o", str(tmp_path / "x.png")], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "does not exist" in done.stderr
    assert not (tmp_path / "x.png").exists()
