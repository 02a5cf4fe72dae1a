"""tools/convert_checkpoint.py native -> native for a model without a key map: merged and
cut again by the sharding record the files carry (megatron/checkpoint/recorded_reshard.py).

A toy model of mpu layers (a strided column-parallel linear, a row-parallel linear, a
vocabulary-parallel embedding) checks the cut against the layers' own split, stride and
vocabulary re-padding included; the Llama example checks that a converted checkpoint holds
the same model and that runs resumed from it at the target tp continue as the original."""
import importlib.util
import os

import pytest
import torch

from harness import run_distributed
from llama_runs import llama_argv, train_llama

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRUE_VOCAB, DIVISIBLE_BY = 9, 2  # padded: 10 at tp 1, 12 at tp 2


def _convert(*argv):
    """tools/convert_checkpoint.py in this process (exit status 2 raises SystemExit)."""
    spec = importlib.util.spec_from_file_location(
        "convert_checkpoint", os.path.join(REPO, "tools", "convert_checkpoint.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([str(a) for a in argv])


def _toy_shards(seed):
    """Rank body (tp 2): the toy model's shards, their record and the master weights."""
    from megatron import mpu
    from megatron.checkpoint.sharding import sharding_record

    mpu.initialize_model_parallel(2, 1)
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.col = mpu.ColumnParallelLinear(6, 8, stride=2, keep_master_weight_for_test=True)
    model.row = mpu.RowParallelLinear(8, 6, keep_master_weight_for_test=True)
    model.emb = mpu.VocabParallelEmbedding(12, 6)
    masters = {"col.weight": model.col.master_weight.detach().numpy(),
               "row.weight": model.row.master_weight.detach().numpy()}
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return state, sharding_record(model), masters


def _save_toy(root, ranks):
    """Write the toy shards as a tp 2 checkpoint at iteration 3, as training saves one."""
    from megatron.checkpoint import checkpoint_name, write_tracker

    args = {"num_layers": 1, "hidden_size": 6, "num_attention_heads": 2,
            "padded_vocab_size": 12, "true_vocab_size": TRUE_VOCAB,
            "make_vocab_size_divisible_by": DIVISIBLE_BY, "tensor_model_parallel_size": 2,
            "pipeline_model_parallel_size": 1}
    for tp_rank, (state, record, _) in enumerate(ranks):
        path = checkpoint_name(root, 3, tp_rank, 0)
        os.makedirs(os.path.dirname(path))
        torch.save({"iteration": 3, "args": args, "family": "toy", "sharding": record,
                    "model": {k: torch.from_numpy(v) for k, v in state.items()},
                    "consumed_train_samples": 24}, path)
    write_tracker(root, 3)


def _files(root, tp):
    from megatron.checkpoint import checkpoint_name

    return [torch.load(checkpoint_name(root, 3, t, 0), weights_only=True) for t in range(tp)]


def test_toy_model_converts_by_its_record_stride_and_vocabulary(seed, tmp_path):
    ranks = run_distributed(_toy_shards, 2, seed, timeout=60)
    src, tp1, tp2 = (str(tmp_path / n) for n in ("src", "tp1", "tp2"))
    _save_toy(src, ranks)
    _convert("--input", src, "--output", tp1, "--target-tensor-parallel-size", 1)
    (one,) = _files(tp1, 1)
    masters = {k: torch.from_numpy(v) for k, v in ranks[0][2].items()}
    for key, master in masters.items():  # the strided column split undone exactly
        assert torch.equal(one["model"][key], master), key
    emb = torch.cat([torch.from_numpy(r[0]["emb.weight"]) for r in ranks])  # [12, 6]
    assert one["model"]["emb.weight"].shape == (10, 6)  # re-padded for tp 1
    assert torch.equal(one["model"]["emb.weight"][:TRUE_VOCAB], emb[:TRUE_VOCAB])
    assert not one["model"]["emb.weight"][TRUE_VOCAB:].any()  # the new padding row: zero
    assert one["sharding"] == ranks[0][1] and one["family"] == "toy"
    assert one["args"]["padded_vocab_size"] == 10 and one["consumed_train_samples"] == 24

    _convert("--input", tp1, "--output", tp2, "--target-tensor-parallel-size", 2)
    for t, back in enumerate(_files(tp2, 2)):  # each rank's own shards again
        state, record, _ = ranks[t]
        assert back["sharding"] == record and back["args"]["padded_vocab_size"] == 12
        for key in ("col.weight", "col.bias", "row.weight", "row.bias"):
            assert torch.equal(back["model"][key], torch.from_numpy(state[key])), (t, key)
        real = TRUE_VOCAB - 6 * t if t else 6  # rank 0: rows 0-5, rank 1: rows 6-8 real
        assert torch.equal(back["model"]["emb.weight"][:real],
                           torch.from_numpy(state["emb.weight"])[:real])
        assert not back["model"]["emb.weight"][real:].any()


def test_toy_model_refusals(seed, tmp_path, capsys):
    ranks = run_distributed(_toy_shards, 2, seed, timeout=60)
    src = str(tmp_path / "src")
    _save_toy(src, ranks)

    def fails(*argv):
        with pytest.raises(SystemExit) as info:
            _convert("--input", src, "--output", tmp_path / "out", *argv)
        assert info.value.code == 2
        assert not os.path.exists(tmp_path / "out" / "iter_0000003")
        return capsys.readouterr().err

    err = fails("--target-tensor-parallel-size", 3)
    assert "col.weight: dimension 0 (size 8) is not divisible by " \
           "--target-tensor-parallel-size 3 x its stride 2" in err
    assert "num_attention_heads (2) is not divisible" in err
    err = fails("--target-tensor-parallel-size", 4)  # 8 rows, 4 ranks x stride 2: fits
    assert "col.weight" not in err and "num_attention_heads (2)" in err
    err = fails("--target-pipeline-parallel-size", 2)
    assert "'toy' model, which has no key map" in err and "resuming a run" in err
    err = fails("--output-format", "hf")
    assert "holds a 'toy' model, not 'gpt2'" in err


# ---------------------------------------------------------------- the Llama example
STEPS, MORE = 4, 2
#: --make-vocab-size-divisible-by such that the padded vocabulary differs at tp 1 and 2
LLAMA_DIVISIBLE_BY = "80"


def _argv(data, tp, pp, steps, *extra, vpp=1):
    return llama_argv(data, tp, pp, "--make-vocab-size-divisible-by", LLAMA_DIVISIBLE_BY,
                      *extra, steps=steps, vpp=vpp)


def _same_model(a, b):
    from megatron.checkpoint.native_reader import read_native

    full_a, full_b = read_native(a).state, read_native(b).state
    assert sorted(full_a) == sorted(full_b) and len(full_a) == 4 * 9 + 3
    for key, tensor in full_a.items():
        assert torch.equal(tensor, full_b[key]), key


def _saved(root):
    from megatron.checkpoint import checkpoint_name

    return torch.load(checkpoint_name(root, STEPS, 0, 0), weights_only=True)


def _converted_resume_as_the_source(data, tmp_path, source, chain, vpp=1):
    """Train at ``source`` (tp, pp) with ``vpp`` chunks per stage, convert along ``chain``
    (each (tp, pp) from the previous output; the chunks stay where pp does), and check (a)
    every converted checkpoint merges to the source's tensors exactly and (b) resumed at its
    layout with a fresh Adam, it gives the losses of resuming the source at its own.

    Returns:
        the padded vocabulary sizes and the folders, by name ("src", then "tp{t}_pp{p}").
    """
    roots, layouts = {"src": str(tmp_path / "src")}, {"src": source}
    run_distributed(train_llama, source[0] * source[1], _argv(
        data, *source, STEPS, "--save", roots["src"], "--save-interval", str(STEPS), vpp=vpp),
        timeout=300)
    previous = roots["src"]
    for tp, pp in chain:
        name = f"tp{tp}_pp{pp}"
        roots[name], layouts[name] = str(tmp_path / name), (tp, pp)
        _convert("--input", previous, "--output", roots[name],
                 "--target-tensor-parallel-size", tp, "--target-pipeline-parallel-size", pp)
        _same_model(roots["src"], roots[name])  # (a)
        previous = roots[name]
    resumed = {}
    for name, root in roots.items():
        tp, pp = layouts[name]
        ranks = run_distributed(train_llama, tp * pp, _argv(
            data, tp, pp, STEPS + MORE, "--load", root, "--no-load-optim",
            vpp=vpp if pp == source[1] else 1), timeout=300)
        resumed[name] = ranks[-1]
    rows = {name: _saved(root)["args"]["padded_vocab_size"] for name, root in roots.items()}
    print(f"padded vocabulary {rows}; losses after the resume: {resumed}")
    assert len(resumed["src"]) == MORE, resumed
    for name in roots:  # (b) the same next-step losses as resuming the original
        for ours, theirs in zip(resumed[name], resumed["src"]):
            assert abs(ours - theirs) <= 1e-5 * abs(theirs), (name, resumed)
    return rows, roots


@pytest.mark.slow
def test_llama_tp2_to_tp1_and_back_resumes_with_the_same_losses(gpt2_data, tmp_path):
    rows, _ = _converted_resume_as_the_source(gpt2_data, tmp_path, (2, 1), [(1, 1), (2, 1)])
    assert rows["src"] == rows["tp2_pp1"] != rows["tp1_pp1"], rows  # re-padded for tp 1


@pytest.mark.slow
def test_llama_pipeline_stages_kept_or_merged(gpt2_data, tmp_path):
    """pp 2 -> (tp 2, pp 2): each stage's tensors stay on it; -> (tp 1, pp 1): one stage;
    -> pp 4: refused (the record does not say how the model partitions its layers)."""
    _, roots = _converted_resume_as_the_source(gpt2_data, tmp_path, (1, 2), [(2, 2), (1, 1)])
    src = {p: set(torch.load(os.path.join(roots["src"], f"iter_{STEPS:07d}",
                                          f"mp_rank_00_{p:03d}", "model_optim_rng.pt"),
                             weights_only=True)["model"]) for p in range(2)}
    for t in range(2):
        for p in range(2):
            path = os.path.join(roots["tp2_pp2"], f"iter_{STEPS:07d}",
                                f"mp_rank_{t:02d}_{p:03d}", "model_optim_rng.pt")
            state = torch.load(path, weights_only=True)
            assert set(state["model"]) == src[p] == set(state["sharding"]), (t, p)
            assert {spec[3] for spec in state["sharding"].values()} == {p}
    merged = _saved(roots["tp1_pp1"])
    assert set(merged["model"]) == src[0] | src[1]
    assert {tuple(spec[3:5]) for spec in merged["sharding"].values()} == {(0, 0)}
    from megatron.checkpoint_conversion import ConversionRequest, run_conversion
    from megatron.common.errors import ConfigError

    with pytest.raises(ConfigError, match="changes in a conversion only to 1"):
        run_conversion(ConversionRequest(roots["src"], str(tmp_path / "pp4"), pp=4))


@pytest.mark.slow
def test_llama_virtual_chunks_kept(gpt2_data, tmp_path):
    """pp 2 with 2 chunks per stage -> tp 2: the chunks stay (the files of an interleaved run
    at tp 2 load as saved), and -> one stage."""
    _, roots = _converted_resume_as_the_source(gpt2_data, tmp_path, (1, 2), [(2, 2), (1, 1)],
                                               vpp=2)
    from megatron.checkpoint.chunks import vpp_of

    assert vpp_of(_saved(roots["tp2_pp2"])["args"]) == 2
    assert {spec[4] for spec in _saved(roots["tp2_pp2"])["sharding"].values()} == {0, 2}


def test_tied_tensor_merges_to_one_stage_when_its_copies_agree():
    """A tensor held by several stages (a tied module, chunk -1) keeps its stages, or becomes
    one stage's when every stage holds the same copy (megatron.model.spec_model.SpecModel
    names it as the pipeline does); copies that differ (a tied module holding more than its
    tied weight, stale on one stage) are refused by name, found tp rank by tp rank."""
    from megatron.checkpoint.native_reader import FullCheckpoint, stage_copies_differ
    from megatron.checkpoint.recorded_reshard import check_recorded_layout
    from megatron.common.errors import ConfigError

    weight, stale = torch.randn(8, 4), torch.randn(3, 4)
    state = {"tied_modules.embed.weight": weight, "tied_modules.embed.pos": stale,
             "1.w": torch.randn(4, 4)}
    records = {0: {"tied_modules.embed.weight": [0, 1, 1, 0, -1],
                   "tied_modules.embed.pos": [-1, 1, 0, 0, -1], "1.w": [-1, 1, 0, 0, 0]},
               1: {"tied_modules.embed.weight": [0, 1, 1, 1, -1],
                   "tied_modules.embed.pos": [-1, 1, 0, 1, -1]}}
    files = {(t, p): {"tied_modules.embed.weight": weight.chunk(2)[t].clone(),
                      "tied_modules.embed.pos": stale + p} for t in (0, 1) for p in (0, 1)}
    differ = stage_copies_differ(files)
    assert differ == ["tied_modules.embed.pos"]
    ckpt = FullCheckpoint(state, {"pipeline_model_parallel_size": 2}, stage_records=records,
                          family="toy", differing_copies=differ)
    check_recorded_layout(ckpt, 2, 2)
    with pytest.raises(ConfigError, match=r"tied_modules.embed.pos is held by several "
                                          r"pipeline stages \(a tied module\) and the copies "
                                          r"differ.*tied_embedding_specs"):
        check_recorded_layout(ckpt, 2, 1)
    # the tied weight alone: its copies agree, so one stage takes it
    weight_only = {k: {"tied_modules.embed.weight": v["tied_modules.embed.weight"]}
                   for k, v in files.items()}
    assert stage_copies_differ(weight_only) == []
    del state["tied_modules.embed.pos"]
    for record in records.values():
        del record["tied_modules.embed.pos"]
    check_recorded_layout(FullCheckpoint(state, {"pipeline_model_parallel_size": 2},
                                         stage_records=records, family="toy"), 2, 1)
    with pytest.raises(ConfigError, match=r"dimension 0 \(size 8\) is not divisible by "
                                          r"--target-tensor-parallel-size 3"):
        check_recorded_layout(ckpt, 3, 2)
