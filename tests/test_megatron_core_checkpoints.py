"""Megatron-Core GPT checkpoints (legacy ``mp_rank_*`` and ``torch_dist``) in and out.

The checkpoints are built here independently of the project's reader, from a random
transformers ``GPT2LMHeadModel`` (the reference), following Megatron-Core's own code: the
key names of ``GPTModel`` (``megatron/core/models/gpt``: the local spec's module names in
legacy files, TransformerEngine's fused-norm names in ``torch_dist``, which the local spec
maps its own to), the layer stacking of ``TransformerBlock.sharded_state_dict`` (a first
dimension of ``num_layers``, chunked by pipeline stage), the tensor-parallel splits of its
linear layers, ``_extra_state`` entries, and the common state (``common.pt`` up to 0.18, the
``common_state`` object from 0.19) with Megatron-Core's enums in the args. The
``torch_dist`` folders are written with torch DCP directly, by tp x pp ranks each saving
its DTensor shards.

- read at tp 2 and tp 2 x pp 2 (both formats): the reference's tensors exactly; converted
  to Hugging Face (format detected), the reference's logits; ``--load`` in a run at another
  layout, the reference's logits;
- native -> torch_dist (tp 2, pp 2) -> native is exact, and DCP reads the written folder
  with the names, shapes and chunks Megatron-Core expects (the list below);
- megatron-core itself installed beside this package: tests/test_megatron_core_installed.py.
"""
import argparse
import enum
import io
import os
import subprocess
import sys
import types
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from gpt2_hf import hf_logits, make_hf_gpt2
from gpt2_runs import REPO, gpt2_argv
from harness import run_distributed

LAYERS, HIDDEN, HEADS, POSITIONS, VOCAB, DIVISIBLE_BY = 4, 32, 4, 16, 100, 8

# ---------------------------------------------------------------- Megatron-Core's names
#: Per-layer tensors of GPTModel built as GPT-2: legacy (module) name, torch_dist name,
#: tensor-parallel split dimension (None: replicated), as megatron-core's local spec /
#: TransformerEngine spec and ColumnParallelLinear / RowParallelLinear define them.
CORE_LAYER = [
    ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight", None),
    ("input_layernorm.bias", "self_attention.linear_qkv.layer_norm_bias", None),
    ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.weight", 0),
    ("self_attention.linear_qkv.bias", "self_attention.linear_qkv.bias", 0),
    ("self_attention.linear_proj.weight", "self_attention.linear_proj.weight", 1),
    ("self_attention.linear_proj.bias", "self_attention.linear_proj.bias", None),
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight", None),
    ("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias", None),
    ("mlp.linear_fc1.weight", "mlp.linear_fc1.weight", 0),
    ("mlp.linear_fc1.bias", "mlp.linear_fc1.bias", 0),
    ("mlp.linear_fc2.weight", "mlp.linear_fc2.weight", 1),
    ("mlp.linear_fc2.bias", "mlp.linear_fc2.bias", None),
]
CORE_TOP = [("embedding.word_embeddings.weight", 0), ("embedding.position_embeddings.weight",
                                                      None),
            ("decoder.final_layernorm.weight", None), ("decoder.final_layernorm.bias", None)]
EXTRA_LOCAL = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1",
               "mlp.linear_fc2")


def core_dist_shapes(layers=LAYERS, hidden=HIDDEN, vocab_padded=104, positions=POSITIONS):
    """``{torch_dist name: global shape}`` of a GPT-2-shaped GPTModel (layers stacked)."""
    ffn = 4 * hidden
    per_layer = {"self_attention.linear_qkv.layer_norm_weight": (hidden,),
                 "self_attention.linear_qkv.layer_norm_bias": (hidden,),
                 "self_attention.linear_qkv.weight": (3 * hidden, hidden),
                 "self_attention.linear_qkv.bias": (3 * hidden,),
                 "self_attention.linear_proj.weight": (hidden, hidden),
                 "self_attention.linear_proj.bias": (hidden,),
                 "mlp.linear_fc1.layer_norm_weight": (hidden,),
                 "mlp.linear_fc1.layer_norm_bias": (hidden,),
                 "mlp.linear_fc1.weight": (ffn, hidden), "mlp.linear_fc1.bias": (ffn,),
                 "mlp.linear_fc2.weight": (hidden, ffn), "mlp.linear_fc2.bias": (hidden,)}
    shapes = {f"decoder.layers.{k}": (layers, *v) for k, v in per_layer.items()}
    shapes.update({"embedding.word_embeddings.weight": (vocab_padded, hidden),
                   "embedding.position_embeddings.weight": (positions, hidden),
                   "decoder.final_layernorm.weight": (hidden,),
                   "decoder.final_layernorm.bias": (hidden,)})
    return shapes


