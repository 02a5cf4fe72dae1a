"""The checkpoint formats a conversion reads and writes, each one adapter.

A :class:`CheckpointFormat` names a format (``--input-format`` / ``--output-format``) and
says how to recognise, read and write it; every conversion request class lists the formats
of its model family (:class:`~.convert.ConversionRequest`), so the conversion itself
(:func:`~.convert.run_conversion`) never asks which format or family it has:

- ``native``: this project's checkpoints (:mod:`megatron.checkpoint`), every family;
- ``hf``: a Hugging Face ``save_pretrained`` directory, through the family's adapter;
- ``megatron``: Megatron-LM's own GPT checkpoints (:mod:`megatron.checkpoint.megatron_lm`),
  GPT-2 only;
- ``megatron-core``: Megatron-Core GPT checkpoints, legacy or ``torch_dist``
  (:mod:`megatron.checkpoint.megatron_core`), GPT-2 only.

Each format says what it found in words (``describe``), which the conversion tool prints
when it detected the input's format.
"""
import os
from dataclasses import dataclass
from typing import Callable, Optional

from ..checkpoint import megatron_core, megatron_lm
from ..checkpoint.format import TRACKER_FILENAME, rank_files
from ..checkpoint.native_reader import read_native
from ..checkpoint.native_writer import write_native
from . import hf_io


@dataclass(frozen=True)
class CheckpointFormat:
    """One checkpoint format.

    Attributes:
        name: the ``--input-format`` / ``--output-format`` value.
        detect: ``detect(path) -> bool``: the path holds this format (asked in the order
            the request lists its formats; the last one may always say yes).
        read: ``read(path, request) -> FullCheckpoint``.
        write: ``write(ckpt, path, request, source) -> path written``.
        layout: written at a (tp, pp) layout: the conversion re-pads the vocabulary for the
            target tp first (:func:`megatron.checkpoint.reshard`); False: one whole model
            (``--target-*-parallel-size`` do not apply).
        pad_multiple: ``--make-vocab-size-divisible-by`` a converted checkpoint gets when
            read from this format and the flag is not given (None: the source's own).
        describe: ``describe(path) -> str``: what ``path`` holds, in words, once ``detect``
            said yes (default: the name).
    """

    name: str
    detect: Callable
    read: Callable
    write: Callable
    layout: bool
    pad_multiple: Optional[int] = None
    describe: Optional[Callable] = None

    def found(self, path: str) -> str:
        """What ``path`` holds in this format, in words."""
        return (self.describe(path) if self.describe else None) or f"a {self.name} checkpoint"


def _read_native(path, request):
    # native -> native: a model without a key map is cut again by its sharding record,
    # whichever family's tool is asked; other outputs need the family's own names
    return read_native(path, request.iteration, request.family,
                       any_recorded=request.output_format == "native")


def _write_native(ckpt, path, request, source):
    return write_native(ckpt, path, source=source)


def is_native(path):
    """Whether ``path`` looks like a native ``--save`` folder: the tracker, an ``iter_*``
    folder or rank folders (the reader says what is wrong with one that is not complete)."""
    if not os.path.isdir(path):
        return False
    return os.path.isfile(os.path.join(path, TRACKER_FILENAME)) or bool(rank_files(path)) or \
        any(name.startswith("iter_") for name in os.listdir(path))


NATIVE = CheckpointFormat("native", detect=is_native, read=_read_native, write=_write_native,
                          layout=True, describe=lambda path: "a megatron-tds native checkpoint")


def hf_format(adapter):
    """The ``hf`` format of a model family, through its adapter module (``read_hf`` /
    ``write_hf``: :mod:`.hf_gpt2`, :mod:`.t5_hf`)."""
    def write(ckpt, path, request, source):
        adapter.write_hf(ckpt, path, request)
        return path

    return CheckpointFormat("hf", detect=hf_io.is_hf_dir, read=adapter.read_hf, write=write,
                            layout=False, pad_multiple=128,
                            describe=lambda path: "a Hugging Face save_pretrained directory")


def _megatron_hints(request):
    """What a Megatron-LM checkpoint may not save, from the conversion flags."""
    hints = {"num_attention_heads": getattr(request, "num_attention_heads", None),
             "true_vocab_size": request.true_vocab}
    for key in ("vocab_file", "merge_file"):
        value = getattr(request, key, None)
        if value:
            hints[key] = os.path.abspath(value)
    return hints


def _read_megatron(path, request):
    return megatron_lm.read_full(path, request.iteration, _megatron_hints(request))


def _write_megatron(ckpt, path, request, source):
    return megatron_lm.write_megatron_lm(ckpt, path)


MEGATRON_LM = CheckpointFormat(
    megatron_lm.NAME, detect=megatron_lm.detect, read=_read_megatron, write=_write_megatron,
    layout=True, describe=lambda path: "a Megatron-LM legacy checkpoint (versions 0-3)")


def _read_core(path, request):
    return megatron_core.read_full(path, request.iteration, _megatron_hints(request))


def _write_core(ckpt, path, request, source):
    return megatron_core.write_megatron_core(ckpt, path)


MEGATRON_CORE = CheckpointFormat(megatron_core.NAME, detect=megatron_core.detect,
                                 read=_read_core, write=_write_core, layout=True,
                                 describe=lambda path: "a " + megatron_core.describe(path))
