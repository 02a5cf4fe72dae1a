"""Faults one rank alone meets before training (issue 33): a data or vocabulary file, a
tracker, a checkpoint file or the dataset index that one rank cannot read. Every rank ends
with the same error naming the rank and the cause, non-zero and quickly, instead of one rank
raising alone while the others wait in their next collective (``init_process_group``, a
broadcast) until its timeout.

The end-to-end cases run the entry script under torchrun (2 ranks) with the fault injected
in one rank; the others call the library on 2 harness ranks.
"""
import errno
import os
import re
import time

import pytest

from gpt2_runs import REPO, gpt2_argv, run_script, train_gpt2, user_error
from harness import run_distributed
from test_faults import NO_NATIVE, TRACKER
from test_rank_faults import LEFT_NONE, _GROUPS_AT_EXIT, _assert_user_error_on_both_ranks

#: Seconds within which both ranks of a failed start-up must have exited (the run itself
#: takes 5-15 s on the shared 2-core machine; a rank left waiting would take the dist
#: timeout, 30 minutes).
WITHIN_S = 30


def _tiny(data, *extra):
    return gpt2_argv(data, "--batch-size", "2", "--train-iters", "2", "--eval-iters", "0",
                     *extra)


def _run_entry(tmp_path, body, argv, env=None):
    script = tmp_path / "entry.py"
    script.write_text(_GROUPS_AT_EXIT + body + r'''
import sys
import pretrain_gpt2
from megatron.common.errors import run_main
run_main(pretrain_gpt2.main, sys.argv[1:])
''')
    start = time.monotonic()
    result = run_script([str(script), *argv], nproc=2,
                        env=dict(NO_NATIVE, PYTHONPATH=REPO, **(env or {})))
    result.seconds = time.monotonic() - start
    return result


def _assert_every_rank_says(result, pattern):
    err = result.stderr
    assert result.returncode != 0 and result.seconds < WITHIN_S, \
        (result.returncode, result.seconds, err[-3000:])
    _assert_user_error_on_both_ranks(err)
    for rank in (0, 1):
        assert re.search(rf"\[rank {rank}\] error: {pattern}", err), (rank, err[-3000:])
    assert "training from iteration" not in result.stdout  # before any compute
    assert LEFT_NONE in result.stdout and "left at exit: True" not in result.stdout, \
        result.stdout[-2000:]


# ---------------------------------------------------------------- a file rank 1 cannot see
#: Rank 1 has lost the mount holding the data and the tokenizer files (LOST_DIR): they do
#: not exist for it, while rank 0 sees them.
_LOST_MOUNT_ON_RANK_1 = r'''
import os
if os.environ["RANK"] == "1":
    real_isfile, lost = os.path.isfile, os.environ["LOST_DIR"]
    os.path.isfile = lambda p: False if str(p).startswith(lost) else real_isfile(p)
'''


def test_a_file_one_rank_cannot_see_ends_every_rank_naming_rank_and_file(gpt2_data, tmp_path):
    result = _run_entry(tmp_path, _LOST_MOUNT_ON_RANK_1, _tiny(gpt2_data),
                        env={"LOST_DIR": gpt2_data["root"]})
    vocab = re.escape(gpt2_data["vocab"])
    _assert_every_rank_says(result, rf"checking the run's files failed on rank 1: .*"
                                    rf"--vocab-file {vocab} does not exist")
    assert "has no .bin or .idx file" in result.stderr  # every problem of rank 1 is listed
    assert "rank 0:" not in result.stderr  # rank 0 found nothing wrong


def test_a_file_missing_on_every_rank_gives_every_rank_the_usual_message(gpt2_data, tmp_path):
    """The same verdict on every rank of a distributed run: agreed, then raised as a flag
    problem is (no rank to name)."""
    missing = str(tmp_path / "vocab.json")
    messages = run_distributed(user_error, 2, _tiny(gpt2_data, "--vocab-file", missing),
                               timeout=120)
    assert messages[0] == messages[1] == (f"invalid configuration:\n  - --vocab-file "
                                          f"{missing} does not exist"), messages


