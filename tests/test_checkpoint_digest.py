"""Checkpoint digests: hashed while written, published in a manifest, verified when read, and
``tools/verify_checkpoint.py``.

Checkpoints here are real ones (the project's native writer, random GPT-2 weights, and the
same write path training uses); every expected digest is recomputed independently from the
file's bytes with the hash library itself, and damage is made inside one tensor's bytes so
that ``torch.load`` alone would not notice it (tests/checkpoint_damage.py).
"""
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zlib

import pytest
import torch
import xxhash

from checkpoint_damage import DAMAGE, assert_silent, flip_one_byte, tensors
from gpt2_ckpt import random_checkpoint
from gpt2_runs import REPO
from megatron.checkpoint import digest, format as fmt, manifest
from megatron.checkpoint.native_writer import reshard, write_native
from megatron.checkpoint.zero_state import load_engine_optimizer_file
from megatron.common.errors import CheckpointDigestError, CheckpointError

INDEPENDENT = {"xxh3_128": lambda data: xxhash.xxh3_128(data).hexdigest(),
               "blake2b": lambda data: hashlib.blake2b(data).hexdigest(),
               "crc32": lambda data: f"{zlib.crc32(data):08x}"}


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(300, 70, generator=g), "b": torch.randn(70, generator=g),
            "nested": {"step": 3, "ids": torch.randint(0, 9, (50,), generator=g)}}


def _native(tmp_path, seed, tp=2):
    """A published native checkpoint: (root, iteration folder)."""
    root = str(tmp_path / "ckpt")
    return root, write_native(reshard(random_checkpoint(seed % 1000), tp=tp, pp=1), root)


def _xxh3(path):
    with open(path, "rb") as handle:
        return xxhash.xxh3_128(handle.read()).hexdigest()


@pytest.mark.parametrize("algorithm", sorted(digest.ALGORITHMS))
def test_the_digest_hashed_while_writing_is_the_digest_of_the_file(tmp_path, seed, algorithm,
                                                                   monkeypatch):
    state = _state(seed)
    path = str(tmp_path / "file.pt")
    written = digest.save_with_digest(state, path, algorithm)
    with open(path, "rb") as handle:
        data = handle.read()
    assert written == digest.FileDigest(len(data), INDEPENDENT[algorithm](data), algorithm)
    monkeypatch.setattr(digest, "READ_CHUNK", 4096)  # the read-back in many pieces
    assert digest.file_digest(path, algorithm) == written
    back = torch.load(path, weights_only=True)  # the file torch.save would have written
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["nested"]["ids"],
                                                              state["nested"]["ids"])


