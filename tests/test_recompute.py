"""Megatron-LM's recompute flags: --recompute-granularity {full,selective},
--recompute-method {uniform,block}, --recompute-num-layers (megatron/config/recompute.py,
megatron/model/recompute.py).

A run with recompute must train exactly as the run without it (the recomputed forward
replays the RNG states, so dropout draws the same masks): GPT-2 at tp 2 with sequence
parallelism, 2 pipeline stages of 2 interleaved chunks, unfused attention, hidden and
attention dropout 0.1, 8 steps: selective and full block against no recompute; T5 at tp 2
with selective (unfused) and block. Each recomputing run must have
recomputed (the checkpointed blocks' backward ran), and the start-up line says what.
"""
import random

import pytest

from gpt2_runs import gpt2_argv, relative_error
from harness import run_distributed
from recompute_runs import train_variants
from t5_runs import t5_argv

from megatron.config import parse_args
from megatron.common.errors import ConfigError

TOL = 1e-5
SELECTIVE = ["--recompute-granularity", "selective"]
BLOCK = ["--recompute-granularity", "full", "--recompute-method", "block",
         "--recompute-num-layers", "1"]
UNIFORM = ["--recompute-granularity", "full"]


def _parse(*extra):
    base = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8",
            "--seq-length", "32", "--batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
            "--tokenizer-type", "GPT2BPETokenizer"]
    return parse_args(base + list(extra), world_size=1, rank=0, check_files=False)


def test_the_flags_normalize_to_one_meaning():
    old = _parse("--checkpoint-activations", "--checkpoint-num-layers", "2")
    new = _parse("--recompute-granularity", "full", "--recompute-method", "uniform",
                 "--recompute-num-layers", "2")
    for args in (old, new):
        assert (args.recompute_granularity, args.recompute_method,
                args.recompute_num_layers) == ("full", "uniform", 2)
        assert args.checkpoint_activations and args.checkpoint_num_layers == 2
    block = _parse(*BLOCK)
    assert (block.recompute_method, block.checkpoint_activations) == ("block", False)
    for args in (_parse(*SELECTIVE), _parse("--recompute-activations")):
        assert (args.recompute_granularity, args.recompute_method,
                args.checkpoint_activations) == ("selective", None, False)
    assert _parse("--recompute-granularity", "full").recompute_num_layers == 1
    assert _parse().recompute_granularity is None


@pytest.mark.parametrize("extra, message", [
    (SELECTIVE + ["--recompute-method", "uniform"], "selective recomputes the attention core"),
    (["--recompute-method", "block"], "need --recompute-granularity full"),
    (["--checkpoint-activations"] + SELECTIVE, "give one"),
    (UNIFORM + ["--recompute-num-layers", "9"], "--recompute-num-layers (9) must be between"),
    (["--checkpoint-activations", "--recompute-method", "block"], "--recompute-method block"),
])
def test_bad_combinations_are_refused(extra, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _parse(*extra)


def _gpt2(data, seed, *extra):
    return gpt2_argv(data, "--num-layers", "4", "--model-parallel-size", "2",
                     "--pipe-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
                     "--sequence-parallel", "--attention-backend", "unfused", "--batch-size", "2",
                     "--gas", "2", "--train-iters", "8", "--hidden-dropout", "0.1",
                     "--attention-dropout", "0.1", "--seed", str(seed), *extra)


def _check(results, names, expected_blocks):
    for rank, runs in enumerate(results):
        (reference, blocks, _), *others = runs
        assert blocks == 0 and len(reference) == 8
        for name, (losses, blocks, lines), expected in zip(names, others, expected_blocks):
            assert relative_error(losses, reference) < TOL, (name, losses, reference)
            # 8 steps x 2 micro-batches x the blocks one micro-batch recomputes on the rank
            assert blocks == 8 * 2 * expected, (name, rank, blocks)
            if rank == 0:  # the start-up line (rank 0 prints)
                assert len(lines) == 1 and "nothing to recompute" not in lines[0], lines


def test_gpt2_selective_and_block_train_as_without_recompute(gpt2_data):
    """tp 2 x pp 2 with SP, 2 chunks of 1 layer per rank; per rank and micro-batch the
    recomputed blocks: selective 2 (one attention core per layer), block 2 (the first
    layer of each chunk). (Uniform groups: tests/test_interleaved_models.py and others.)"""
    seed = random.randrange(1, 10**6)  # weights, data order and dropout: fresh each run
    variants = [_gpt2(gpt2_data, seed, *x) for x in ((), SELECTIVE, BLOCK)]
    results = run_distributed(train_variants, 4, "gpt2", variants, timeout=400)
    _check(results, ["selective", "block"], [2, 2])


def test_t5_selective_and_block_train_as_without_recompute(t5_data):
    """T5 at tp 2 (2 + 2 layers, no pipeline): selective recomputes the 2 + 2 self- and 2
    cross-attention cores; block 1 the first layer of each stack."""
    def argv(*extra):
        return t5_argv(t5_data, "--model-parallel-size", "2", "--attention-backend", "unfused",
                       "--batch-size", "2", "--gas", "2", "--train-iters", "8",
                       "--hidden-dropout", "0.1", "--attention-dropout", "0.1", *extra)

    seed = ["--seed", str(random.randrange(1, 10**6))]
    variants = [argv(*seed), argv(*seed, *SELECTIVE), argv(*seed, *BLOCK)]
    results = run_distributed(train_variants, 2, "t5", variants, timeout=400)
    _check(results, ["selective", "block"], [6, 2])
