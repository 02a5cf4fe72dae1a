"""Checkpoints written before the run-config / training-backend restructuring still resume.

tests/data/v0_gpt2 holds a tiny corpus, its BPE vocabulary and two checkpoints written at
iteration 3 by megatron-tds 6883a87 (the commit before the restructuring): one by the DDP
path (1 process) and one by tds's pipeline engine (pp=2), with the losses of the 6-step
runs that wrote them. Resuming with today's code must continue those runs exactly, once
the two deliberate numerical changes made since are turned off for the comparison: padded
vocabulary rows now get no probability (issue 13; that version gave them some), and
attention defaults to scaled_dot_product_attention (the run uses the Megatron path it had).
"""
import json
import os

import pytest

from harness import run_distributed

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "v0_gpt2")


def _argv(ckpt, *extra):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32",
            "--data-path", os.path.join(DATA, "corpus_text_document"),
            "--vocab-file", os.path.join(DATA, "vocab.json"),
            "--merge-file", os.path.join(DATA, "merges.txt"),
            "--tokenizer-type", "GPT2BPETokenizer", "--split", "98,2,0",
            "--make-vocab-size-divisible-by", "64", "--lr", "5e-3", "--min-lr", "5e-4",
            "--warmup", "2", "--log-interval", "1", "--eval-interval", "1000",
            "--eval-iters", "1", "--seed", "1234", "--batch-size", "2", "--train-iters", "6",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            "--load", os.path.join(DATA, ckpt), *extra]


def _train_as_before(argv):
    """Rank body: pretrain_gpt2 with the padded-vocabulary mask off (that version had none)."""
    from megatron import mpu

    mpu.mask_padded_vocab_logits_ = lambda logits, true_vocab_size: logits
    import pretrain_gpt2

    return pretrain_gpt2.main(argv).losses


@pytest.mark.parametrize("ckpt,world,extra", [("ckpt_ddp", 1, ()),
                                              ("ckpt_pipe", 2, ("--pipe-parallel-size", "2"))])
def test_old_checkpoint_resumes_exactly(ckpt, world, extra):
    with open(os.path.join(DATA, "losses.json")) as handle:
        old = json.load(handle)["losses"]  # printed with 7 significant digits
    losses = run_distributed(_train_as_before, world,
                             _argv(ckpt, "--attention-backend", "unfused", *extra))[-1]
    assert len(losses) == 3
    assert losses == pytest.approx(old[3:], rel=2e-6)


def _train_with_own_key_map(argv):
    """Rank body: pretrain GPT-2 as before, its family carrying a copy of GPT-2's key map that
    counts its use; (losses, how many times the layout change asked it)."""
    import dataclasses
    import types

    from megatron import mpu
    from megatron.checkpoint import gpt2_keys
    from megatron.families.gpt2 import FAMILY as GPT2
    from megatron.training import pretrain

    mpu.mask_padded_vocab_logits_ = lambda logits, true_vocab_size: logits
    calls = []
    mine = types.ModuleType("my_gpt2_keys")
    mine.__dict__.update({k: v for k, v in vars(gpt2_keys).items() if not k.startswith("__")})
    for name in ("tp_split_dim", "stage_bounds"):
        original = getattr(gpt2_keys, name)
        setattr(mine, name, lambda *a, _f=original, **k: calls.append(1) or _f(*a, **k))
    losses = pretrain(family=dataclasses.replace(GPT2, keys=mine), argv=argv).losses
    return losses, len(calls)


def test_old_checkpoint_moves_to_another_layout_by_the_familys_key_map():
    """The pp=1 checkpoint (no sharding record: written before it) resumed at pp=2 is moved
    by the run's family's key map (cfg.model_family.keys, here a counting copy of GPT-2's),
    and trains as the resume at its own layout (weights only: it records no optimizer names)."""
    flags = ("--attention-backend", "unfused", "--no-load-optim")
    (own, own_calls), = run_distributed(_train_with_own_key_map, 1, _argv("ckpt_ddp", *flags))
    moved, calls = run_distributed(_train_with_own_key_map, 2,
                                   _argv("ckpt_ddp", *flags, "--pipe-parallel-size", "2"))[-1]
    assert own_calls == 0 and calls > 0  # the family's key map moved it; its own layout: none
    assert len(moved) == len(own) == 3
    assert moved == pytest.approx(own, rel=1e-5)
