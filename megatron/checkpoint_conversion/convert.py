"""Whole conversions between any two formats of a model family, at any layout.

Everything goes through a :class:`~megatron.checkpoint.FullCheckpoint` (whole-model keys,
whole tensors), so each format needs one reader and one writer and any pair combines. Each
format is an adapter (:mod:`.formats`: native checkpoints through the generic
reader/writer of :mod:`megatron.checkpoint`, Hugging Face directories through the family's
adapter :mod:`.hf_gpt2` / :mod:`.t5_hf`, Megatron-LM checkpoints through
:mod:`megatron.checkpoint.megatron_lm`, Megatron-Core ones through
:mod:`megatron.checkpoint.megatron_core`), and each request class lists its family's
formats, so nothing here branches on a model or a format.
"""
import os
from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

from ..checkpoint.native_writer import reshard
from ..common.errors import CheckpointError, ConfigError
from . import hf_gpt2, t5_hf
from .formats import MEGATRON_CORE, MEGATRON_LM, NATIVE, CheckpointFormat, hf_format

#: The formats every model family has (a request class may list more).
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
        formats: (class attribute) the family's checkpoint formats
            (:class:`~.formats.CheckpointFormat`), in the order their ``detect`` is asked.
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
    formats: ClassVar[Tuple[CheckpointFormat, ...]] = ()

    @property
    def family(self):
        """The model family's name (``gpt2``, ``t5``), from its HF adapter."""
        return self.hf.FAMILY

    @classmethod
    def format_names(cls):
        """The ``--input-format`` / ``--output-format`` choices."""
        return tuple(sorted(f.name for f in cls.formats))

    def format_named(self, name, which):
        for fmt in self.formats:
            if fmt.name == name:
                return fmt
        raise ConfigError(f"--{which}-format {name!r}: use one of {self.format_names()}")


@dataclass
class ConversionRequest(BaseConversionRequest):
    """A GPT-2 conversion (the flags of tools/convert_checkpoint.py).

    Attributes:
        vocab_file, merge_file: GPT-2 tokenizer files recorded in the native output's args
            (HF or Megatron-LM input) or copied into the HF output (default: the source's).
        num_attention_heads: heads of a Megatron-LM checkpoint that saves no args (the
            released GPT-2 345M: 16).
    """

    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    num_attention_heads: Optional[int] = None

    hf: ClassVar = hf_gpt2
    formats: ClassVar = (hf_format(hf_gpt2), MEGATRON_CORE, MEGATRON_LM, NATIVE)


@dataclass
class T5ConversionRequest(BaseConversionRequest):
    """A T5 conversion (the flags of tools/convert_checkpoint_t5.py).

    Attributes:
        tokenizer_model: sentencepiece model recorded in the native output's args.
    """

    tokenizer_model: Optional[str] = None

    hf: ClassVar = t5_hf
    formats: ClassVar = (hf_format(t5_hf), NATIVE)


def detected(path, request_class=None):
    """``(format, what it found in words)`` of ``path``, among the formats of
    ``request_class`` (default: GPT-2's), asked in their order.

    Raises:
        CheckpointError: none of them reads ``path``; the message says what is there.
    """
    formats = (request_class or ConversionRequest).formats
    for fmt in formats:
        if fmt.detect(path):
            return fmt, fmt.found(path)
    raise CheckpointError(f"--input {path}: {what_is_there(path)}; that is no checkpoint "
                          f"this tool reads ({', '.join(f.name for f in formats)}): pass "
                          f"--input-format to be told what is wrong with it as that format")


def detect_format(path, request_class=None):
    """The name of the format ``path`` holds (:func:`detected`): ``hf`` for a directory
    with config.json, ``megatron-core`` / ``megatron`` for a Megatron-Core / Megatron-LM
    checkpoint, ``native`` for this project's."""
    return detected(path, request_class)[0].name


def what_is_there(path):
    """What ``path`` holds, in a few words, for a message."""
    if not os.path.exists(path):
        return "it does not exist"
    if not os.path.isdir(path):
        return "it is a file, not a checkpoint directory"
    entries = sorted(os.listdir(path))
    if not entries:
        return "it is an empty directory"
    shown = ", ".join(entries[:6]) + (f", ... ({len(entries)} entries)" if len(entries) > 6
                                     else "")
    return f"it holds {shown}"


def read_hf(path, request):
    """An HF directory of the request's model family as a FullCheckpoint."""
    return request.hf.read_hf(path, request)


def write_hf(ckpt, path, request):
    """Write ``ckpt`` as an HF directory of the request's model family."""
    request.hf.write_hf(ckpt, path, request)


def run_conversion(request):
    """Convert as ``request`` says (its class names the model family and its formats);
    returns the path written.

    Raises:
        CheckpointError / ConfigError: bad input, before anything is written.
    """
    reader = request.format_named(request.input_format, "input") if request.input_format \
        else detected(request.input, type(request))[0]
    writer = request.format_named(request.output_format, "output")
    if os.path.abspath(request.input) == os.path.abspath(request.output):
        raise ConfigError("--input and --output are the same directory")
    if not writer.layout and (request.tp not in (None, 1) or request.pp not in (None, 1)):
        raise ConfigError(f"--target-tensor/pipeline-parallel-size apply to "
                          f"{' and '.join(f.name for f in request.formats if f.layout)} "
                          f"output")
    ckpt = reader.read(request.input, request)
    source = f"{reader.name}:{os.path.abspath(request.input)}"
    if not writer.layout:
        return writer.write(ckpt, request.output, request, source)
    tp = request.tp or ckpt.args.get("tensor_model_parallel_size", 1)
    pp = request.pp or ckpt.args.get("pipeline_model_parallel_size", 1)
    target = reshard(ckpt, tp, pp, request.divisible_by or reader.pad_multiple,
                     request.true_vocab)
    return writer.write(target, request.output, request, source)
