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
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint_conversion.t5_convert import (  # noqa: E402
    FORMATS,
    T5ConversionRequest,
    run_t5_conversion,
)
from megatron.errors import entry_point  # noqa: E402


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--input", required=True,
                        help="native --save directory or HF save_pretrained directory")
    parser.add_argument("--output", required=True, help="directory to write (new or empty)")
    parser.add_argument("--input-format", choices=FORMATS, default=None,
                        help="default: hf if the input has config.json, else native")
    parser.add_argument("--output-format", choices=FORMATS, default="native")
    parser.add_argument("--target-tensor-parallel-size", "--target-tp", dest="tp", type=int,
                        default=None, help="native output: tensor-parallel size "
                                           "(default: the source's, 1 for HF input)")
    parser.add_argument("--target-pipeline-parallel-size", "--target-pp", dest="pp", type=int,
                        default=None, help="native output: pipeline stages "
                                           "(default: the source's, 1 for HF input)")
    parser.add_argument("--make-vocab-size-divisible-by", dest="divisible_by", type=int,
                        default=None, help="native output: vocabulary padding multiple (x tp)")
    parser.add_argument("--iteration", type=int, default=None,
                        help="native input: the iteration to read (default: latest); "
                             "HF input: the iteration to save as (default: 0)")
    parser.add_argument("--true-vocab-size", dest="true_vocab", type=int, default=None,
                        help="real vocabulary rows, if the tokenizer files are gone")
    parser.add_argument("--tokenizer-model", default=None,
                        help="HF input: sentencepiece .model to record in the native args")
    args = parser.parse_args(argv)
    for name in ("tp", "pp", "divisible_by", "true_vocab"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"sizes must be >= 1 (got {value})")
    return args


@entry_point
def main(argv=None):
    args = get_args(argv)
    start = time.time()
    written = run_t5_conversion(T5ConversionRequest(**vars(args)))
    print(f"wrote {written} ({args.output_format}) from {args.input} in "
          f"{time.time() - start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