def _padded(tp, vocab=VOCAB):
    multiple = DIVISIBLE_BY * tp  # Megatron-LM's _vocab_size_with_padding
    return (vocab + multiple - 1) // multiple * multiple


def core_tensors(hf_model, tp, seed):
    """``({legacy layer name: [L x full tensor]}, {top name: full tensor})`` of the
    reference under Megatron-Core's names (whole tensors, vocabulary padded for ``tp``)."""
    hf = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}
    per_head = HIDDEN // HEADS

    def qkv(t):  # HF rows [q_all | k_all | v_all] -> Megatron-Core's per head [np, 3, hn]
        return t.reshape(3, HEADS, per_head, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    layers = {name: [] for name, _, _ in CORE_LAYER}
    for i in range(LAYERS):
        p = f"transformer.h.{i}."
        t = {k[len(p):]: v for k, v in hf.items() if k.startswith(p)}
        values = [t["ln_1.weight"], t["ln_1.bias"], qkv(t["attn.c_attn.weight"].t()),
                  qkv(t["attn.c_attn.bias"]), t["attn.c_proj.weight"].t(), t["attn.c_proj.bias"],
                  t["ln_2.weight"], t["ln_2.bias"], t["mlp.c_fc.weight"].t(), t["mlp.c_fc.bias"],
                  t["mlp.c_proj.weight"].t(), t["mlp.c_proj.bias"]]  # Conv1D [in, out] -> [out, in]
        for (name, _, _), value in zip(CORE_LAYER, values):
            layers[name].append(value.contiguous())
    g = torch.Generator().manual_seed(seed)
    vocab = hf_model.config.vocab_size
    words = torch.cat([hf["transformer.wte.weight"],
                       torch.randn(_padded(tp, vocab) - vocab, HIDDEN, generator=g)])  # padding
    top = {"embedding.word_embeddings.weight": words,
           "embedding.position_embeddings.weight": hf["transformer.wpe.weight"],
           "decoder.final_layernorm.weight": hf["transformer.ln_f.weight"],
           "decoder.final_layernorm.bias": hf["transformer.ln_f.bias"]}
    return layers, top


# ---------------------------------------------------------------- Megatron-Core's objects
class AttnBackend(enum.Enum):  # pickled as megatron.core.transformer.enums.AttnBackend
    auto = 5


class RerunMode(enum.Enum):  # pickled as megatron.core.rerun_state_machine.RerunMode
    disabled = "disabled"


@contextmanager
def _as_megatron_core_types():
    """Pickle the two enums under megatron-core's names (no megatron-core needed)."""
    fakes = {"megatron.core.transformer.enums": AttnBackend,
             "megatron.core.rerun_state_machine": RerunMode}
    saved = {}
    for module, cls in fakes.items():
        fake = types.ModuleType(module)
        setattr(fake, cls.__name__, cls)
        saved[module] = (sys.modules.get(module), cls.__module__)
        sys.modules[module], cls.__module__ = fake, module
    try:
        yield
    finally:
        for module, (old, name) in saved.items():
            fakes[module].__module__ = name
            if old is None:
                sys.modules.pop(module, None)
            else:
                sys.modules[module] = old


def core_args(tp, pp, vocab):
    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
        ffn_hidden_size=4 * HIDDEN, kv_channels=HIDDEN // HEADS, num_query_groups=HEADS,
        group_query_attention=False, max_position_embeddings=POSITIONS, seq_length=POSITIONS,
        padded_vocab_size=_padded(tp, vocab), make_vocab_size_divisible_by=DIVISIBLE_BY,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        position_embedding_type="learned_absolute", normalization="LayerNorm",
        add_bias_linear=True, swiglu=False, untie_embeddings_and_output_weights=False,
        tokenizer_type="GPT2BPETokenizer", attention_backend=AttnBackend.auto,
        params_dtype=torch.float32, consumed_train_samples=64, consumed_valid_samples=8,
        ckpt_format="torch_dist")


