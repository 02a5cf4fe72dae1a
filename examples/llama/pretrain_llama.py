"""Pretrain the Llama example (llama_model.py, next to this file) through pretrain().

    torchrun --nproc_per_node 4 examples/llama/pretrain_llama.py \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel \
        --num-layers 4 --hidden-size 256 --num-attention-heads 8 --num-key-value-heads 2 ...

The family object travels with the run: ``--load`` of its checkpoints needs no registration
(docs/new_model.md).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]  # llama_model, megatron

from llama_model import LLAMA  # noqa: E402
from megatron.common.errors import run_main  # noqa: E402
from megatron.training import pretrain  # noqa: E402


def main(argv=None):
    return pretrain(family=LLAMA, argv=argv)


if __name__ == "__main__":
    run_main(main)
