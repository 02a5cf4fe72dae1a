"""Pretrain GPT-2: the GPT-2 family (megatron/families/gpt2.py) through megatron.training.pretrain().

    torchrun --nproc_per_node 4 pretrain_gpt2.py --model-parallel-size 2 ... (see examples/)

The model, its batch, its loss and its datasets are described once, by the family; a script
for a model of your own passes Megatron-style providers to ``pretrain`` instead
(docs/training.md).
"""
from megatron.common.errors import run_main
from megatron.families.gpt2 import FAMILY as GPT2
from megatron.training import pretrain


def main(argv=None):
    return pretrain(family=GPT2, argv=argv)


if __name__ == "__main__":
    run_main(main)