def common_state(tp, pp, iteration, vocab):
    with _as_megatron_core_types():
        return {"args": core_args(tp, pp, vocab), "checkpoint_version": 3.0, "iteration": iteration,
                "rerun_state_machine": {"mode": RerunMode.disabled}}


def _pickled(obj):
    buffer = io.BytesIO()
    with _as_megatron_core_types():
        torch.save(obj, buffer)
    return buffer.getvalue()


# ---------------------------------------------------------------- the two writers
def write_legacy(root, hf_model, tp, pp, spec="local", iteration=10, seed=0):
    """Megatron-LM's ``--ckpt-format torch`` save of GPTModel: per rank the flat
    ``state_dict()`` with stage-local layer numbers, the last of several stages holding
    ``output_layer.weight`` (the tied copy)."""
    layers, top = core_tensors(hf_model, tp, seed)
    te = {legacy: dist for legacy, dist, _ in CORE_LAYER}
    split = {legacy: dim for legacy, _, dim in CORE_LAYER}
    per_stage = LAYERS // pp
    folder = root / f"iter_{iteration:07d}"
    for stage in range(pp):
        for rank in range(tp):
            def shard(t, dim):
                return t.clone() if dim is None else torch.chunk(t, tp, dim)[rank].clone()

            model = {}
            if stage == 0:
                model["embedding.word_embeddings.weight"] = shard(
                    top["embedding.word_embeddings.weight"], 0)
                model["embedding.position_embeddings.weight"] = \
                    top["embedding.position_embeddings.weight"].clone()
            for local in range(per_stage):
                prefix = f"decoder.layers.{local}."
                for name, values in layers.items():
                    key = te[name] if spec == "te" else name
                    model[prefix + key] = shard(values[stage * per_stage + local], split[name])
                extras = EXTRA_LOCAL + (("self_attention.core_attention",) if spec == "te"
                                        else ())
                for module in extras:  # TE keeps bytes there, the local spec None
                    model[f"{prefix}{module}._extra_state"] = io.BytesIO(b"") if spec == "te" \
                        else None
            if stage == pp - 1:
                model["decoder.final_layernorm.weight"] = top["decoder.final_layernorm.weight"]
                model["decoder.final_layernorm.bias"] = top["decoder.final_layernorm.bias"]
                model["output_layer._extra_state"] = None
                if pp > 1:
                    model["output_layer.weight"] = shard(top["embedding.word_embeddings.weight"],
                                                         0)
            state = dict(common_state(tp, pp, iteration, hf_model.config.vocab_size), model=model,
                         rng_state=[{"random_rng_state": (3, tuple(range(5)), None),
                                     "np_rng_state": np.random.RandomState(seed).get_state(),
                                     "torch_rng_state": torch.get_rng_state()}])
            sub = f"mp_rank_{rank:02d}" if pp == 1 else f"mp_rank_{rank:02d}_{stage:03d}"
            os.makedirs(folder / sub)
            with _as_megatron_core_types():
                torch.save(state, folder / sub / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))


