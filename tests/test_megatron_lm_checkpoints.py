"""Megatron-LM's own GPT checkpoints (versions 0-3) in and out.

The checkpoints are written here by :func:`write_megatron_lm_files`, a writer independent of
the project's reader that follows Megatron-LM's code for each version (its
``state_dict_for_save_checkpoint`` nesting, key names, per-rank QKV row order, vocabulary
padding, pipeline-stage and virtual-chunk layer placement, file and folder names), from a
random transformers ``GPT2LMHeadModel``, the reference:

- every version at tp 1 and 2 (version 3 also at pp 2 and with virtual-pipeline chunks,
  with both key-name families) reads into the reference's weights exactly, and converted to
  Hugging Face gives the reference's logits;
- GPT2Model (our model) loaded from it gives the reference's logits (fp32);
- transformers' own ``convert_megatron_gpt2_checkpoint.py`` on the same tp 1 files gives the
  same logits (when that script can be found: transformers 5 no longer ships it; point
  ``MEGATRON_GPT2_CONVERTER`` at a copy to run it);
- our version-3 writer's output reads back exactly; a ``--load`` of a Megatron-LM folder
  trains a step; files that pickle other objects are refused without running them.
"""
import argparse
import importlib
import importlib.util
import os

import numpy as np
import pytest
import torch

from gpt2_hf import hf_logits, make_hf_gpt2, native_logits
from gpt2_runs import gpt2_argv, train_gpt2
from harness import run_distributed
from megatron.checkpoint.megatron_lm import detect, read_megatron_lm, write_megatron_lm
from megatron.checkpoint_conversion import ConversionRequest, run_conversion
from megatron.checkpoint_conversion.hf_gpt2 import hf_to_full, args_from_hf_config
from megatron.common.errors import CheckpointError, ConfigError

VOCAB, LAYERS, HIDDEN, HEADS, POSITIONS = 100, 4, 32, 4, 16
DIVISIBLE_BY = 8  # Megatron pads the vocabulary to a multiple of this x tp


# ---------------------------------------------------------------- the test's own writer
def _padded(vocab, tp):
    multiple = DIVISIBLE_BY * tp
    return (vocab + multiple - 1) // multiple * multiple


def _qkv_rank_rows(full, version, tp, rank, heads):
    """One tp rank's fused QKV rows in ``version``'s order, from HF's ``[q | k | v]`` rows.

    Megatron-LM's column-parallel QKV gives rank r heads r*np..(r+1)*np; within a rank,
    v0 (v1.0's ``split_tensor_along_last_dim(mixed, 3)``) keeps [3, np, hn], checkpoint
    version 1.0 viewed the output as [np, hn, 3], versions 2.0/3.0 as [np, 3, hn].
    """
    rest = full.shape[1:]
    heads_local = heads // tp
    mine = full.reshape(3, heads, -1, *rest)[:, rank * heads_local:(rank + 1) * heads_local]
    order = {0: (0, 1, 2), 1: (1, 2, 0), 2: (1, 0, 2), 3: (1, 0, 2)}[version]
    dims = order + tuple(range(3, 3 + len(rest)))
    return mine.permute(*dims).reshape(-1, *rest).contiguous()


def _split(tensor, dim, tp, rank):
    return torch.chunk(tensor, tp, dim=dim)[rank].clone()


def _megatron_layer(hf, i, version, tp, rank, attention, heads):
    """Layer ``i``'s tensors on tp rank ``rank`` under Megatron-LM's names."""
    p = f"transformer.h.{i}."
    t = {k[len(p):]: v for k, v in hf.items() if k.startswith(p)}
    out = {"input_layernorm.weight": t["ln_1.weight"], "input_layernorm.bias": t["ln_1.bias"],
           "post_attention_layernorm.weight": t["ln_2.weight"],
           "post_attention_layernorm.bias": t["ln_2.bias"]}
    out[f"{attention}.query_key_value.weight"] = _qkv_rank_rows(
        t["attn.c_attn.weight"].t(), version, tp, rank, heads)   # Conv1D [in, out] -> [out, in]
    out[f"{attention}.query_key_value.bias"] = _qkv_rank_rows(
        t["attn.c_attn.bias"], version, tp, rank, heads)
    out[f"{attention}.dense.weight"] = _split(t["attn.c_proj.weight"].t(), 1, tp, rank)
    out[f"{attention}.dense.bias"] = t["attn.c_proj.bias"]
    out["mlp.dense_h_to_4h.weight"] = _split(t["mlp.c_fc.weight"].t(), 0, tp, rank)
    out["mlp.dense_h_to_4h.bias"] = _split(t["mlp.c_fc.bias"], 0, tp, rank)
    out["mlp.dense_4h_to_h.weight"] = _split(t["mlp.c_proj.weight"].t(), 1, tp, rank)
    out["mlp.dense_4h_to_h.bias"] = t["mlp.c_proj.bias"]
    return {k: v.clone() for k, v in out.items()}


