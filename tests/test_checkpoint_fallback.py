"""A damaged checkpoint at resume, in real 2-rank GPT-2 runs through pretrain_gpt2.

An uninterrupted run (6 steps, checkpoints at 3 and 6) is damaged afterwards in a tensor's
bytes of its newest checkpoint (a low mantissa bit in 1024 values, or one byte: damage
``torch.load`` does not notice, tests/checkpoint_damage.py), in a main file or a ZeRO-1 shard,
at tp 2 or pp 2, in a file only one of the two ranks reads (rank 1, or rank 0). The resume
with ``--load`` = ``--save`` must name the file with both digests, fall back to iteration 3 on both ranks,
keep the damaged folder aside, and train steps 4-6 with exactly the uninterrupted run's
losses; a resume from another folder, or at another layout, must stop on every rank with
the file named; ``--no-verify-checkpoint`` loads the damaged one as it is.
"""
import contextlib
import io
import os
import shutil

import pytest
import torch
import xxhash

from checkpoint_damage import DAMAGE, assert_silent
from gpt2_runs import gpt2_argv, user_error
from harness import run_distributed
from megatron.checkpoint import format as fmt
from megatron.checkpoint.manifest import read_manifest
from megatron.checkpoint.verify import verify

LAYOUTS = {"tp2": ("--model-parallel-size", "2"),
           "pp2": ("--pipe-parallel-size", "2", "--zero-stage", "1"),
           "tp1": ()}
#: The file damaged, inside iter_0000006, and the one rank (of two) that reads it.
TARGETS = {("tp2", "main"): ("mp_rank_01_000/model_optim_rng.pt", 1),
           ("pp2", "main"): ("mp_rank_00_001/model_optim_rng.pt", 1),
           ("pp2", "shard"): ("mp_rank_00_000/optim_dp_rank_000.pt", 0)}
#: How much one damaged value may change (relative): one ulp, or a bit in its second byte.
CHANGE = {"mantissa": 2.0 ** -22, "byte": 2.0 ** -10}


def _argv(data, layout, *extra):
    return gpt2_argv(data, "--batch-size", "2", "--train-iters", "6", "--log-interval", "1",
                     "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-iters",
                     "0", "--save-interval", "3", *LAYOUTS[layout], *extra)


def train_logged(argv):
    """Rank body: pretrain_gpt2.main(argv); returns (per-step losses, this rank's output)."""
    import pretrain_gpt2

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        state = pretrain_gpt2.main(argv)
    return state.losses, out.getvalue()


@pytest.fixture(scope="module")
def uninterrupted(gpt2_data, tmp_path_factory):
    """``layout -> (checkpoint folder, per-step losses)`` of the uninterrupted run."""
    runs = {}

    def get(layout):
        if layout not in runs:
            ckpt = str(tmp_path_factory.mktemp(layout) / "ckpt")
            results = run_distributed(train_logged, 2, _argv(gpt2_data, layout, "--save", ckpt),
                                      timeout=300)
            runs[layout] = ckpt, results[-1][0]  # the last stage's losses
        return runs[layout]
    return get


def _damaged_copy(uninterrupted, tmp_path, layout, kind, damage):
    """A copy of the run's checkpoints with the newest one damaged: ``(root, damaged file,
    its manifest digest, its digest now)``."""
    ckpt, _ = uninterrupted(layout)
    root = str(tmp_path / "ckpt")
    shutil.copytree(ckpt, root)
    folder = fmt.iteration_dir(root, 6)
    name = TARGETS[(layout, kind)][0]
    path = os.path.join(folder, name)
    before = torch.load(path, weights_only=False)  # the test's own file (DeepSpeed records)
    DAMAGE[damage](path)
    assert_silent(before, torch.load(path, weights_only=False), CHANGE[damage])
    with open(path, "rb") as handle:
        found = xxhash.xxh3_128(handle.read()).hexdigest()
    expected = read_manifest(folder).files[name].digest
    assert found != expected
    return root, path, expected, found


@pytest.mark.slow
@pytest.mark.parametrize("layout, kind, damage", [
    ("tp2", "main", "mantissa"), ("pp2", "shard", "byte"),
    pytest.param("tp2", "main", "byte", marks=pytest.mark.exhaustive),
    pytest.param("pp2", "main", "mantissa", marks=pytest.mark.exhaustive),
    pytest.param("pp2", "main", "byte", marks=pytest.mark.exhaustive),
    pytest.param("pp2", "shard", "mantissa", marks=pytest.mark.exhaustive)])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(
        gpt2_data, tmp_path, uninterrupted, layout, kind, damage):
    root, path, expected, found = _damaged_copy(uninterrupted, tmp_path, layout, kind, damage)
    assert [r.ok for r in verify(root)] == [False] and verify(root, 3)[0].ok
    results = run_distributed(train_logged, 2, _argv(gpt2_data, layout, "--load", root,
                                                     "--save", root), timeout=300)
    log = results[0][1]
    assert f"{path} is damaged: xxh3_128 digest {found} found, {expected} expected" in log, log
    reader = TARGETS[(layout, kind)][1]
    assert f"failed on rank {reader}: checkpoint file {path}" in log, log
    assert "falling back to iteration 3" in log, log
    assert f"moved aside (kept, not deleted): {fmt.iteration_dir(root, 6)}.damaged" in log, log
    for losses, _ in results[-1:]:  # the last stage's: steps 4-6 from iteration 3
        assert losses == uninterrupted(layout)[1][3:], (losses, uninterrupted(layout)[1])
    aside = path.replace("iter_0000006", "iter_0000006.damaged")
    with open(aside, "rb") as handle:
        assert xxhash.xxh3_128(handle.read()).hexdigest() == found  # kept as it was
    assert fmt.read_tracker(root) == 6  # the resumed run saved iteration 6 anew
    assert all(report.ok for report in verify(root, every=True))


