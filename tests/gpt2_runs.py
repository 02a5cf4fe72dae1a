"""Helpers for tests that train a tiny GPT-2 through pretrain_gpt2.py (in harness ranks)."""
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpt2_argv(data, *extra, layers=2, hidden=32, heads=4, seq=32):
    """Flags for a tiny GPT-2 run on ``data`` (the gpt2_data fixture), fp32 by default."""
    return ["--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--seq-length", str(seq),
            "--max-position-embeddings", str(seq), "--data-path", data["prefix"],
            "--vocab-file", data["vocab"], "--merge-file", data["merges"],
            "--tokenizer-type", "GPT2BPETokenizer", "--split", "98,2,0",
            "--make-vocab-size-divisible-by", "64", "--lr", "5e-3", "--min-lr", "5e-4",
            "--warmup", "2", "--log-interval", "5", "--eval-interval", "1000",
            "--eval-iters", "1", "--seed", "1234", *extra]


def layout_argv(data, tp, pp, dp, *extra, steps=10, micro=2, global_batch=8):
    """Flags for a dropout-free 4-layer run at (tp, pp, dp) with a fixed global batch (the
    layout-equivalence and resume tests)."""
    return gpt2_argv(data, "--num-layers", "4", "--model-parallel-size", str(tp),
                     "--pipe-parallel-size", str(pp), "--batch-size", str(micro),
                     "--gas", str(global_batch // (micro * dp)), "--train-iters", str(steps),
                     "--hidden-dropout", "0", "--attention-dropout", "0", *extra)


def relative_error(a, b):
    """Largest relative difference of two loss curves."""
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def train_gpt2(argv):
    """Rank body: run pretrain_gpt2.main(argv); return (per-step losses, eval losses)."""
    import pretrain_gpt2

    state = pretrain_gpt2.main(argv)
    return state.losses, state.eval_losses


def user_error(argv):
    """Rank body: run pretrain_gpt2.main(argv); return the user error's message (a
    MegatronError: bad flags, bad checkpoint, ...), or None when it ran."""
    import pretrain_gpt2
    from megatron.common.errors import MegatronError

    try:
        pretrain_gpt2.main(argv)
    except MegatronError as exc:
        return str(exc)
    return None


def run_script(args, nproc=1, timeout=240, env=None, text=True):
    """Run an entry script (python, or torchrun with ``nproc`` ranks); return the result
    (``text=False``: the output as bytes, without text mode's newline translation)."""
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--standalone", *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=text, timeout=timeout,
                          env=full_env)


def full_and_resumed(entry, world_size, argv, ckpt, at, timeout=400):
    """Train ``argv`` uninterrupted (saving at step ``at``), then resume a fresh run from that
    checkpoint. Returns ``(full, resumed)``: (losses, eval losses) of the whole uninterrupted
    run, and of the uninterrupted run's first ``at`` steps followed by the resumed steps.

    The checkpoint is the one the uninterrupted run wrote at step ``at`` (the tracker is
    pointed back at it), so a single extra run checks "N steps, save, resume, M steps"
    against "N + M steps".
    """
    from harness import run_distributed

    full = run_distributed(entry, world_size, [*argv, "--save", ckpt, "--save-interval",
                                               str(at)], timeout=timeout)[0]
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as handle:
        handle.write(str(at))
    later = run_distributed(entry, world_size, [*argv, "--load", ckpt], timeout=timeout)[0]
    early_eval = [e for e in full[1] if e[0] <= at]
    return full, (full[0][:at] + later[0], early_eval + later[1])


def error_with_precision_support(argv, fp16, bf16):
    """Rank body: run pretrain_gpt2.main(argv) on a device whose DeepSpeed accelerator reports
    the given fp16 / bf16 support (emulated); return the user error's message, or None."""
    from deepspeed.accelerator import get_accelerator

    import pretrain_gpt2
    from megatron.common.errors import MegatronError

    accelerator = get_accelerator()
    accelerator.is_fp16_supported = lambda: fp16
    accelerator.is_bf16_supported = lambda: bf16
    try:
        pretrain_gpt2.main(argv)
    except MegatronError as exc:
        return str(exc)
    return None
