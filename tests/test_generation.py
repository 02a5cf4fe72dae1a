"""Text generation: KV cache vs full recompute, HF generate, tp=2 vs tp=1, sampling filters.

The model is a random HF GPT-2 converted to native (the conversion itself is tested against
transformers in test_conversion_hf.py), so HF's ``generate`` is a reference for greedy.
"""
import os
import random
import re

import pytest
import torch

from gpt2_hf import make_hf_gpt2
from gpt2_runs import REPO, run_script
from harness import run_distributed
from megatron.checkpoint_conversion import ConversionRequest, run_conversion
from megatron.generation.text_generation import SamplingConfig, filter_top_k, filter_top_p, sample

VOCAB = 300  # padded to 384 (tp=1) / 512 (tp=2)
MAX_NEW = 16
SAMPLED = dict(top_k=20, top_p=0.9, temperature=0.8)
TOOL = os.path.join(REPO, "tools", "generate_samples_gpt2.py")


@pytest.fixture(scope="module")
def module_seed():
    value = int(os.environ.get("MEGATRON_TEST_SEED") or random.SystemRandom().randrange(2**31))
    print(f"module seed={value} (rerun with MEGATRON_TEST_SEED={value})")
    return value


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, module_seed):
    """A random HF GPT-2 and its native conversions at tp=1 and tp=2."""
    root = tmp_path_factory.mktemp("gen")
    hf = make_hf_gpt2(root / "hf", module_seed, VOCAB)
    for tp in (1, 2):
        run_conversion(ConversionRequest(str(root / "hf"), str(root / f"tp{tp}"), tp=tp))
    return hf, root


def _prompts(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 14)]


def _generate_each(model, prompts, runs):
    """``{name: generate(...)}`` for each ``name: (sampling kwargs, use_cache, eod)``."""
    from megatron.generation.text_generation import generate

    return {name: generate(model, prompts, MAX_NEW, VOCAB,
                           SamplingConfig(**kwargs) if kwargs else None, eod, use_cache)
            for name, (kwargs, use_cache, eod) in runs.items()}


def _boost_padding(model, prompt):
    """Give the padded rows logits that would win every argmax, and turn the model's own
    padding mask off (so generate()'s cut-off is what the decodes test); True if they win.
    Also returns whether, with the mask on, those logits are -inf."""
    weight = model.word_embeddings_weight()  # [v_pad / tp, h]
    start = model.embedding.word_embeddings.vocab_start_index
    ids = torch.tensor([prompt])
    with torch.no_grad():
        rows = torch.arange(start, start + weight.shape[0]) >= VOCAB
        weight[rows] = 50.0 * torch.randn(int(rows.sum()), weight.shape[1])
        masked = model(ids, torch.arange(ids.shape[1])[None], None)[0, -1]
        model.config.true_vocab_size = None
        logits = model(ids, torch.arange(ids.shape[1])[None], None)[0, -1]
    return (bool(logits[VOCAB:].max() > logits[:VOCAB].max()),
            bool(torch.isneginf(masked[VOCAB:]).all()))


def _decode_all(ckpt_dir, prompts, seed):
    """Rank body: every decode the tests check, from one model load at this group's tp."""
    import torch.distributed as dist

    from megatron import mpu
    from megatron.generation.inference import load_gpt2_for_inference
    from megatron.generation.text_generation import generate

    mpu.initialize_model_parallel(dist.get_world_size(), 1)
    mpu.model_parallel_cuda_manual_seed(1)
    model, _ = load_gpt2_for_inference(ckpt_dir)
    out = _generate_each(model, prompts, {
        "cache": ({}, True, None), "recompute": ({}, False, None),
        "sampled": (dict(SAMPLED, seed=seed), True, None),
        "top1": (dict(top_k=1, temperature=0.7, seed=seed), True, None)})
    out["eod"] = out["cache"][1][4]  # an id greedy decoding produces: it must stop there
    out["stopped"] = generate(model, prompts[1:2], MAX_NEW, VOCAB, None, out["eod"])[0]
    out["padded_would_win"], out["padding_masked"] = _boost_padding(model, prompts[0])
    out["padded"] = _generate_each(model, prompts, {
        "greedy": ({}, True, None), "topk": (dict(top_k=5, seed=seed), True, None),
        "topp": (dict(top_p=0.95, seed=seed), True, None),
        "hot": (dict(temperature=5.0, seed=seed), False, None)})
    return out