def _save_dist_rank(folder, tensors, splits, objects, tp, pp):
    """Rank body: this rank's DTensor shards of every tensor, saved with torch DCP; objects
    stored as their bytes, as megatron-core's MCoreSavePlanner does (DCP's default planner
    would pickle the BytesIO once more)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))
    stage, rank = mesh.get_coordinate()
    state = {}
    for name, tensor in tensors.items():
        stacked, dim = name.startswith("decoder.layers."), splits[name]
        local = tensor
        if stacked:  # [L, ...]: this stage's layers
            local = torch.chunk(local, pp, 0)[stage]
        if dim is not None:
            local = torch.chunk(local, tp, dim)[rank]
        placements = [Shard(0) if stacked else Replicate(),
                      Shard(dim) if dim is not None else Replicate()]
        state[name] = DTensor.from_local(local.contiguous(), mesh, placements, run_check=False)
    for key, data in objects.items():
        state[key] = io.BytesIO(data)
    class RawBytes(DefaultSavePlanner):
        def transform_object(self, write_item, obj):
            return obj

    dcp.save(state, checkpoint_id=folder, planner=RawBytes())
    return stage, rank


def write_dist(root, hf_model, tp, pp, common_in_file=False, iteration=10, seed=0):
    """Megatron-Core's ``dist_checkpointing.save`` (torch_dist) of GPTModel at tp x pp: the
    layers stacked on a first dimension, the local spec's extra states, the common state as
    ``common.pt`` (<= 0.18) or the ``common_state`` object (0.19)."""
    layers, top = core_tensors(hf_model, tp, seed)
    vocab = hf_model.config.vocab_size
    tensors, splits = dict(top), {name: dim for name, dim in CORE_TOP}
    for legacy, dist, dim in CORE_LAYER:
        tensors[f"decoder.layers.{dist}"] = torch.stack(layers[legacy])  # L x [...] -> [L, ...]
        splits[f"decoder.layers.{dist}"] = None if dim is None else dim + 1
    objects = {f"decoder.layers.{m}._extra_state/shard_{i}_{LAYERS}": _pickled([None])
               for m in EXTRA_LOCAL for i in range(LAYERS)}
    folder = root / f"iter_{iteration:07d}"
    if not common_in_file:
        objects["common_state/shard_0_1"] = _pickled([common_state(tp, pp, iteration, vocab)])
    run_distributed(_save_dist_rank, tp * pp, str(folder), tensors, splits, objects, tp, pp,
                    timeout=240)
    if common_in_file:
        with _as_megatron_core_types():
            torch.save(common_state(tp, pp, iteration, vocab), folder / "common.pt")
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist", '
                                          '"sharded_backend_version": 1}')
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))


# ---------------------------------------------------------------- fixtures and helpers
@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The reference GPT2LMHeadModel (random, fp32, no dropout) and its full state."""
    from megatron.checkpoint_conversion.hf_gpt2 import args_from_hf_config, hf_to_full

    path = tmp_path_factory.mktemp("reference")
    model = make_hf_gpt2(path / "hf", 4321, VOCAB, n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS,
                         n_positions=POSITIONS)
    return model, hf_to_full(model.state_dict(), args_from_hf_config(model.config.to_dict()))


def _ids(seed, vocab=VOCAB):
    return torch.randint(0, vocab, (2, POSITIONS), generator=torch.Generator().manual_seed(seed))


