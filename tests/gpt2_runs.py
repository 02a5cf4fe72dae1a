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


def train_gpt2(argv):
    """Rank body: run pretrain_gpt2.main(argv); return (per-step losses, eval losses)."""
    import pretrain_gpt2

    state = pretrain_gpt2.main(argv)
    return state.losses, state.eval_losses


def run_script(args, nproc=1, timeout=240, env=None):
    """Run an entry script (python, or torchrun with ``nproc`` ranks); return the result."""
    if nproc == 1:
        cmd = [sys.executable, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--standalone", *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env=full_env)
