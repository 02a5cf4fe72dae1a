"""Whole conversions: HF or native (any layout) in, HF or native (any layout) out, for
every model family.

Everything goes through a :class:`~.native_reader.FullCheckpoint` (whole-model keys, whole
tensors), so each format needs one reader and one writer and any pair combines. Native
checkpoints use the generic reader/writer with the family's key map; only the HF mapping
is per family (GPT-2 here, T5 in :mod:`.t5_convert`).
"""
import os
from dataclasses import dataclass
from typing import Optional

from ..errors import ConfigError
from . import hf_gpt2, hf_io
from .native_reader import FullCheckpoint, read_native
from .native_writer import reshard, write_native
from .vocab_padding import resolve_true_vocab_size, tokenizer_from_args

FORMATS = ("native", "hf")


@dataclass
class BaseConversionRequest:
    """What to convert and where: the flags every conversion tool takes.

    Attributes:
        input, output: source and destination directories.
        input_format, output_format: ``native`` or ``hf`` (input None: detect).
        tp, pp: target layout for native output (None: the source's; 1 for HF input).
        divisible_by: target ``--make-vocab-size-divisible-by`` (None: the source's / 128).
        iteration: native input: the iteration to read (None: latest); HF input: the
            iteration the native output is saved as (None: 0).
        true_vocab: real vocabulary rows, when the checkpoint's tokenizer files are gone.
    """

    input: str
    output: str
    input_format: Optional[str] = None
    output_format: str = "native"
    tp: Optional[int] = None
    pp: Optional[int] = None
    divisible_by: Optional[int] = None
    iteration: Optional[int] = None
    true_vocab: Optional[int] = None

    family = None
    """``gpt2`` or ``t5``: set by each family's request class."""


@dataclass
class ConversionRequest(BaseConversionRequest):
    """A GPT-2 conversion (the flags of tools/convert_checkpoint.py).

    Attributes:
        vocab_file, merge_file: GPT-2 tokenizer files recorded in the native output's args
            (HF input) or copied into the HF output (default: the source's).
    """

    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None

    family = "gpt2"


def detect_format(path):
    """``hf`` for a directory with config.json, else ``native``."""
    return "hf" if hf_io.is_hf_dir(path) else "native"


def _tokenizer_files(request, hf_dir=None):
    """Absolute vocab/merge paths: flags first, then files next to the HF weights."""
    found = {}
    for key, flag, name in (("vocab_file", request.vocab_file, "vocab.json"),
                            ("merge_file", request.merge_file, "merges.txt")):
        if flag:
            if not os.path.isfile(flag):
                raise ConfigError(f"--{key.replace('_', '-')} {flag} does not exist")
            found[key] = os.path.abspath(flag)
        elif hf_dir and os.path.isfile(os.path.join(hf_dir, name)):
            found[key] = os.path.abspath(os.path.join(hf_dir, name))
    return found


def read_hf(path, request):
    """An HF GPT-2 directory as a :class:`FullCheckpoint` (real vocabulary rows only)."""
    config = hf_io.read_config(path)
    args = hf_gpt2.args_from_hf_config(config)
    args.update(_tokenizer_files(request, path))
    args["eod_token_id"] = config.get("eos_token_id")
    state = hf_gpt2.hf_to_full(hf_io.read_weights(path), args)
    return FullCheckpoint(state, args, request.iteration or 0, {})


def _hf_io(family):
    """(reader, writer) of the family's Hugging Face format."""
    if family == "t5":
        from .t5_convert import read_hf_t5, write_hf_t5

        return read_hf_t5, write_hf_t5
    return read_hf, write_hf


def write_hf(ckpt, path, request):
    """Write ``ckpt`` as an HF GPT-2 directory (config, safetensors, tokenizer files)."""
    args = {**ckpt.args, **_tokenizer_files(request)}
    true_vocab = resolve_true_vocab_size(args, request.true_vocab)
    if true_vocab is None:
        raise ConfigError("the real vocabulary size is unknown (the tokenizer files the "
                          "checkpoint names are gone); pass --true-vocab-size N or "
                          "--vocab-file/--merge-file")
    tokenizer = tokenizer_from_args(args)
    eod = tokenizer.eod if tokenizer is not None else args.get("eod_token_id")
    config = hf_gpt2.hf_config_from_args(args, true_vocab, eod)
    state = hf_gpt2.full_to_hf(ckpt.state, args, true_vocab)
    extra = []
    if args.get("tokenizer_type") == "GPT2BPETokenizer":
        extra = [(args[k], name) for k, name in (("vocab_file", "vocab.json"),
                                                 ("merge_file", "merges.txt"))
                 if args.get(k) and os.path.isfile(args[k])]
    hf_io.write_hf_dir(path, config, state, extra)


def run_conversion(request):
    """Convert as ``request`` says (its class names the model family); returns the path
    written.

    Raises:
        CheckpointError / ConfigError: bad input, before anything is written.
    """
    in_format = request.input_format or detect_format(request.input)
    for name, value in (("input", in_format), ("output", request.output_format)):
        if value not in FORMATS:
            raise ConfigError(f"--{name}-format {value!r}: use one of {FORMATS}")
    if os.path.abspath(request.input) == os.path.abspath(request.output):
        raise ConfigError("--input and --output are the same directory")
    hf_reader, hf_writer = _hf_io(request.family)
    if in_format == "hf":
        ckpt = hf_reader(request.input, request)
    else:
        ckpt = read_native(request.input, request.iteration, request.family)
    if request.output_format == "hf":
        if request.tp not in (None, 1) or request.pp not in (None, 1):
            raise ConfigError("--target-tensor/pipeline-parallel-size apply to native output")
        hf_writer(ckpt, request.output, request)
        return request.output
    tp = request.tp or ckpt.args.get("tensor_model_parallel_size", 1)
    pp = request.pp or ckpt.args.get("pipeline_model_parallel_size", 1)
    divisible_by = request.divisible_by or (128 if in_format == "hf" else None)
    target = reshard(ckpt, tp, pp, divisible_by, request.true_vocab)
    return write_native(target, request.output, tp, pp,
                        source=f"{in_format}:{os.path.abspath(request.input)}")
