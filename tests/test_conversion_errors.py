"""tools/convert_checkpoint.py on bad input: one line, exit 2, nothing written."""
import importlib.util
import json
import os
import shutil

import pytest
import torch

from gpt2_ckpt import random_checkpoint
from gpt2_runs import REPO, run_script
from megatron.checkpoint_conversion import reshard, write_native
from megatron.checkpoint import checkpoint_name

TOOL = os.path.join(REPO, "tools", "convert_checkpoint.py")


def _tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fails(capsys, *argv):
    """Run the tool in-process; assert exit 2 with one ``error:`` line; return it."""
    with pytest.raises(SystemExit) as info:
        _tool().main(list(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err, err
    return err


@pytest.fixture
def native(tmp_path, seed):
    """A tp=2 native checkpoint of a random 2-layer model (iteration 0)."""
    ckpt = reshard(random_checkpoint(seed), 2, 1)
    write_native(ckpt, str(tmp_path / "tp2"), 2, 1)
    return str(tmp_path / "tp2")


def test_missing_input(capsys, tmp_path):
    err = _fails(capsys, "--input", str(tmp_path / "nope"), "--output", str(tmp_path / "o"))
    assert "does not exist" in err
    assert not os.path.exists(tmp_path / "o")


def test_incomplete_checkpoint(capsys, native, tmp_path):
    shutil.rmtree(os.path.dirname(checkpoint_name(native, 0, 1, 0)))
    err = _fails(capsys, "--input", native, "--output", str(tmp_path / "o"),
                 "--target-tensor-parallel-size", "1")
    assert "incomplete" in err and "mp_rank_01_000" in err
    assert not os.path.exists(tmp_path / "o" / "iter_0000000")


def _without_manifest(native):
    """As a checkpoint saved before checkpoints carried digests: the checks behind them."""
    os.remove(os.path.join(native, "iter_0000000", "manifest.json"))


def test_unreadable_rank_file(capsys, native, tmp_path):
    path = checkpoint_name(native, 0, 1, 0)
    with open(path, "wb") as handle:
        handle.write(b"not a checkpoint")
    err = _fails(capsys, "--input", native, "--output", str(tmp_path / "o"))
    assert f"{path} is damaged" in err and "; 16 bytes, " in err, err
    _without_manifest(native)
    assert "cannot read" in _fails(capsys, "--input", native, "--output", str(tmp_path / "o"))


def test_files_from_different_runs(capsys, native, tmp_path):
    path = checkpoint_name(native, 0, 1, 0)
    state = torch.load(path, weights_only=True)
    state["model"]["transformer.final_layernorm.weight"] += 1.0  # replicated: must agree
    torch.save(state, path)
    assert f"{path} is damaged" in _fails(capsys, "--input", native, "--output",
                                          str(tmp_path / "o"))
    _without_manifest(native)
    assert "differs" in _fails(capsys, "--input", native, "--output", str(tmp_path / "o"))


def test_heads_not_divisible_by_target_tp(capsys, native, tmp_path):
    err = _fails(capsys, "--input", native, "--output", str(tmp_path / "o"),
                 "--target-tensor-parallel-size", "3")
    assert "attention heads (4) is not divisible by --target-tensor-parallel-size 3" in err
    assert not os.path.exists(tmp_path / "o" / "iter_0000000")


def test_too_many_stages(capsys, native, tmp_path):
    err = _fails(capsys, "--input", native, "--output", str(tmp_path / "o"),
                 "--target-pipeline-parallel-size", "3")
    assert "larger than the number of layers" in err


def test_existing_output_is_left_alone(capsys, native, tmp_path):
    out = str(tmp_path / "o")
    _tool().main(["--input", native, "--output", out, "--target-tensor-parallel-size", "1"])
    before = open(checkpoint_name(out, 0, 0, 0), "rb").read()
    capsys.readouterr()
    assert "already exists" in _fails(capsys, "--input", native, "--output", out)
    assert open(checkpoint_name(out, 0, 0, 0), "rb").read() == before


def test_unknown_true_vocab_when_padding_changes(capsys, tmp_path, seed):
    ckpt = reshard(random_checkpoint(seed), 1, 1)  # 200 -> 256 rows
    ckpt.args.pop("true_vocab_size")
    write_native(ckpt, str(tmp_path / "tp1"), 1, 1)
    err = _fails(capsys, "--input", str(tmp_path / "tp1"), "--output", str(tmp_path / "o"),
                 "--target-tensor-parallel-size", "4")  # padding depends on the real size
    assert "--true-vocab-size" in err
    _tool().main(["--input", str(tmp_path / "tp1"), "--output", str(tmp_path / "o"),
                  "--target-tensor-parallel-size", "4", "--true-vocab-size", "200"])


def test_hf_variant_that_gpt2_model_does_not_compute(capsys, tmp_path):
    os.makedirs(tmp_path / "hf")
    config = {"model_type": "gpt2", "activation_function": "relu", "n_embd": 8, "n_head": 2,
              "n_layer": 1, "n_positions": 4, "vocab_size": 10}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    err = _fails(capsys, "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "o"))
    assert "activation_function 'relu'" in err


def test_cli_exit_code(native, tmp_path):
    """The script itself (not just main) exits 2 with the one-line message."""
    bad = run_script([TOOL, "--input", native, "--output", str(tmp_path / "o2"),
                      "--target-tensor-parallel-size", "3"])
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: "), bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
