"""Helpers for tests that train a tiny T5 through pretrain_t5.py (in harness ranks)."""
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def t5_argv(data, *extra, layers=2, hidden=32, heads=4, kv=8, ff=64, enc=32, dec=8):
    """Flags for a tiny T5 run on ``data`` (the t5_data fixture), fp32 by default."""
    return ["--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--kv-hidden-size", str(kv),
            "--ff-hidden-size", str(ff), "--enc-seq-length", str(enc),
            "--dec-seq-length", str(dec), "--data-path", data["prefix"],
            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", data["spm"],
            "--split", "98,2,0", "--make-vocab-size-divisible-by", "64", "--lr", "5e-3",
            "--min-lr", "5e-4", "--warmup", "2", "--log-interval", "5",
            "--eval-interval", "1000", "--eval-iters", "1", "--seed", "1234", *extra]


def train_t5(argv):
    """Rank body: run pretrain_t5.main(argv); return (per-step losses, eval losses)."""
    import pretrain_t5

    state = pretrain_t5.main(argv)
    return state.losses, state.eval_losses
