"""Whole conversions: HF or native (any layout) in, HF or native (any layout) out, for
every model family.

Everything goes through a :class:`~megatron.checkpoint.FullCheckpoint` (whole-model keys,
whole tensors), so each format needs one reader and one writer and any pair combines.
Native checkpoints use the generic reader/writer of :mod:`megatron.checkpoint`; the Hugging
Face side is the family's adapter (:mod:`.hf_gpt2`, :mod:`.t5_hf`: ``read_hf`` /
``write_hf``), which each request class names, so nothing here branches on a model.
"""
import os
from dataclasses import dataclass
from typing import ClassVar, Optional

from ..checkpoint.native_reader import read_native
from ..checkpoint.native_writer import reshard, write_native
from ..errors import ConfigError
from . import hf_gpt2, hf_io, t5_hf

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
        hf: (class attribute) the model family's HF adapter module.
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

    hf: ClassVar = None

    @property
    def family(self):
        """The model family's name (``gpt2``, ``t5``), from its HF adapter."""
        return self.hf.FAMILY


@dataclass
class ConversionRequest(BaseConversionRequest):
    """A GPT-2 conversion (the flags of tools/convert_checkpoint.py).

    Attributes:
        vocab_file, merge_file: GPT-2 tokenizer files recorded in the native output's args
            (HF input) or copied into the HF output (default: the source's).
    """

    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None

    hf: ClassVar = hf_gpt2


@dataclass
class T5ConversionRequest(BaseConversionRequest):
    """A T5 conversion (the flags of tools/convert_checkpoint_t5.py).

    Attributes:
        tokenizer_model: sentencepiece model recorded in the native output's args.
    """

    tokenizer_model: Optional[str] = None

    hf: ClassVar = t5_hf


def detect_format(path):
    """``hf`` for a directory with config.json, else ``native``."""
    return "hf" if hf_io.is_hf_dir(path) else "native"


def read_hf(path, request):
    """An HF directory of the request's model family as a FullCheckpoint."""
    return request.hf.read_hf(path, request)


def write_hf(ckpt, path, request):
    """Write ``ckpt`` as an HF directory of the request's model family."""
    request.hf.write_hf(ckpt, path, request)


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
    if in_format == "hf":
        ckpt = read_hf(request.input, request)
    else:
        ckpt = read_native(request.input, request.iteration, request.family)
    if request.output_format == "hf":
        if request.tp not in (None, 1) or request.pp not in (None, 1):
            raise ConfigError("--target-tensor/pipeline-parallel-size apply to native output")
        write_hf(ckpt, request.output, request)
        return request.output
    tp = request.tp or ckpt.args.get("tensor_model_parallel_size", 1)
    pp = request.pp or ckpt.args.get("pipeline_model_parallel_size", 1)
    divisible_by = request.divisible_by or (128 if in_format == "hf" else None)
    target = reshard(ckpt, tp, pp, divisible_by, request.true_vocab)
    return write_native(target, request.output, tp, pp,
                        source=f"{in_format}:{os.path.abspath(request.input)}")