def test_files_missing_on_every_rank_still_fail_before_torch_distributed(gpt2_data, tmp_path):
    """Single process: the files' problems are raised with the flags', before anything
    starts (no process group, nothing to agree with)."""
    missing = str(tmp_path / "vocab.json")
    script = tmp_path / "entry.py"
    script.write_text(r'''
import sys
import pretrain_gpt2
from megatron.common.errors import run_main
import torch.distributed as dist
try:
    run_main(pretrain_gpt2.main, sys.argv[1:])
finally:
    print("process group started:", dist.is_initialized(), flush=True)
''')
    result = run_script([str(script), *_tiny(gpt2_data, "--vocab-file", missing)],
                        env=dict(NO_NATIVE, PYTHONPATH=REPO))
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"--vocab-file {missing} does not exist" in result.stderr
    assert "process group started: False" in result.stdout
    assert "checking the run's files" not in result.stderr  # no agreement: one process


def test_flag_problems_stay_early_and_identical_on_every_rank(gpt2_data):
    """A bad flag (sizes) is every rank's verdict: raised before torch.distributed, the
    same on every rank, even when a file is also missing on some rank."""
    argv = _tiny(gpt2_data, "--num-attention-heads", "3", "--hidden-size", "36",
                 "--model-parallel-size", "2")
    results = run_distributed(_error_without_process_group, 2, argv, "/nowhere/vocab.json")
    for message, deferred in results:
        assert "--num-attention-heads (3) is not divisible by the tensor-model-parallel size " \
               "(2)" in message, message
        assert not deferred, message  # raised at once, as before
    assert "/nowhere/vocab.json does not exist" in results[1][0]  # listed with it


def _error_without_process_group(argv, rank_1_vocab):
    """Rank body: build the run configuration as initialize_megatron does (rank 1 with
    another --vocab-file); the error and whether it came as the deferred kind (a problem
    with this rank's files only)."""
    import torch.distributed as dist

    from megatron.config import build_run_config
    from megatron.config.parser import RankFileProblems
    from megatron.common.errors import ConfigError
    from megatron.families import get_family

    if dist.get_rank() == 1:
        argv = list(argv)
        argv[argv.index("--vocab-file") + 1] = rank_1_vocab
    try:
        build_run_config(argv, get_family("gpt2"))
    except ConfigError as exc:
        return str(exc), isinstance(exc, RankFileProblems)
    return None, False


# ---------------------------------------------------------------- the tracker
def _load_with_tracker_seen_by_rank_1(load, fault):
    """Rank body: load_checkpoint with rank 1's tracker read replaced by ``fault``
    (``"malformed"``, ``"missing"``, ``"other"``: another iteration); what each rank
    raised (type, message) or returned."""
    import types

    import torch.distributed as dist

    import megatron.training.checkpointing as ck
    from megatron.common.errors import CheckpointError

    if dist.get_rank() == 1:
        def read(root):
            if fault == "malformed":
                raise CheckpointError(f"{root}/{ck.TRACKER_FILENAME} should hold an iteration "
                                      f"number, found 'garbage'")
            return None if fault == "missing" else 3
        ck.read_tracker = read
    cfg = types.SimpleNamespace(model_family=None, checkpoint=types.SimpleNamespace(
        load=load, save=None, no_load_optim=False, finetune=False))
    start = time.monotonic()
    try:
        return "returned", ck.load_checkpoint(None, cfg, None), time.monotonic() - start
    except Exception as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start


@pytest.mark.parametrize("fault, message", [
    ("malformed", "reading the tracker of {load} failed on rank 1: {load}/" + TRACKER +
     " should hold an iteration number, found 'garbage'"),
    ("missing", "reading the tracker of {load}: the ranks disagree: iteration 4 on rank 0; no "
                "tracker on rank 1; every rank must see the same --load folder"),
    ("other", "reading the tracker of {load}: the ranks disagree: iteration 4 on rank 0; "
              "iteration 3 on rank 1; every rank must see the same --load folder"),
])
def test_a_tracker_one_rank_reads_differently_ends_every_rank(tmp_path, fault, message):
    load = str(tmp_path / "ckpt")
    os.makedirs(load)
    with open(os.path.join(load, TRACKER), "w") as handle:
        handle.write("4")
    results = run_distributed(_load_with_tracker_seen_by_rank_1, 2, load, fault, timeout=60)
    expected = message.format(load=load)
    for kind, text, seconds in results:
        assert kind == "CheckpointError" and text.startswith(expected), results
        assert seconds < 5, results  # one exchange, no timeout waited for


