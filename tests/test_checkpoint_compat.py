"""Checkpoints written by older versions still resume: GPT-2's from before the run-config /
training-backend restructuring, T5's from before the sharding record.

tests/data/v0_gpt2 holds a tiny corpus, its BPE vocabulary and two checkpoints written at
iteration 3 by megatron-tds 6883a87 (the commit before the restructuring): one by the DDP
path (1 process) and one by tds's pipeline engine (pp=2), with the losses of the 6-step
runs that wrote them. Resuming with today's code must continue those runs exactly, once
the two deliberate numerical changes made since are turned off for the comparison: padded
vocabulary rows now get no probability (issue 13; that version gave them some), and
attention defaults to scaled_dot_product_attention (the run uses the Megatron path it had).

tests/data/v0_t5 holds a tiny T5 corpus (a 200-piece sentencepiece model) and two
checkpoints written at iteration 3 by megatron-tds 16f00ee (the commit before checkpoints
recorded their sharding and family): one at pp=1 (DDP) and one at pp=2 (tds's engine), with
the losses of the 6-step runs that wrote them (losses.json says how they were made). Each
resumes with today's code at its own layout and at the other one (moved by T5's key map,
Adam state included) and continues its run exactly.
"""
import json
import os

import pytest

from harness import run_distributed

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "v0_gpt2")
T5_DATA = os.path.join(os.path.dirname(DATA), "v0_t5")


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


def _t5_argv(ckpt, *extra):
    from t5_runs import t5_argv

    data = {"prefix": os.path.join(T5_DATA, "corpus_text_document"),
            "spm": os.path.join(T5_DATA, "tok", "spm.model")}
    return t5_argv(data, "--micro-batch-size", "2", "--global-batch-size", "4",
                   "--train-iters", "6", "--log-interval", "1", "--hidden-dropout", "0",
                   "--attention-dropout", "0", "--load", os.path.join(T5_DATA, ckpt), *extra,
                   hidden=16, heads=2, ff=32)


@pytest.mark.parametrize("ckpt,pp", [("ckpt_ddp", 1), ("ckpt_ddp", 2), ("ckpt_pipe", 2),
                                     ("ckpt_pipe", 1)])
def test_old_t5_checkpoint_resumes_exactly_at_its_layout_and_another(ckpt, pp):
    from t5_runs import train_t5

    with open(os.path.join(T5_DATA, "losses.json")) as handle:
        old = json.load(handle)["losses"]  # the uninterrupted 6-step run (pp=1 and pp=2 agree)
    extra = ("--pipeline-model-parallel-size", "2") if pp == 2 else ()
    losses, _ = run_distributed(train_t5, pp, _t5_argv(ckpt, *extra), timeout=300)[-1]
    assert len(losses) == 3
    assert losses == pytest.approx(old[3:], rel=1e-6, abs=0)


V1_DATA = os.path.join(os.path.dirname(DATA), "v1_gpt2")


def _v1_argv(ckpt, *extra):
    """tests/data/v1_gpt2/make_checkpoints.py's flags, resuming from ``ckpt``."""
    argv = _argv(ckpt, *extra)
    argv[argv.index("--load") + 1] = os.path.join(V1_DATA, ckpt)
    return argv[:argv.index("--batch-size")] + [
        "--micro-batch-size", "2", "--global-batch-size", "8", "--clip-grad", "0.5",
        *argv[argv.index("--batch-size") + 2:]]


@pytest.mark.parametrize("ckpt,world,extra", [
    ("ckpt_pipe_zero1", 4, ("--pipe-parallel-size", "2", "--zero-stage", "1")),
    ("ckpt_ddp", 2, ())])
def test_checkpoints_of_the_deepspeed_engine_release_resume_exactly(ckpt, world, extra):
    """Written by the last release whose pipeline runs stepped through DeepSpeed's engine
    (tests/data/v1_gpt2): pp 2 x dp 2 with DeepSpeed's ZeRO-1 partitions (read by parameter
    name into the distributed optimizer) and pp 1 DDP at dp 2 (its optimizer in the main
    file); each continues its run."""
    with open(os.path.join(V1_DATA, "losses.json")) as handle:
        old = json.load(handle)["losses"][ckpt]
    losses = run_distributed(train_gpt2_plain, world, _v1_argv(ckpt, *extra))[0]
    assert len(losses) == 3
    assert losses == pytest.approx(old[3:], rel=2e-6)


def train_gpt2_plain(argv):
    import pretrain_gpt2

    return pretrain_gpt2.main(argv).losses
