#!/usr/bin/env python
"""Convert GPT-2 checkpoints (or, with --family, a model family's): Hugging Face, Megatron-LM
and native, any (tp, pp) layout.

    # HF save_pretrained directory -> native checkpoint at tp=2
    python tools/convert_checkpoint.py --input gpt2-hf --output ckpt-tp2 \\
        --output-format native --target-tensor-parallel-size 2
    # native (any layout) -> another layout, e.g. a pipeline run's 2 stages
    python tools/convert_checkpoint.py --input ckpt-tp2 --output ckpt-pp2 \\
        --target-tensor-parallel-size 1 --target-pipeline-parallel-size 2
    # native -> HF
    python tools/convert_checkpoint.py --input ckpt-pp2 --output gpt2-out --output-format hf
    # Megatron-LM checkpoint (versions 0-3, any layout) -> native; the released GPT-2 345M
    # saves no args: give its heads and tokenizer
    python tools/convert_checkpoint.py --input megatron_345m --output ckpt \
        --input-format megatron --num-attention-heads 16 \
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt
    # native -> a version-3 Megatron-LM checkpoint at tp=2, pp=2
    python tools/convert_checkpoint.py --input ckpt --output megatron-out \
        --output-format megatron --target-tp 2 --target-pp 2
    # a model family of your own that declares its HF name table (ModelFamily.hf_names):
    # a checkpoint of any layout -> HF, and HF -> native at tp=2
    python tools/convert_checkpoint.py --family examples/bert/bert_model.py:BERT \
        --input ckpt --output bert-hf --output-format hf
    python tools/convert_checkpoint.py --family examples/bert/bert_model.py:BERT \
        --input bert-hf --output ckpt-tp2 --target-tp 2

Native and Megatron-LM output hold weights only (plus the source's iteration, consumed
samples and LR schedule position): train from it with ``--finetune``, or resume with
``--no-load-optim``. See docs/conversion.md.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint_conversion import ConversionRequest, run_conversion  # noqa: E402
from megatron.checkpoint_conversion.cli import (  # noqa: E402
    conversion_parser,
    convert_and_report,
    parse_conversion_args,
)
from megatron.common.errors import ConfigError, entry_point  # noqa: E402


def get_args(argv=None):
    parser = conversion_parser(__doc__.split("\n\n")[0], ConversionRequest.format_names())
    parser.add_argument("--vocab-file", default=None,
                        help="GPT-2 vocab.json to record (HF input) or copy (HF output)")
    parser.add_argument("--merge-file", default=None, help="GPT-2 merges.txt, likewise")
    parser.add_argument("--num-attention-heads", type=int, default=None,
                        help="Megatron-LM input that saves no args (e.g. the released GPT-2 "
                             "345M: 16): its number of attention heads")
    parser.add_argument("--family", default=None,
                        help="a model family of your own: package.module:OBJECT, "
                             "path/to/file.py:OBJECT or a registered name; HF input/output "
                             "through its name table (ModelFamily.hf_names: "
                             "docs/new_model.md); default GPT-2")
    return parse_conversion_args(parser, argv)


def request_of(args):
    """GPT-2's conversion request, or (``--family``) that family's."""
    values = dict(vars(args))
    family = values.pop("family")
    if family is None:
        return ConversionRequest(**values)
    from megatron.checkpoint_conversion.hf_table import conversion_request_class
    from megatron.families import load_family

    request_class = conversion_request_class(load_family(family))
    gpt2_only = [f"--{k.replace('_', '-')}" for k in ("vocab_file", "merge_file",
                                                       "num_attention_heads") if values.pop(k)]
    if gpt2_only:
        raise ConfigError(f"{', '.join(gpt2_only)} apply to GPT-2 only, not with --family")
    return request_class(**values)


@entry_point
def main(argv=None):
    args = get_args(argv)
    convert_and_report(run_conversion, request_of(args), args)


if __name__ == "__main__":
    main()