def test_ranks_that_agree_on_no_tracker_start_from_scratch(tmp_path):
    load = str(tmp_path / "empty")
    os.makedirs(load)  # no tracker anywhere: every rank starts from scratch
    results = run_distributed(_load_with_tracker_seen_by_rank_1, 2, load, "missing",
                              timeout=60)
    assert [r[:2] for r in results] == [("returned", 0)] * 2, results


@pytest.mark.slow
def test_a_malformed_tracker_on_one_rank_ends_every_rank_with_status_2(gpt2_data, tmp_path):
    load = str(tmp_path / "ckpt")
    os.makedirs(load)
    with open(os.path.join(load, TRACKER), "w") as handle:
        handle.write("2")
    body = r'''
import os
import megatron.training.checkpointing as ck
from megatron.common.errors import CheckpointError
if os.environ["RANK"] == "1":
    def read(root):
        raise CheckpointError(f"{root}/{ck.TRACKER_FILENAME} should hold an iteration number, "
                              f"found 'garbage'")
    ck.read_tracker = read
'''
    result = _run_entry(tmp_path, body, _tiny(gpt2_data, "--load", load))
    err = result.stderr
    assert result.returncode != 0 and result.seconds < WITHIN_S, (result.seconds, err[-3000:])
    _assert_user_error_on_both_ranks(err)
    for rank in (0, 1):
        assert f"[rank {rank}] error: reading the tracker of {load} failed on rank 1: {load}/" \
               f"{TRACKER} should hold an iteration number, found 'garbage'" in err, err[-3000:]


# ---------------------------------------------------------------- a checkpoint file
def test_a_checkpoint_file_one_rank_cannot_read_ends_every_rank(gpt2_data, tmp_path):
    """tp=2: rank 1's shard is truncated (a half-copied checkpoint); rank 0's loads fine. The
    manifest names it before torch.load is tried (without one: tests/test_conversion_errors.py's
    unreadable file)."""
    ckpt = str(tmp_path / "ckpt")
    argv = _tiny(gpt2_data, "--model-parallel-size", "2")
    run_distributed(train_gpt2, 2, [*argv, "--train-iters", "1", "--save", ckpt], timeout=240)
    shard = os.path.join(ckpt, "iter_0000001", "mp_rank_01_000", "model_optim_rng.pt")
    with open(shard, "r+b") as handle:
        handle.truncate(os.path.getsize(shard) // 2)
    start = time.monotonic()
    messages = run_distributed(user_error, 2, [*argv, "--load", ckpt], timeout=240)
    assert time.monotonic() - start < WITHIN_S + 30, messages  # a training run's start-up
    for message in messages:
        assert message is not None and message.startswith(
            f"verifying the checkpoint of iteration 1 in {ckpt} failed on rank 1: checkpoint "
            f"file {shard} is damaged"), messages
        assert f"; {os.path.getsize(shard)} bytes, {2 * os.path.getsize(shard)}" in message or \
            f"; {os.path.getsize(shard)} bytes, {2 * os.path.getsize(shard) + 1}" in message, \
            message


# ---------------------------------------------------------------- the dataset index
def _index_build_fails_on_rank_0(prefix, cause):
    """Rank body: build the datasets with rank 0's index build failing with ``cause``
    (``"disk"``: ENOSPC, ``"bug"``: a plain exception); what each rank raised."""
    import torch.distributed as dist

    import megatron.data.gpt2_dataset as gd

    if dist.get_rank() == 0:
        def build(*args):
            if cause == "disk":
                raise OSError(errno.ENOSPC, "No space left on device")
            raise KeyError("sizes")
        gd.build_index_arrays = build
    try:
        gd.build_train_valid_test_datasets([prefix], "90,10,0", [150, 20, 0], 12, 3)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("cause", ["disk", "bug"])
def test_the_dataset_index_failing_on_rank_0_ends_every_rank_with_its_cause(tmp_path, cause):
    from test_data_gpt2 import _unique_docs, _write
    import numpy as np

    prefix = _write(str(tmp_path / "d"), _unique_docs(np.random.default_rng(0), 60))
    results = run_distributed(_index_build_fails_on_rank_0, 2, prefix, cause, timeout=60)
    desc = f"{prefix}_train_indexmap_150ns_12sl_3s_desc.json"
    if cause == "disk":
        told = ("DataError", f"building the dataset index {desc} failed on rank 0: OSError: "
                             f"[Errno 28] No space left on device")
        assert results == [told, told], results
    else:  # a bug keeps its own traceback on rank 0; rank 1 is told what and where
        assert results == [("KeyError", "'sizes'"), (
            "DataError", f"building the dataset index {desc} failed on rank 0: KeyError: "
                         f"'sizes'")], results
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]  # no half cache


