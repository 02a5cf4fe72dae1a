"""Rank bodies for the Llama example's tests (examples/llama/llama_model.py)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples", "llama"))


def llama_argv(data, tp, pp, *extra, vpp=1, steps=8, micro=2, global_batch=8):
    """Flags for a dropout-free 4-layer Llama run at (tp, pp, v) (dp = what is left)."""
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--num-key-value-heads", "2", "--ffn-hidden-size", "48", "--seq-length", "32",
            "--max-position-embeddings", "32", "--data-path", data["prefix"],
            "--vocab-file", data["vocab"], "--merge-file", data["merges"],
            "--split", "98,2,0", "--make-vocab-size-divisible-by", "64", "--lr", "5e-3",
            "--min-lr", "5e-4", "--warmup", "2", "--log-interval", "4",
            "--eval-interval", "1000", "--eval-iters", "1", "--seed", "1234",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            *(["--virtual-pipeline-model-parallel-size", str(vpp)] if vpp > 1 else []),
            "--micro-batch-size", str(micro), "--global-batch-size", str(global_batch),
            "--train-iters", str(steps), *extra]


def train_llama(argv, family=None):
    """Rank body: pretrain the example (or ``family``); return the per-step losses."""
    from llama_model import LLAMA
    from megatron.training import pretrain

    return pretrain(family=family or LLAMA, argv=argv).losses
