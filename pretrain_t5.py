"""Pretrain T5 (span corruption): the T5 family (megatron/families/t5.py) through
megatron.training.pretrain().

    torchrun --nproc_per_node 4 pretrain_t5.py --model-parallel-size 2 \\
        --enc-seq-length 512 --dec-seq-length 128 ... (see examples/run_t5.sh)

Works at every layout: T5Model without pipeline stages (``--pipe-parallel-size 1``),
T5ModelPipe through tds's pipeline engine otherwise. T5 flags: megatron/families/t5.py.
"""
from megatron.common.errors import run_main
from megatron.families.t5 import FAMILY as T5
from megatron.training import pretrain


def main(argv=None):
    return pretrain(family=T5, argv=argv)


if __name__ == "__main__":
    run_main(main)