@pytest.fixture(scope="module")
def decoded(model_dirs, module_seed):
    """``(prompts, tp=1 results, [tp=2 results per rank])`` of :func:`_decode_all`."""
    _, root = model_dirs
    prompts = _prompts(module_seed)
    tp1 = run_distributed(_decode_all, 1, str(root / "tp1"), prompts, module_seed)[0]
    tp2 = run_distributed(_decode_all, 2, str(root / "tp2"), prompts, module_seed)
    return prompts, tp1, tp2


def _hf_greedy(hf, prompt, max_new, eod=None):
    with torch.no_grad():
        ids = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False,
                          eos_token_id=eod if eod is not None else VOCAB + 1,
                          pad_token_id=VOCAB - 1, attention_mask=torch.ones(1, len(prompt),
                                                                            dtype=torch.long))
    return ids[0, len(prompt):].tolist()


def _assert_greedy_equal(hf, prompt, got, expected):
    """Token for token, except where the reference's top two logits tie within 1e-5 (an
    argmax that any correct implementation may break either way; then stop comparing)."""
    for i, (a, b) in enumerate(zip(got, expected)):
        if a != b:
            with torch.no_grad():
                logits = hf(input_ids=torch.tensor([prompt + expected[:i]])).logits[0, -1]
            gap = (logits[b] - logits[a]).item()
            assert gap < 1e-5, f"token {i}: {a} vs {b}, reference prefers {b} by {gap}"
            return
    assert len(got) == len(expected), (got, expected)


def test_kv_cache_and_batching_equal_full_recompute_and_hf_generate(model_dirs, decoded):
    hf, _ = model_dirs
    prompts, tp1, _ = decoded
    for prompt, cached, full in zip(prompts, tp1["cache"], tp1["recompute"]):
        assert len(cached) == MAX_NEW
        _assert_greedy_equal(hf, prompt, cached, full)
        _assert_greedy_equal(hf, prompt, cached, _hf_greedy(hf, prompt, MAX_NEW))


def test_stops_at_eod_like_hf(model_dirs, decoded):
    hf, _ = model_dirs
    prompts, tp1, _ = decoded
    stopped = _hf_greedy(hf, prompts[1], MAX_NEW, tp1["eod"])
    assert stopped[-1] == tp1["eod"] and tp1["stopped"] == stopped[:-1]  # ours drops the eod


def test_tp2_gives_the_tokens_of_tp1(model_dirs, decoded):
    hf, _ = model_dirs
    prompts, tp1, tp2 = decoded
    assert tp2[0] == tp2[1]  # both tp ranks decode the same tokens
    for prompt, a, b in zip(prompts, tp2[0]["cache"], tp1["cache"]):
        _assert_greedy_equal(hf, prompt, a, b)
    assert tp2[0]["sampled"] == tp1["sampled"]
    assert tp1["top1"] == tp1["cache"]  # top-k = 1 is greedy whatever the temperature
    assert tp1["sampled"] != tp1["cache"]  # sampling really samples


@pytest.mark.parametrize("tp", [1, 2])
def test_padded_vocabulary_is_never_sampled(decoded, tp):
    _, tp1, tp2 = decoded
    out = tp1 if tp == 1 else tp2[0]
    assert out["padding_masked"]  # the model itself gives padded ids -inf
    assert out["padded_would_win"]  # so a missing cut-off would show
    for name, outputs in out["padded"].items():
        ids = [i for seq in outputs for i in seq]
        assert len(ids) == 3 * MAX_NEW and max(ids) < VOCAB, name


def test_filters_match_their_definitions(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4, 50, generator=g) * 3
    logits[0, :5] = logits[0, 5]  # ties at the top
    for k in (1, 3, 10, 50):
        kept = torch.isfinite(filter_top_k(logits, k))
        for row, keep in zip(logits, kept):
            kth = sorted(row.tolist(), reverse=True)[k - 1]
            assert keep.tolist() == [x >= kth for x in row.tolist()]
    for p in (0.1, 0.5, 0.9, 0.99):
        kept = torch.isfinite(filter_top_p(logits, p))
        for row, keep in zip(logits[1:], kept[1:]):  # without ties: the nucleus is unique
            probs = torch.softmax(row, -1).tolist()
            order = sorted(range(50), key=lambda i: -probs[i])
            nucleus, total = set(), 0.0
            for i in order:  # smallest prefix of the sorted tokens reaching p
                nucleus.add(i)
                total += probs[i]
                if total >= p:
                    break
            assert {i for i in range(50) if keep[i]} == nucleus