def _hf_logits_of(root, tmp_path, seed):
    """Our conversion of ``root`` (format detected) to HF, loaded with transformers: its
    logits, and the words the tool printed for the format."""
    from transformers import GPT2LMHeadModel

    out = tmp_path / "hf_out"
    done = subprocess.run([sys.executable, os.path.join(REPO, "tools", "convert_checkpoint.py"),
                           "--input", str(root), "--output", str(out), "--output-format", "hf",
                           "--true-vocab-size", str(VOCAB)],
                          capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert done.returncode == 0, done.stderr[-2000:]
    return hf_logits(GPT2LMHeadModel.from_pretrained(str(out)).eval(), _ids(seed)), done.stdout


def _check_reads_reference(root, reference, tp, pp):
    from megatron.checkpoint import megatron_core

    _, expected = reference
    ckpt = megatron_core.read_full(str(root))
    assert sorted(ckpt.state) == sorted(expected)
    for key, tensor in expected.items():
        got = ckpt.state[key][:VOCAB] if key.endswith("word_embeddings.weight") else \
            ckpt.state[key]
        assert torch.equal(got, tensor), key
    assert (ckpt.args["tensor_model_parallel_size"], ckpt.args["pipeline_model_parallel_size"],
            ckpt.args["num_attention_heads"], ckpt.args["padded_vocab_size"]) == \
        (tp, pp, HEADS, _padded(tp))
    assert ckpt.iteration == 10 and ckpt.extras["consumed_train_samples"] == 64


DIST_CASES = [(2, 1, False), (2, 2, True)]


@pytest.mark.parametrize("tp,pp,common_in_file", DIST_CASES,
                         ids=[f"tp{c[0]}-pp{c[1]}-{'common.pt' if c[2] else 'common_state'}"
                              for c in DIST_CASES])
def test_torch_dist_reads_the_reference(reference, tmp_path, seed, tp, pp, common_in_file):
    model, _ = reference
    root = tmp_path / "mcore"
    write_dist(root, model, tp, pp, common_in_file, seed=seed)
    _check_reads_reference(root, reference, tp, pp)
    logits, said = _hf_logits_of(root, tmp_path, seed)
    assert "Megatron-Core torch_dist checkpoint" in said
    assert (logits - hf_logits(model, _ids(seed))).abs().max().item() < 1e-5


LEGACY_CASES = [(2, 1, "local"), (2, 2, "te")]


@pytest.mark.parametrize("tp,pp,spec", LEGACY_CASES,
                         ids=[f"tp{c[0]}-pp{c[1]}-{c[2]}" for c in LEGACY_CASES])
def test_legacy_reads_the_reference(reference, tmp_path, seed, tp, pp, spec):
    model, _ = reference
    root = tmp_path / "mcore"
    write_legacy(root, model, tp, pp, spec, seed=seed)
    _check_reads_reference(root, reference, tp, pp)
    logits, said = _hf_logits_of(root, tmp_path, seed)
    assert "Megatron-Core legacy checkpoint" in said
    assert (logits - hf_logits(model, _ids(seed))).abs().max().item() < 1e-5


def _load_and_logits(argv, ids):
    """Rank body: ``--load`` through the training path (load_checkpoint), then the loaded
    model's gathered logits ``[b, s, v_pad]`` and the iteration."""
    import torch.distributed as dist

    from megatron import mpu
    from megatron.families.gpt2 import FAMILY
    from megatron.initialize import initialize_megatron
    from megatron.model.utils import causal_attention_mask
    from megatron.training.backend_factory import build_backend
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.loop import TrainState

    cfg = initialize_megatron(None, {}, argv, family=FAMILY)
    backend = build_backend(cfg, lambda pipeline=False: FAMILY.build_model(cfg, pipeline))
    state = TrainState()
    iteration = load_checkpoint(backend, cfg, state)
    model = backend.module()
    b, s = ids.shape
    with torch.no_grad():
        local = model(ids, torch.arange(s).expand(b, s), causal_attention_mask(s, ids.device))
    parts = [torch.empty_like(local) for _ in range(mpu.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local.contiguous(), group=mpu.get_tensor_model_parallel_group())
    return torch.cat(parts, -1).numpy(), iteration, state.consumed_train_samples


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
def test_load_continues_from_it(gpt2_data, tmp_path, seed, fmt):
    """``--load`` of a tp 2 x pp 2 Megatron-Core checkpoint in a tp 2 run (and pp 1): the
    reference's logits, its iteration and consumed samples."""
    import json

    with open(gpt2_data["vocab"]) as handle:
        vocab = len(json.load(handle))
    model = make_hf_gpt2(tmp_path / "hf", seed, vocab, n_layer=LAYERS, n_embd=HIDDEN,
                         n_head=HEADS, n_positions=POSITIONS)
    root = tmp_path / "mcore"
    (write_dist if fmt == "torch_dist" else write_legacy)(root, model, 2, 2, seed=seed)
    argv = gpt2_argv(gpt2_data, "--load", str(root), "--num-layers", str(LAYERS),
                     "--seq-length", str(POSITIONS), "--max-position-embeddings",
                     str(POSITIONS), "--model-parallel-size", "2", "--train-iters", "20",
                     "--batch-size", "2", "--hidden-dropout", "0", "--attention-dropout", "0",
                     "--no-load-optim")
    ids = _ids(seed, vocab)
    results = run_distributed(_load_and_logits, 2, argv, ids, timeout=300)
    logits, iteration, consumed = results[0]
    assert iteration == 10 and consumed == 64
    err = np.abs(logits[..., :vocab] - hf_logits(model, ids).numpy()).max()
    assert err < 1e-5, err


# ---------------------------------------------------------------- writing torch_dist
def test_round_trip_and_the_written_layout(reference, tmp_path, seed):
    """native -> torch_dist (tp 2, pp 2) -> native is exact; DCP reads the written folder
    with Megatron-Core's names and global shapes, each tensor in the chunks of tp 2 x pp 2."""
    from torch.distributed.checkpoint import FileSystemReader

    from megatron.checkpoint import megatron_core, read_native
    from megatron.checkpoint_conversion import ConversionRequest, run_conversion

    model, expected = reference
    source = tmp_path / "mcore_in"
    write_legacy(source, model, 1, 1, seed=seed)
    native, out, back = tmp_path / "native", tmp_path / "mcore_out", tmp_path / "back"
    # native at tp 2 first: the padded vocabulary (112 rows) then stays the same throughout
    run_conversion(ConversionRequest(str(source), str(native), tp=2, pp=1, true_vocab=VOCAB))
    run_conversion(ConversionRequest(str(native), str(out), output_format="megatron-core",
                                     tp=2, pp=2))
    folder = out / "iter_0000010"
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "10"
    metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata  # DCP's own
    shapes = core_dist_shapes(vocab_padded=_padded(2))
    tensors = {k: v for k, v in metadata.items() if hasattr(v, "size")}
    assert {k: tuple(v.size) for k, v in tensors.items()} == shapes
    split = {f"decoder.layers.{dist}": (None if dim is None else dim + 1)
             for _, dist, dim in CORE_LAYER}
    split.update(dict(CORE_TOP))
    for key, meta in tensors.items():
        layer_cuts = [0, LAYERS // 2] if key.startswith("decoder.layers.") else [0]
        dim = split[key]
        tp_cuts = [0, shapes[key][dim] // 2] if dim is not None else [0]
        offsets = sorted(tuple(c.offsets) for c in meta.chunks)
        want = sorted(tuple(l if d == 0 and key.startswith("decoder.layers.") else
                            (t if d == dim else 0) for d in range(len(shapes[key])))
                      for l in layer_cuts for t in tp_cuts)
        assert offsets == want, key
    for module in EXTRA_LOCAL:  # what a local-spec GPTModel asks for when it loads
        assert f"decoder.layers.{module}._extra_state/shard_3_{LAYERS}" in metadata
    assert megatron_core.describe(str(out)).startswith("Megatron-Core torch_dist")
    run_conversion(ConversionRequest(str(out), str(back), tp=2, pp=1))
    original, again = read_native(str(native)), read_native(str(back))
    assert sorted(again.state) == sorted(original.state)
    assert all(torch.equal(again.state[k], original.state[k]) for k in original.state)
    assert again.iteration == 10 and again.extras["consumed_train_samples"] == 64
    with torch.serialization.safe_globals([argparse.Namespace]):  # as megatron-core allows
        common = torch.load(folder / "common.pt", weights_only=True)
    assert (common["args"].tensor_model_parallel_size, common["args"].num_layers,
            common["args"].position_embedding_type) == (2, LAYERS, "learned_absolute")


# ---------------------------------------------------------------- failing well
def test_what_it_cannot_read_is_named(reference, tmp_path, seed, capsys):
    """An untied head, MoE tensors, a .metadata pickling code, an unknown folder: each
    refused by name, and the pickled code never runs."""
    from megatron.checkpoint import megatron_core
    from megatron.checkpoint_conversion import ConversionRequest, run_conversion
    from megatron.common.errors import CheckpointError

    model, _ = reference
    root, dist = tmp_path / "untied", tmp_path / "dist"
    write_legacy(root, model, 1, 1, seed=seed)
    run_conversion(ConversionRequest(str(root), str(dist), output_format="megatron-core"))
    path = root / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    with _as_megatron_core_types():  # written by this test
        state = torch.load(path, weights_only=False)
    state["model"]["output_layer.weight"] = state["model"]["embedding.word_embeddings.weight"]
    with _as_megatron_core_types():
        torch.save(state, path)
    with pytest.raises(CheckpointError, match="untied output layer"):
        megatron_core.read_full(str(root))
    state["model"].pop("output_layer.weight")
    state["model"]["decoder.layers.0.mlp.router.weight"] = torch.zeros(4, HIDDEN)
    with _as_megatron_core_types():
        torch.save(state, path)
    with pytest.raises(CheckpointError, match="mixture of experts"):
        megatron_core.read_full(str(root))
    os.environ["MCORE_TEST_TMP"] = str(tmp_path)
    with open(dist / "iter_0000010" / ".metadata", "wb") as handle:
        handle.write(_pickled_call())
    with pytest.raises(CheckpointError, match="not one of torch DCP's metadata types"):
        megatron_core.read_full(str(dist))
    assert not os.path.exists(tmp_path / "ran")
    other = tmp_path / "other"
    os.makedirs(other / "weights")
    with pytest.raises(CheckpointError, match=r"it holds weights; that is no checkpoint"):
        run_conversion(ConversionRequest(str(other), str(tmp_path / "o")))


class _Runs:
    def __reduce__(self):
        return (os.mkdir, (os.path.join(os.environ["MCORE_TEST_TMP"], "ran"),))


def _pickled_call():
    import pickle

    return pickle.dumps(_Runs())