def _megatron_args(config, version, tp, pp, vpp):
    args = argparse.Namespace(
        num_layers=config.n_layer, hidden_size=config.n_embd,
        num_attention_heads=config.n_head, max_position_embeddings=config.n_positions,
        seq_length=config.n_positions, make_vocab_size_divisible_by=DIVISIBLE_BY,
        padded_vocab_size=_padded(config.vocab_size, tp), tokenizer_type="GPT2BPETokenizer",
        vocab_file=None, merge_file=None, layernorm_epsilon=1e-5, hidden_dropout=0.0,
        attention_dropout=0.0, init_method_std=0.02, openai_gelu=True, bias_gelu_fusion=False,
        apply_residual_connection_post_layernorm=False, fp16=False,
        params_dtype=torch.float32, consumed_train_samples=64, consumed_valid_samples=8)
    if version < 3:
        args.model_parallel_size = tp  # renamed with pipeline stages (version 3.0)
    else:
        args.tensor_model_parallel_size, args.pipeline_model_parallel_size = tp, pp
        args.virtual_pipeline_model_parallel_size = vpp if vpp > 1 else None
    if version >= 2:
        args.ffn_hidden_size, args.kv_channels = 4 * config.n_embd, config.n_embd // config.n_head
    return args


def write_megatron_lm_files(root, hf_model, version, tp=1, pp=1, vpp=1, new_names=None,
                            with_args=True, iteration=100, seed=0):
    """Write ``hf_model`` as Megatron-LM ``version`` saves a GPT model at tp x pp (x vpp
    chunks). Returns the padded vocabulary size.

    ``new_names``: the v2.5+ names (``encoder``, ``self_attention``); default: version 3.
    Version 0 goes to ``release/`` (a released model); the rest to ``iter_{iteration}``.
    """
    assert version == 3 or (pp == 1 and vpp == 1), "pipelines came with version 3.0"
    config = hf_model.config
    layers, vocab = config.n_layer, config.vocab_size
    new_names = version == 3 if new_names is None else new_names
    stack, attention = ("encoder", "self_attention") if new_names else ("transformer",
                                                                          "attention")
    hf = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    padded = _padded(vocab, tp)
    g = torch.Generator().manual_seed(seed)
    words = torch.cat([hf["transformer.wte.weight"],
                       torch.randn(padded - vocab, config.n_embd, generator=g)])  # padding
    per_chunk = layers // (pp * vpp)
    folder = root / ("release" if version == 0 else f"iter_{iteration:07d}")
    for stage in range(pp):
        for rank in range(tp):
            state = {"iteration": iteration, "random_rng_state": (3, tuple(range(5)), None),
                     "np_rng_state": np.random.RandomState(seed).get_state(),
                     "torch_rng_state": torch.get_rng_state(),
                     "rng_tracker_states": {"model-parallel-rng": torch.get_rng_state()},
                     "lr_scheduler": {"num_steps": 6400, "max_lr": 1e-4}}
            if with_args:
                state["args"] = _megatron_args(config, version, tp, pp, vpp)
            if version > 0:
                state["checkpoint_version"] = float(version)
            for chunk in range(vpp):
                # Megatron-LM v2.x ParallelTransformer: offset = chunk * (L / vpp) + stage *
                # (layers per chunk); first/last stage are chunk 0 of stage 0 / the last chunk
                # of the last stage.
                offset = chunk * (layers // vpp) + stage * per_chunk
                first = stage == 0 and chunk == 0
                last = stage == pp - 1 and chunk == vpp - 1
                encoder = {}
                for local in range(per_chunk):
                    for name, tensor in _megatron_layer(hf, offset + local, version, tp, rank,
                                                        attention, config.n_head).items():
                        encoder[f"layers.{local}.{name}"] = tensor
                if last:
                    encoder["final_layernorm.weight"] = hf["transformer.ln_f.weight"]
                    encoder["final_layernorm.bias"] = hf["transformer.ln_f.bias"]
                lm = {stack: encoder}
                word_shard = _split(words, 0, tp, rank)
                if first:
                    lm["embedding"] = {"word_embeddings": {"weight": word_shard},
                                       "position_embeddings": {
                                           "weight": hf["transformer.wpe.weight"].clone()}}
                model = {"language_model": lm}
                if last and not first:
                    model["word_embeddings_for_head"] = {"weight": word_shard.clone()}
                state["model" if vpp == 1 else f"model{chunk}"] = model
            sub = f"mp_rank_{rank:02d}" if pp == 1 else f"mp_rank_{rank:02d}_{stage:03d}"
            os.makedirs(folder / sub)
            torch.save(state, folder / sub / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(
        "release" if version == 0 else str(iteration))
    return padded


# ---------------------------------------------------------------- fixtures and helpers
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The reference GPT2LMHeadModel (random, fp32, no dropout) and its full state."""
    path = tmp_path_factory.mktemp("reference")
    model = make_hf_gpt2(path / "hf", 1234, VOCAB, n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS,
                         n_positions=POSITIONS)
    config = args_from_hf_config(model.config.to_dict())
    return model, hf_to_full(model.state_dict(), config)


def _ids(seed):
    return torch.randint(0, VOCAB, (2, POSITIONS), generator=torch.Generator().manual_seed(seed))


def _hf_from(path, tmp_path, name):
    """Our Megatron-LM -> HF conversion of ``path``, loaded with transformers."""
    from transformers import GPT2LMHeadModel

    out = tmp_path / name
    run_conversion(ConversionRequest(str(path), str(out), output_format="hf",
                                     true_vocab=VOCAB))
    return GPT2LMHeadModel.from_pretrained(str(out)).eval()


CASES = [(v, tp, 1, 1, None) for v in (0, 1, 2, 3) for tp in (1, 2)] + [
    (3, 1, 2, 1, None), (3, 2, 2, 1, None), (3, 2, 2, 2, None), (3, 2, 2, 1, False),
    (2, 2, 1, 1, True)]


@pytest.mark.parametrize("version,tp,pp,vpp,new_names", CASES,
                         ids=[f"v{c[0]}-tp{c[1]}-pp{c[2]}-vpp{c[3]}-{c[4]}" for c in CASES])
def test_every_version_and_layout_reads_the_reference(reference, tmp_path, seed, version, tp,
                                                      pp, vpp, new_names):
    model, expected = reference
    root = tmp_path / "megatron"
    padded = write_megatron_lm_files(root, model, version, tp, pp, vpp, new_names, seed=seed)
    assert detect(str(root))
    ckpt = read_megatron_lm(str(root))
    assert sorted(ckpt.state) == sorted(expected)
    for key, tensor in expected.items():
        got = ckpt.state[key][:VOCAB] if key.endswith("word_embeddings.weight") else \
            ckpt.state[key]
        assert torch.equal(got, tensor), key
    assert ckpt.args["padded_vocab_size"] == padded
    assert (ckpt.args["tensor_model_parallel_size"], ckpt.args["pipeline_model_parallel_size"],
            ckpt.args["num_attention_heads"]) == (tp, pp, HEADS)
    if version == 0:
        assert ckpt.iteration == 0 and "lr_scheduler" not in ckpt.extras
    else:
        assert ckpt.iteration == 100 and ckpt.extras["lr_scheduler"] == {"num_steps": 100}
        assert ckpt.extras["consumed_train_samples"] == 64
    ids = _ids(seed)
    err = (hf_logits(_hf_from(root, tmp_path, "hf"), ids) - hf_logits(model, ids)).abs().max()
    assert err.item() < 1e-6


def test_no_args_needs_the_heads(reference, tmp_path):
    """The released GPT-2 345M's layout: release/, version 0, no args."""
    model, expected = reference
    root = tmp_path / "megatron"
    write_megatron_lm_files(root, model, 0, tp=2, with_args=False)
    with pytest.raises(CheckpointError, match="--num-attention-heads"):
        read_megatron_lm(str(root))
    ckpt = read_megatron_lm(str(root), hints={"num_attention_heads": HEADS})
    assert all(torch.equal(ckpt.state[k][:v.shape[0]], v) for k, v in expected.items())
    assert ckpt.args["make_vocab_size_divisible_by"] == 128  # Megatron-LM's default


def test_our_model_gives_the_reference_logits(reference, tmp_path, seed):
    """Megatron-LM (a tp 2 x pp 2 version-3 checkpoint) -> native at tp 1: GPT2Model's
    logits equal GPT2LMHeadModel's (fp32)."""
    model, _ = reference
    root, native = tmp_path / "megatron", tmp_path / "native"
    write_megatron_lm_files(root, model, 3, tp=2, pp=2, seed=seed)
    run_conversion(ConversionRequest(str(root), str(native), tp=1, pp=1, true_vocab=VOCAB))
    ids = _ids(seed)
    logits = torch.from_numpy(run_distributed(native_logits, 1, str(native), ids)[0])
    expected = hf_logits(model, ids)
    # Relative to the largest logit: two fp32 implementations summing in another order
    # differ by a few ulps of the values (1e-6 absolute is 1-2 ulps at |logit| ~ 8).
    err = ((logits[..., :VOCAB] - expected).abs().max() / expected.abs().max()).item()
    assert err < 1e-6, err


def _transformers_converter():
    """transformers' convert_megatron_gpt2_checkpoint module, or None."""
    try:
        return importlib.import_module(
            "transformers.models.megatron_gpt2.convert_megatron_gpt2_checkpoint")
    except ImportError:
        pass
    path = os.environ.get("MEGATRON_GPT2_CONVERTER")
    if not path or not os.path.isfile(path):
        return None
    spec = importlib.util.spec_from_file_location("convert_megatron_gpt2_checkpoint", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("version", [0, 1, 2, 3])
def test_transformers_converter_agrees(reference, tmp_path, seed, version):
    converter = _transformers_converter()
    if converter is None:
        pytest.skip("transformers' convert_megatron_gpt2_checkpoint.py is not installed "
                    "(transformers 5 dropped it); set MEGATRON_GPT2_CONVERTER to a copy")
    from transformers import GPT2Config, GPT2LMHeadModel

    model, _ = reference
    root = tmp_path / "megatron"
    write_megatron_lm_files(root, model, version, tp=1, seed=seed)
    folder = "release" if version == 0 else "iter_0000100"
    state = torch.load(root / folder / "mp_rank_00" / "model_optim_rng.pt",
                       map_location="cpu", weights_only=False)  # written by this test
    if not hasattr(state.get("args"), "ffn_hidden_size"):
        state.pop("args")  # the script reads args of v2+ only (v1.0's lack ffn_hidden_size)
    config = GPT2Config(vocab_size=VOCAB, n_positions=POSITIONS, n_embd=HIDDEN,
                        n_layer=LAYERS, n_head=HEADS, activation_function="gelu_new",
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    converted = converter.convert_megatron_checkpoint(None, state, config)
    theirs = GPT2LMHeadModel(config).eval()
    converted = {k: v for k, v in converted.items() if not k.endswith((".attn.bias",
                                                                       ".attn.masked_bias"))}
    theirs.load_state_dict(converted, strict=False)
    ids = _ids(seed)
    ours = hf_logits(_hf_from(root, tmp_path, "ours"), ids)
    assert (hf_logits(theirs, ids)[..., :VOCAB] - ours).abs().max().item() < 1e-6


def test_our_version_3_output_reads_back_exactly(reference, tmp_path, seed):
    model, expected = reference
    source, out = tmp_path / "megatron", tmp_path / "out"
    write_megatron_lm_files(source, model, 1, tp=2, seed=seed)
    run_conversion(ConversionRequest(str(source), str(out), output_format="megatron", tp=2,
                                     pp=2))
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "100"
    assert sorted(os.listdir(out / "iter_0000100")) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    first = torch.load(out / "iter_0000100" / "mp_rank_00_000" / "model_optim_rng.pt",
                       weights_only=False)
    assert first["checkpoint_version"] == 3.0 and isinstance(first["args"], argparse.Namespace)
    assert (first["args"].tensor_model_parallel_size,
            first["args"].pipeline_model_parallel_size) == (2, 2)
    assert "self_attention.query_key_value.weight" in " ".join(
        first["model"]["language_model"]["encoder"])
    back, original = read_megatron_lm(str(out)), read_megatron_lm(str(source))
    assert back.args["padded_vocab_size"] == original.args["padded_vocab_size"]
    assert all(torch.equal(back.state[k], original.state[k]) for k in original.state)
    # iteration 0 goes to release/, which Megatron-LM loads without optimizer or RNG state
    back.iteration, released = 0, tmp_path / "released"
    write_megatron_lm(back, str(released), tp=2, pp=1)
    assert (released / "latest_checkpointed_iteration.txt").read_text() == "release"
    assert sorted(os.listdir(released / "release")) == ["mp_rank_00", "mp_rank_01"]
    again = read_megatron_lm(str(released))
    assert again.iteration == 0
    assert all(torch.equal(again.state[k], original.state[k]) for k in original.state)


def test_unsafe_pickles_are_refused(reference, tmp_path):
    """A file pickling an object outside the allow-list is refused, its code never run."""
    model, _ = reference
    root = tmp_path / "megatron"
    write_megatron_lm_files(root, model, 3)
    path = root / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["optimizer"] = {"loss_scaler": _Marker()}
    torch.save(state, path)
    _Marker.created = 0
    with pytest.raises(CheckpointError, match="weights_only=True"):
        read_megatron_lm(str(root))
    assert _Marker.created == 0


class _Marker:
    created = 0

    def __setstate__(self, state):
        type(self).created += 1


def test_wrong_model_and_missing_files_are_reported(reference, tmp_path):
    model, _ = reference
    root = tmp_path / "megatron"
    write_megatron_lm_files(root, model, 3, tp=2)
    os.remove(root / "iter_0000100" / "mp_rank_01" / "model_optim_rng.pt")
    with pytest.raises(CheckpointError, match="missing"):
        read_megatron_lm(str(root))
    other = tmp_path / "post_ln"
    write_megatron_lm_files(other, model, 3)
    path = other / "iter_0000100" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["args"].apply_residual_connection_post_layernorm = True
    torch.save(state, path)
    with pytest.raises(ConfigError, match="post_layernorm"):
        read_megatron_lm(str(other))


def _train_from(argv):
    """Rank body: pretrain_gpt2.main(argv); (first iteration trained, losses, its output)."""
    import contextlib
    import io

    import pretrain_gpt2

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        state = pretrain_gpt2.main(argv)
    return state.iteration - len(state.losses), state.losses, out.getvalue()


def test_load_of_a_megatron_lm_checkpoint_trains(gpt2_data, tmp_path, seed):
    """``--load`` of a Megatron-LM folder (version 3, tp 2, saved at iteration 2) in a tp 1
    run continues from iteration 2 with the checkpoint's weights: the same loss as a
    ``--load`` of its conversion to a native checkpoint. The Megatron-LM folder has no
    manifest and the log says it was loaded unverified; the conversion has one, verified."""
    import json

    with open(gpt2_data["vocab"]) as handle:
        vocab = len(json.load(handle))
    model = make_hf_gpt2(tmp_path / "hf", seed, vocab, n_layer=2, n_embd=32, n_head=4,
                         n_positions=32)
    root, native = tmp_path / "megatron", tmp_path / "native"
    write_megatron_lm_files(root, model, 3, tp=2, iteration=2, seed=seed)
    run_conversion(ConversionRequest(str(root), str(native), tp=1, true_vocab=vocab,
                                     divisible_by=64))  # the run's padding
    runs = []
    for source, extra in ((root, ()), (native, ("--no-load-optim",))):
        argv = gpt2_argv(gpt2_data, "--load", str(source), "--train-iters", "3",
                         "--batch-size", "2", "--eval-iters", "0", "--hidden-dropout", "0",
                         "--attention-dropout", "0", *extra)
        runs.append(run_distributed(_train_from, 1, argv, timeout=240)[0])
    (start, losses, log), (native_start, native_losses, native_log) = runs
    assert start == native_start == 2 and len(losses) == 1 and np.isfinite(losses[0])
    assert losses == native_losses
    assert f"{root} is a Megatron-LM checkpoint: it has no manifest of digests, so its files " \
           f"were loaded unverified" in log, log
    assert "> verified the 1 checkpoint file(s) rank 0 read" in native_log, native_log