def test_sampling_follows_the_filtered_tempered_distribution(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 8, generator=g)
    draws = 40000
    for kwargs in (dict(temperature=0.7), dict(top_k=3, temperature=1.3), dict(top_p=0.6)):
        config = SamplingConfig(seed=seed, **kwargs)
        gen = torch.Generator().manual_seed(seed)
        tokens = sample(logits.expand(draws, 8), config, gen)
        freq = torch.bincount(tokens, minlength=8).float() / draws
        scaled = logits[0] / config.temperature
        scaled = filter_top_p(filter_top_k(scaled[None], config.top_k), config.top_p)[0]
        expected = torch.softmax(scaled, -1)
        assert (freq - expected).abs().max().item() < 0.015, (kwargs, freq, expected)


def _parse(stdout):
    """``[(prompt, continuation)]`` from the tool's output blocks."""
    pattern = r"===== prompt =====\n(.*?)\n===== continuation =====\n(.*?)\n\n(?====== prompt|\Z)"
    return re.findall(pattern, stdout, flags=re.S)


@pytest.fixture
def cli_checkpoint(gpt2_data, tmp_path, seed):
    """A random 500-token GPT-2 with the session's trained tokenizer, as a native checkpoint."""
    from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

    tokenizer = GPT2BPETokenizer(gpt2_data["vocab"], gpt2_data["merges"])
    hf = make_hf_gpt2(tmp_path / "hf", seed, tokenizer.vocab_size, eos=tokenizer.eod)
    run_conversion(ConversionRequest(str(tmp_path / "hf"), str(tmp_path / "native"),
                                     vocab_file=gpt2_data["vocab"],
                                     merge_file=gpt2_data["merges"]))
    return hf, tokenizer, str(tmp_path / "native")


def _cli(ckpt, prompts_file, nproc=1):
    """The tool's run; its stdout as printed: a random model may generate a "\r" token, which
    text mode would turn into a newline."""
    result = run_script([TOOL, "--load", ckpt, "--prompt", "def build(", "--sample-input-file",
                         prompts_file, "--greedy", "--out-seq-length", "8"], nproc=nproc,
                        text=False)
    result.stdout = result.stdout.decode()
    result.stderr = result.stderr.decode(errors="replace")
    return result


def _check_cli(cli_checkpoint, tmp_path, nproc):
    hf, tokenizer, ckpt = cli_checkpoint
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("The model returns\n\nimport numpy as\n")  # blank line skipped
    result = _cli(ckpt, str(prompts_file), nproc)
    assert result.returncode == 0, result.stderr
    blocks = _parse(result.stdout)
    assert [p for p, _ in blocks] == ["def build(", "The model returns", "import numpy as"]
    for prompt, text in blocks:
        expected = _hf_greedy(hf, tokenizer.tokenize(prompt), 8, tokenizer.eod)
        expected = expected[:expected.index(tokenizer.eod)] if tokenizer.eod in expected \
            else expected
        assert text == tokenizer.detokenize(expected), prompt


def test_cli_prints_the_hf_greedy_continuations(cli_checkpoint, tmp_path):
    _check_cli(cli_checkpoint, tmp_path, nproc=1)


@pytest.mark.slow
def test_cli_under_torchrun_with_tp2(cli_checkpoint, tmp_path):
    _check_cli(cli_checkpoint, tmp_path, nproc=2)


def test_cli_bad_input_exits_2(cli_checkpoint, tmp_path, capsys):
    """Checked before any process group starts, so the tool's main runs in-process here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("generate_samples_gpt2", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    _, _, ckpt = cli_checkpoint
    cases = (([], "no prompts"), (["--prompt", "x", "--temperature", "0"], "temperature"),
             (["--prompt", "x", "--sample-input-file", str(tmp_path / "no")], "does not exist"),
             (["--prompt", "x", "--top-p", "1.5"], "top_p"))
    for argv, message in cases:
        with pytest.raises(SystemExit) as info:
            tool.main(["--load", ckpt, *argv])
        err = capsys.readouterr().err
        assert info.value.code == 2 and message in err, err
    with pytest.raises(SystemExit) as info:
        tool.main(["--load", str(tmp_path / "missing"), "--prompt", "x"])
    assert info.value.code == 2 and "does not exist" in capsys.readouterr().err