def test_publication_lists_every_file_and_refuses_one_without_a_digest(tmp_path, seed):
    root, tmp_root = str(tmp_path / "ckpt"), str(tmp_path / "ckpt" / ".tmp")
    paths = [fmt.checkpoint_name(tmp_root, 3, 0, 0),
             fmt.optimizer_shard_name(tmp_root, 3, 0, 0, 1)]
    written = {}
    for i, path in enumerate(paths):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        written[manifest.relative_name(path, fmt.iteration_dir(tmp_root, 3))] = \
            fmt.write_checkpoint_file(path, _state(seed + i))
    fmt.publish_iteration(root, tmp_root, 3, digests=written)
    folder = fmt.iteration_dir(root, 3)
    with open(os.path.join(folder, manifest.MANIFEST_FILENAME)) as handle:
        body = json.load(handle)
    assert body["algorithm"] == "xxh3_128" and body["iteration"] == 3
    assert body["files"] == {name: {"size": os.path.getsize(os.path.join(folder, name)),
                                    "digest": _xxh3(os.path.join(folder, name))}
                             for name in ("mp_rank_00_000/model_optim_rng.pt",
                                          "mp_rank_00_000/optim_dp_rank_001.pt")}
    # a file written around the common path (plain torch.save) fails the publication
    stray = fmt.checkpoint_name(tmp_root, 6, 0, 0)
    os.makedirs(os.path.dirname(stray))
    torch.save(_state(seed), stray)
    with pytest.raises(CheckpointError, match="mp_rank_00_000/model_optim_rng.pt was written "
                                              "without a digest"):
        fmt.publish_iteration(root, tmp_root, 6, digests={})
    assert fmt.read_tracker(root) == 3 and not os.path.exists(fmt.iteration_dir(root, 6))


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_reader_verifies_the_file_before_loading_it(tmp_path, seed, damage):
    root, folder = _native(tmp_path, seed)
    good, bad = (os.path.join(folder, f"mp_rank_0{t}_000", fmt.MODEL_FILENAME) for t in (0, 1))
    before = fmt.load_rank_file(bad)
    expected = manifest.read_manifest(folder).files["mp_rank_01_000/model_optim_rng.pt"]
    DAMAGE[damage](bad)
    assert_silent(before, torch.load(bad, weights_only=True), 2.0 ** -10)
    with pytest.raises(CheckpointDigestError) as info:
        fmt.load_rank_file(bad)
    message = str(info.value)
    assert f"checkpoint file {bad} is damaged" in message, message
    assert f"digest {_xxh3(bad)} found, {expected.digest} expected" in message, message
    assert _xxh3(bad) != expected.digest
    fmt.load_rank_file(good)  # the other rank's file is intact
    with manifest.verification(enabled=False) as scope:  # --no-verify-checkpoint
        loaded = tensors(fmt.load_rank_file(bad))
    assert scope.checked == []
    damaged = tensors(torch.load(bad, weights_only=True))
    assert loaded.keys() == damaged.keys() and all(torch.equal(loaded[k], damaged[k])
                                                   for k in loaded)


def test_optimizer_shards_are_verified_and_a_lost_one_is_noticed(tmp_path, seed):
    root, tmp_root = str(tmp_path / "ckpt"), str(tmp_path / "ckpt" / ".tmp")
    folder = fmt.iteration_dir(tmp_root, 2)
    shards = [fmt.optimizer_shard_name(tmp_root, 2, 0, 0, r) for r in range(2)]
    os.makedirs(os.path.dirname(shards[0]))
    digests = {manifest.relative_name(p, folder): fmt.write_checkpoint_file(p, _state(seed + r))
               for r, p in enumerate(shards)}
    fmt.publish_iteration(root, tmp_root, 2, digests=digests)
    published = [fmt.optimizer_shard_name(root, 2, 0, 0, r) for r in range(2)]
    with manifest.verification() as scope:
        for path in published:
            load_engine_optimizer_file(path)
    assert scope.checked == published
    flip_one_byte(published[1])
    with pytest.raises(CheckpointDigestError, match=f"{published[1]} is damaged"):
        load_engine_optimizer_file(published[1])
    os.remove(published[1])  # the folder would look saved at data-parallel size 1
    with pytest.raises(CheckpointDigestError, match=f"{published[1]} is missing"):
        load_engine_optimizer_file(published[0])


def test_unlisted_files_and_folders_without_a_manifest(tmp_path, seed):
    root, folder = _native(tmp_path, seed)
    extra = os.path.join(folder, "mp_rank_00_000", "extra.pt")
    torch.save(_state(seed), extra)
    with pytest.raises(CheckpointDigestError, match="extra.pt is not listed in"):
        fmt.load_rank_file(extra)
    never = os.path.join(folder, "mp_rank_02_000", fmt.MODEL_FILENAME)  # another layout's
    with pytest.raises(CheckpointError, match="is missing: the checkpoint is incomplete") as info:
        fmt.load_rank_file(never)
    assert not isinstance(info.value, CheckpointDigestError)  # not damage: no fallback
    lost = os.path.join(folder, "mp_rank_01_000")
    shutil.rmtree(lost)  # a listed rank folder lost whole
    with pytest.raises(CheckpointDigestError, match=f"{lost}/model_optim_rng.pt is missing"):
        fmt.load_rank_file(os.path.join(lost, fmt.MODEL_FILENAME))
    os.remove(os.path.join(folder, manifest.MANIFEST_FILENAME))  # as checkpoints saved before
    with manifest.verification() as scope:
        fmt.load_rank_file(extra)
    assert scope.unverified == {folder} and scope.checked == []


