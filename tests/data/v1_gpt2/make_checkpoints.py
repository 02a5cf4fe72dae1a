"""How tests/data/v1_gpt2 was made (run once, from the repository root, by megatron-tds
99005f5: the last release whose pipeline runs stepped through DeepSpeed's engine).

    python tests/data/v1_gpt2/make_checkpoints.py

Two 6-step runs of the tiny GPT-2 of tests/data/v0_gpt2 (its corpus and vocabulary), each
saving at iteration 3: ``ckpt_pipe_zero1`` at pp 2 x dp 2 with DeepSpeed's ZeRO stage 1
(``--zero-stage 1``: one ``optim_dp_rank_*.pt`` ZeRO partition per data-parallel rank) and
``ckpt_ddp`` at pp 1 x dp 2 (torch DDP, the optimizer in the main file). ``losses.json``
holds each run's per-step losses. Running this with a later release writes that release's
format instead: the point of the folder is the old one.
"""
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(HERE, "..", "..", ".."))
DATA = os.path.join(HERE, "..", "v0_gpt2")


def argv(ckpt, *extra):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32",
            "--data-path", os.path.join(DATA, "corpus_text_document"),
            "--vocab-file", os.path.join(DATA, "vocab.json"),
            "--merge-file", os.path.join(DATA, "merges.txt"),
            "--tokenizer-type", "GPT2BPETokenizer", "--split", "98,2,0",
            "--make-vocab-size-divisible-by", "64", "--lr", "5e-3", "--min-lr", "5e-4",
            "--warmup", "2", "--log-interval", "1", "--eval-interval", "1000",
            "--eval-iters", "1", "--seed", "1234", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", "6", "--clip-grad", "0.5",
            "--hidden-dropout", "0", "--attention-dropout", "0",
            "--save", os.path.join(HERE, ckpt), "--save-interval", "3", *extra]


def train(args):
    import pretrain_gpt2

    return pretrain_gpt2.main(args).losses


RUNS = {"ckpt_pipe_zero1": (4, ("--pipe-parallel-size", "2", "--zero-stage", "1")),
        "ckpt_ddp": (2, ())}


def main():
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    from harness import run_distributed

    made = {"made_by": "megatron-tds 99005f5 (DeepSpeed's engine at pp > 1)", "losses": {}}
    for name, (world, extra) in RUNS.items():
        shutil.rmtree(os.path.join(HERE, name), ignore_errors=True)
        losses = run_distributed(train, world, argv(name, *extra), timeout=600)
        made["losses"][name] = [round(x, 7) for x in losses[-1]]
        with open(os.path.join(HERE, name, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("3")
        shutil.rmtree(os.path.join(HERE, name, "iter_0000006"))
    with open(os.path.join(HERE, "losses.json"), "w") as handle:
        json.dump(made, handle, indent=1)


if __name__ == "__main__":
    main()
