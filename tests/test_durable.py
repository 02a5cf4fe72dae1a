"""Durable publication (megatron/resilience/durable.py): with ``os.fsync`` recorded, every writer of a
checkpoint flushes the data files, then the tracker, then the folder that names it, in that
order; and the asynchronous snapshot copies every piece of state a later step can change."""
import os

import pytest
import torch

from megatron.checkpoint import format as fmt
from megatron.resilience.checkpoint_integrity import gather_digests

TRACKER = fmt.TRACKER_FILENAME


@pytest.fixture
def fsyncs(monkeypatch):
    """The paths ``os.fsync`` flushed, in order (files and directories)."""
    seen = []
    real = os.fsync

    def record(fd):
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real(fd)

    monkeypatch.setattr(os, "fsync", record)
    monkeypatch.delenv("MEGATRON_TDS_FSYNC", raising=False)
    return seen


def _assert_files_then_tracker_then_folder(seen, root, data_names, published_prefix="iter_"):
    root = os.path.realpath(root)
    data = [i for i, p in enumerate(seen) if os.path.basename(p).split(".tmp")[0] in data_names]
    tracker = [i for i, p in enumerate(seen) if os.path.basename(p).startswith(TRACKER)]
    folder = [i for i, p in enumerate(seen) if p == root]
    assert data and len(tracker) == 1 and folder, seen
    assert max(data) < tracker[0] < folder[-1] == len(seen) - 1, seen
    # the iteration folder's entries were flushed before it was renamed into the root
    published = [i for i, p in enumerate(seen)
                 if os.path.basename(p).startswith(published_prefix)]
    assert published and max(published) < tracker[0], seen


def _assert_manifest_before_tracker(seen, folder):
    """The manifest of digests was flushed once, inside the folder, before the tracker, and
    every file of the published folder verifies against it."""
    from megatron.checkpoint.manifest import verify_folder

    manifest = [i for i, p in enumerate(seen) if os.path.basename(p) == "manifest.json"]
    tracker = [i for i, p in enumerate(seen) if os.path.basename(p).startswith(TRACKER)]
    assert len(manifest) == 1 and manifest[0] < tracker[0], seen
    found, problems = verify_folder(folder)
    assert problems == [] and len(found.files) >= 2, problems


def _files(tmp_root, iteration, ranks=2):
    return [(fmt.checkpoint_name(tmp_root, iteration, tp, 0), {"w": torch.randn(3, 2) + tp})
            for tp in range(ranks)]


def test_sync_save_flushes_files_then_tracker_then_folder(tmp_path, fsyncs):
    from megatron.training import checkpointing as ck

    root, tmp_root = str(tmp_path / "ckpt"), str(tmp_path / "ckpt" / ".tmp")
    files = _files(tmp_root, 4)
    written = ck._write_files(files)  # what each rank does, then rank 0 publishes
    digests = gather_digests(written, fmt.iteration_dir(tmp_root, 4))
    fmt.publish_iteration(root, tmp_root, 4, digests=digests)
    _assert_files_then_tracker_then_folder(fsyncs, root, {fmt.MODEL_FILENAME})
    _assert_manifest_before_tracker(fsyncs, fmt.iteration_dir(root, 4))
    assert fmt.read_tracker(root) == 4
    saved = torch.load(fmt.checkpoint_name(root, 4, 1, 0), weights_only=True)
    assert torch.equal(saved["w"], files[1][1]["w"])


def test_background_save_flushes_files_then_tracker_then_folder(tmp_path, fsyncs):
    from megatron.training import checkpointing as ck

    root, tmp_root = str(tmp_path / "ckpt"), str(tmp_path / "ckpt" / ".tmp")
    writer = ck.new_async_writer()  # one process: no process group
    files = _files(tmp_root, 6)
    writer.submit(root, tmp_root, 6, files)
    writer.wait()
    _assert_files_then_tracker_then_folder(fsyncs, root, {fmt.MODEL_FILENAME})
    _assert_manifest_before_tracker(fsyncs, fmt.iteration_dir(root, 6))
    assert fmt.read_tracker(root) == 6


def test_converter_output_flushes_files_then_tracker_then_folder(tmp_path, fsyncs):
    from gpt2_ckpt import random_checkpoint

    from megatron.checkpoint.native_writer import reshard, write_native

    root = str(tmp_path / "converted")
    folder = write_native(reshard(random_checkpoint(0), tp=2, pp=1), root)
    _assert_files_then_tracker_then_folder(fsyncs, root, {fmt.MODEL_FILENAME})
    _assert_manifest_before_tracker(fsyncs, folder)