@pytest.mark.parametrize("how", ["truncated", "not a manifest", "bad entry"])
def test_a_damaged_manifest_vouches_for_nothing(tmp_path, seed, how):
    root, folder = _native(tmp_path, seed)
    path = os.path.join(folder, manifest.MANIFEST_FILENAME)
    text = open(path).read()
    if how == "truncated":
        text = text[:len(text) // 2]
    elif how == "not a manifest":
        text = json.dumps({"files": {}})
    else:
        text = text.replace('"size": ', '"size": "', 1)
    open(path, "w").write(text)
    with pytest.raises(CheckpointDigestError, match=f"manifest {path} is damaged"):
        fmt.load_rank_file(os.path.join(folder, "mp_rank_00_000", fmt.MODEL_FILENAME))


# ---------------------------------------------------------------- tools/verify_checkpoint.py
def _tool():
    spec = importlib.util.spec_from_file_location(
        "verify_checkpoint", os.path.join(REPO, "tools", "verify_checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_the_verify_tool_passes_good_checkpoints_and_names_every_problem(tmp_path, seed,
                                                                         capsys):
    main = _tool()
    root, folder = _native(tmp_path, seed)
    ckpt = random_checkpoint(seed % 1000 + 1)
    ckpt.iteration = 9
    newer = write_native(reshard(ckpt, tp=2, pp=1), root)
    assert main([root]) == 0 and main([folder]) == 0 and main([root, "--all"]) == 0
    assert capsys.readouterr().out.count("ok: ") == 4
    rank1 = os.path.join(newer, "mp_rank_01_000", fmt.MODEL_FILENAME)
    expected = manifest.read_manifest(newer).files["mp_rank_01_000/model_optim_rng.pt"]
    flip_one_byte(rank1)
    assert main([root]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED: {newer}: 1 problem(s)" in out, out
    assert f"{rank1} is damaged: xxh3_128 digest {_xxh3(rank1)} found, {expected.digest} " \
           f"expected" in out, out
    assert main([root, "--iteration", "0"]) == 0 and main([root, "--all"]) == 1
    capsys.readouterr()
    os.remove(os.path.join(folder, "mp_rank_00_000", fmt.MODEL_FILENAME))
    open(os.path.join(folder, "mp_rank_01_000", "stray.pt"), "wb").write(b"x")
    assert main([folder]) == 1
    out = capsys.readouterr().out
    assert "mp_rank_00_000/model_optim_rng.pt is missing" in out and \
        "stray.pt is not listed" in out, out
    path = os.path.join(newer, manifest.MANIFEST_FILENAME)
    open(path, "w").write(open(path).read()[:40])  # truncated
    assert main([newer]) == 1
    assert f"checkpoint manifest {path} is damaged" in capsys.readouterr().out
    os.remove(path)
    assert main([newer]) == 1
    assert "has no manifest.json" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit) as info:  # not a checkpoint: a usage error
        main([str(empty)])
    assert info.value.code == 2
    assert "has no latest_checkpointed_iteration.txt" in capsys.readouterr().err


def test_the_verify_tool_exit_status_as_a_process(tmp_path, seed):
    root, folder = _native(tmp_path, seed, tp=1)
    flip_one_byte(os.path.join(folder, "mp_rank_00_000", fmt.MODEL_FILENAME))
    result = subprocess.run([sys.executable, "tools/verify_checkpoint.py", root], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "is damaged" in result.stdout
