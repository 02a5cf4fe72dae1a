"""Flags and reporting shared by tools/convert_checkpoint.py and tools/convert_checkpoint_t5.py."""
import argparse
import time

from ..checkpoint.manifest import verification


def conversion_parser(description, formats):
    """A parser with the flags every conversion tool takes (each adds its tokenizer flags)."""
    parser = argparse.ArgumentParser(description=description, allow_abbrev=False)
    parser.add_argument("--input", required=True,
                        help="native --save directory, HF save_pretrained directory, or "
                             "(GPT-2) a Megatron-LM or Megatron-Core checkpoint directory")
    parser.add_argument("--output", required=True, help="directory to write (new or empty)")
    parser.add_argument("--input-format", choices=formats, default=None,
                        help="default: detected, and said (hf: config.json; megatron-core: "
                             "a Megatron-Core legacy or torch_dist checkpoint; megatron: a "
                             "Megatron-LM one; native: this project's)")
    parser.add_argument("--output-format", choices=formats, default="native")
    parser.add_argument("--target-tensor-parallel-size", "--target-tp", dest="tp", type=int,
                        default=None, help="native/megatron(-core) output: tensor-parallel size "
                                           "(default: the source's, 1 for HF input)")
    parser.add_argument("--target-pipeline-parallel-size", "--target-pp", dest="pp", type=int,
                        default=None, help="native/megatron(-core) output: pipeline stages "
                                           "(default: the source's, 1 for HF input)")
    parser.add_argument("--make-vocab-size-divisible-by", dest="divisible_by", type=int,
                        default=None, help="native output: vocabulary padding multiple "
                                           "(x tp); default: the source's, 128 for HF input")
    parser.add_argument("--iteration", type=int, default=None,
                        help="native/megatron input: the iteration to read (default: "
                             "latest); HF input: the iteration to save as (default: 0)")
    parser.add_argument("--true-vocab-size", dest="true_vocab", type=int, default=None,
                        help="real vocabulary rows, if the checkpoint's tokenizer files are "
                             "gone and the padded size must change")
    return parser


def parse_conversion_args(parser, argv=None):
    """Parse and check that every size given is positive (argparse exits 2 otherwise)."""
    args = parser.parse_args(argv)
    for name in ("tp", "pp", "divisible_by", "true_vocab"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"sizes must be >= 1 (got {value})")
    return args


def convert_and_report(run, request, args):
    """Say which format the input holds (when detected), run the conversion, and print what
    was verified of the input (a native checkpoint's files against its manifest:
    megatron/checkpoint/manifest.py) and what was written."""
    from .convert import detected

    start = time.time()
    if request.input_format is None:
        fmt, words = detected(request.input, type(request))
        print(f"{request.input}: {words}", flush=True)
        request.input_format = fmt.name
    with verification() as scope:
        written = run(request)
    if scope.checked:
        print(f"verified {len(scope.checked)} input file(s) against their manifest", flush=True)
    else:
        print(f"{args.input} was read unverified: it has no manifest of digests (a Hugging "
              f"Face, Megatron-LM or Megatron-Core checkpoint, or a native one saved before "
              f"checkpoints carried digests)", flush=True)
    print(f"wrote {written} ({args.output_format}) from {args.input} in "
          f"{time.time() - start:.1f}s", flush=True)