@pytest.mark.parametrize("iteration, folder", [(7, "iter_0000007"), (0, "release")])
def test_megatron_lm_output_flushes_files_then_tracker_then_folder(tmp_path, fsyncs,
                                                                   iteration, folder):
    from gpt2_ckpt import random_checkpoint

    from megatron.checkpoint.megatron_lm import read_megatron_lm, write_megatron_lm
    from megatron.checkpoint.native_writer import reshard

    ckpt = reshard(random_checkpoint(iteration), tp=2, pp=2)
    ckpt.iteration = iteration
    root = str(tmp_path / "megatron")
    write_megatron_lm(ckpt, root, tp=2, pp=2)
    _assert_files_then_tracker_then_folder(fsyncs, root, {fmt.MODEL_FILENAME}, folder)
    files = [p for p in fsyncs if os.path.basename(p) == fmt.MODEL_FILENAME]
    assert len(files) == 4, fsyncs  # every rank file's data, each once
    assert sorted(os.listdir(root)) == sorted([TRACKER, folder])  # no temporary folder left
    back = read_megatron_lm(root)
    assert back.iteration == iteration
    assert all(torch.equal(back.state[k], ckpt.state[k]) for k in ckpt.state)


def test_hf_output_is_flushed_before_it_is_renamed(tmp_path, fsyncs):
    from megatron.checkpoint_conversion.hf_io import read_weights, write_hf_dir

    out = str(tmp_path / "hf")
    state = {"w": torch.randn(4, 4)}
    write_hf_dir(out, {"model_type": "gpt2"}, state)
    names = [os.path.basename(p) for p in fsyncs]
    renamed = names.index(os.path.basename(str(tmp_path)))  # the parent, after the rename
    assert {"config.json", "model.safetensors"} <= set(names[:renamed]), names
    assert torch.equal(read_weights(out)["w"], state["w"])


def test_llama_export_is_flushed_before_it_is_renamed(gpt2_data, tmp_path, fsyncs):
    """examples/llama/convert_llama.py writes its HF directory by the same rules."""
    transformers = pytest.importorskip("transformers")
    from harness import run_distributed
    from llama_runs import llama_argv, train_llama

    from megatron.checkpoint.native_reader import read_native
    from megatron.common.errors import CheckpointError

    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    run_distributed(train_llama, 1, llama_argv(gpt2_data, 1, 1, "--save", ckpt, steps=1,
                                               global_batch=2), timeout=120)
    from convert_llama import main  # examples/llama, on the path through llama_runs

    del fsyncs[:]  # the export's flushes only
    assert main(["--load", ckpt, "--output", out]) == 0
    names = [os.path.basename(p) for p in fsyncs]
    renamed = names.index(os.path.basename(str(tmp_path)))  # the parent, after the rename
    written = {"config.json", "generation_config.json", "model.safetensors"}
    assert written <= set(names[:renamed]) and sorted(os.listdir(out)) == sorted(written), names
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "hf"]  # no temporary folder left
    hf = transformers.LlamaForCausalLM.from_pretrained(out).state_dict()
    full = read_native(ckpt, 1).state
    assert torch.equal(hf["model.layers.1.mlp.down_proj.weight"], full["2.down_proj.weight"])
    with pytest.raises(CheckpointError, match="exists and is not empty"):
        main(["--load", ckpt, "--output", out])  # never written over, nor mixed with


def test_fsync_can_be_turned_off(tmp_path, fsyncs, monkeypatch):
    monkeypatch.setenv("MEGATRON_TDS_FSYNC", "0")
    fmt.write_tracker(str(tmp_path), 3)
    assert fsyncs == [] and fmt.read_tracker(str(tmp_path)) == 3


def test_snapshot_copies_every_mutable_object():
    """The writer thread pickles the snapshot later: an object the next step changes in
    place (DeepSpeed's loss scaler, a dict inside an object) must be copied now."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from megatron.resilience.async_save import snapshot

    scaler = DynamicLossScaler(init_scale=2.0 ** 16, scale_window=1000, min_scale=1,
                               delayed_shift=2, consecutive_hysteresis=False)
    state = {"loss_scaler": scaler, "seen": {3, 4}, "args": {"lr": 0.1},
             "opt": [torch.randn(3), ("steps", 7)]}
    copy = snapshot(state, pin=False)
    scaler.cur_scale = 2.0 ** 10  # a later step's overflow halves the scale
    scaler.cur_iter += 5
    state["seen"].add(5)
    state["args"]["lr"] = 0.2
    assert copy["loss_scaler"] is not scaler
    assert copy["loss_scaler"].cur_scale == 2.0 ** 16 and copy["loss_scaler"].cur_iter == 0
    assert copy["seen"] == {3, 4} and copy["args"]["lr"] == 0.1
    assert copy["opt"][1] == ("steps", 7)