@pytest.mark.slow
def test_a_damaged_checkpoint_of_another_folder_stops_every_rank(gpt2_data, tmp_path,
                                                                 uninterrupted):
    root, path, expected, found = _damaged_copy(uninterrupted, tmp_path, "tp2", "main",
                                                "mantissa")
    listing = sorted(os.walk(root))
    messages = run_distributed(user_error, 2, _argv(gpt2_data, "tp2", "--load", root),
                               timeout=300)
    for message in messages:  # the same decision on both ranks: rank 0's file was intact
        assert message and "verifying the checkpoint of iteration 6" in message, messages
        assert f"failed on rank 1: checkpoint file {path} is damaged: xxh3_128 digest " \
               f"{found} found, {expected} expected" in message, message
        assert "--no-verify-checkpoint" in message, message
    assert sorted(os.walk(root)) == listing and fmt.read_tracker(root) == 6  # untouched
    results = run_distributed(train_logged, 2, _argv(gpt2_data, "tp2", "--load", root,
                                                     "--no-verify-checkpoint"), timeout=300)
    assert "--no-verify-checkpoint: the files of" in results[0][1], results[0][1]
    assert "at iteration 6" in results[0][1]  # loaded as it is (nothing left to train)


@pytest.mark.slow
@pytest.mark.parametrize("layout, kind, resume", [
    ("tp2", "main", ()),
    pytest.param("pp2", "shard", ("--deepspeed", "--zero-stage", "1"),
                 marks=pytest.mark.exhaustive)])
def test_a_resume_at_another_layout_verifies_every_file_it_reads(
        gpt2_data, tmp_path, uninterrupted, layout, kind, resume):
    """One rank at tp 1, pp 1 reads every file of the tp 2 (or pp 2) checkpoint, also the
    one the saving run's second rank wrote."""
    root, path, expected, found = _damaged_copy(uninterrupted, tmp_path, layout, kind,
                                                "byte")
    message = run_distributed(user_error, 1, _argv(gpt2_data, "tp1", "--load", root,
                                                   *resume), timeout=300)[0]
    assert message and f"failed on rank 0: checkpoint file {path} is damaged: xxh3_128 " \
                       f"digest {found} found, {expected} expected" in message, message


def test_the_agreed_decision_and_the_move_aside(tmp_path, seed):
    """checkpoint_integrity in one process: the fallback goes to the newest older published
    checkpoint, a second damaged one with none older stops naming both and moves nothing,
    another --load stops at once, and moving aside never overwrites an earlier damaged
    folder."""
    from types import SimpleNamespace

    from gpt2_ckpt import random_checkpoint
    from megatron.checkpoint.native_writer import reshard, write_native
    from megatron.common.errors import CheckpointDigestError
    from megatron.resilience.checkpoint_integrity import damaged_or_none, set_aside_damaged

    root = str(tmp_path / "ckpt")
    for iteration in (3, 6):
        ckpt = reshard(random_checkpoint(seed % 1000 + iteration), tp=1, pp=1)
        ckpt.iteration = iteration
        write_native(ckpt, root)
    resumed = SimpleNamespace(checkpoint=SimpleNamespace(load=root, save=root + "/"))
    listing = sorted(os.walk(root))
    damaged = []
    assert damaged_or_none(resumed, 6, None, damaged) is None and damaged == []
    bad6, bad3 = (CheckpointDigestError(f"checkpoint file F{it} is damaged") for it in (6, 3))
    assert damaged_or_none(resumed, 6, bad6, damaged) == 3
    with pytest.raises(CheckpointDigestError) as info:
        damaged_or_none(resumed, 3, bad3, damaged)
    assert "iteration 6" in str(info.value) and "F6 is damaged" in str(info.value)
    assert "iteration 3" in str(info.value) and "F3 is damaged" in str(info.value)
    assert "no older checkpoint" in str(info.value) and "nothing was moved" in str(info.value)
    assert sorted(os.walk(root)) == listing
    elsewhere = SimpleNamespace(checkpoint=SimpleNamespace(load=root, save=None))
    with pytest.raises(CheckpointDigestError, match="F6 is damaged; point --load at an intact"):
        damaged_or_none(elsewhere, 6, bad6, [])
    for suffix in (".damaged", ".damaged-2"):
        set_aside_damaged(resumed, [(6, [(0, "F6 is damaged")])], 3)
        assert os.path.isdir(fmt.iteration_dir(root, 6) + suffix)
        assert not os.path.exists(fmt.iteration_dir(root, 6)) and fmt.read_tracker(root) == 3
        ckpt = reshard(random_checkpoint(seed % 1000), tp=1, pp=1)
        ckpt.iteration = 6
        write_native(ckpt, root)  # saved anew, and damaged again
