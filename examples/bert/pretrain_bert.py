"""Pretrain the BERT example (bert_model.py, next to this file) through pretrain().

    torchrun --nproc_per_node 4 examples/bert/pretrain_bert.py \
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel \
        --num-layers 4 --hidden-size 256 --num-attention-heads 8 --mask-prob 0.15 ...

The family object travels with the run: ``--load`` of its checkpoints needs no registration
(docs/new_model.md).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]  # bert_model, megatron

from bert_model import BERT  # noqa: E402
from megatron.common.errors import run_main  # noqa: E402
from megatron.training import pretrain  # noqa: E402


def main(argv=None):
    return pretrain(family=BERT, argv=argv)


if __name__ == "__main__":
    run_main(main)
