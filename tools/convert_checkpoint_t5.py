#!/usr/bin/env python
"""Convert T5 checkpoints: Hugging Face T5ForConditionalGeneration <-> native, any (tp, pp).

    # HF save_pretrained directory -> native checkpoint at tp=2 (pp through stages: --target-pp)
    python tools/convert_checkpoint_t5.py --input t5-hf --output ckpt-tp2 \\
        --target-tensor-parallel-size 2 --tokenizer-model spm.model
    # native (any layout, e.g. a pipeline run) -> another layout
    python tools/convert_checkpoint_t5.py --input ckpt-tp2 --output ckpt-pp2 \\
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 2
    # native -> HF
    python tools/convert_checkpoint_t5.py --input ckpt-pp2 --output t5-out --output-format hf

Native output holds weights only: train from it with ``pretrain_t5.py --load DIR --finetune``.
See docs/t5.md for the key mapping.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint_conversion.t5_convert import (  # noqa: E402
    T5ConversionRequest,
    run_t5_conversion,
)
from megatron.checkpoint_conversion.cli import (  # noqa: E402
    conversion_parser,
    convert_and_report,
    parse_conversion_args,
)
from megatron.common.errors import entry_point  # noqa: E402


def get_args(argv=None):
    parser = conversion_parser(__doc__.split("\n\n")[0],
                               T5ConversionRequest.format_names())
    parser.add_argument("--tokenizer-model", default=None,
                        help="HF input: sentencepiece .model to record in the native args")
    return parse_conversion_args(parser, argv)


@entry_point
def main(argv=None):
    args = get_args(argv)
    convert_and_report(run_t5_conversion, T5ConversionRequest(**vars(args)), args)


if __name__ == "__main__":
    main()