# ---------------------------------------------------------------- every rank's line
_SAME_ERROR_LATER_ON_RANK_1 = r'''
import os, sys, time
import torch.distributed as dist
from megatron.common.errors import ConfigError, run_main

def main():
    if os.environ["CASE"] != "late, before torch.distributed":  # then: the agent's store
        dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    if os.environ["CASE"].startswith("late"):
        time.sleep(3.0 * rank)  # rank 1 reaches the same error 3 s after rank 0
    elif rank == 1:
        time.sleep(120)  # busy: never reaches an error
    print(f"rank {rank} raises at {time.time():.3f}", flush=True)
    raise ConfigError(f"the same problem (found by rank {rank})")

run_main(main)
'''


def _peer_report_run(tmp_path, case):
    script = tmp_path / "peers.py"
    script.write_text(_SAME_ERROR_LATER_ON_RANK_1)
    result = run_script([str(script)], nproc=2, timeout=120,
                        env=dict(NO_NATIVE, PYTHONPATH=REPO, CASE=case))
    ended = time.time()
    raised = {int(r): float(t) for r, t in re.findall(r"rank (\d) raises at (\S+)",
                                                      result.stdout)}
    return result, raised, ended


@pytest.mark.parametrize("case", ["late", "late, before torch.distributed"])
def test_a_rank_that_fails_first_waits_for_its_peer_to_print(tmp_path, case):
    """Rank 1 reaches the same user error 3 s after rank 0 (in a run whose process group
    exists, and before it starts: torchrun's agent store is counted in then)."""
    result, raised, ended = _peer_report_run(tmp_path, case)
    err = result.stderr
    assert result.returncode != 0, err[-3000:]
    _assert_user_error_on_both_ranks(err)
    prefix = "" if "before" in case else "[rank {}] "  # no rank prefix before it starts
    for rank in (0, 1):  # torchrun would have stopped rank 1 before it printed
        assert f"{prefix.format(rank)}error: the same problem (found by rank {rank})" in err, err
    # the ranks start up to a second or two apart (before torch.distributed nothing lines
    # them up): rank 1 still raised well after rank 0, whose exit would have cut it off
    assert raised[1] - raised[0] >= 1.5, raised
    assert ended - raised[1] < 8, (raised, ended)  # not the 10 s bound: it saw rank 1 print


@pytest.mark.slow
def test_a_rank_failing_alone_exits_after_the_bound(tmp_path):
    from megatron.common.errors import REPORT_WAIT_S

    result, raised, ended = _peer_report_run(tmp_path, "alone")
    err = result.stderr
    assert result.returncode != 0, err[-3000:]
    assert "[rank 0] error: the same problem (found by rank 0)" in err, err
    assert list(raised) == [0], raised
    # it waited for the busy rank (the bound), then exited; torchrun stopped the other
    assert REPORT_WAIT_S - 0.5 <= ended - raised[0] < REPORT_WAIT_S + 10, (raised, ended)
    codes = re.findall(r"exitcode  : (-?\d+)", err)
    assert "2" in codes, err[-3000:]
