"""Hugging Face conversion of any model family that declares its name table.

A family whose whole tensors and a ``transformers`` model's state dict hold the same weights
under other names (and the same shapes: each of our tensors is one of theirs) declares an
:class:`HFNameTable` (``ModelFamily.hf_names``). Nothing else is needed:

- native -> HF: the checkpoint, saved at any (tp, pp, v), is merged into whole tensors by
  the sharding record it carries (vocabulary rows cut to the real size), renamed, and written
  with the table's ``config.json`` as a ``save_pretrained`` directory (atomically);
- HF -> native: the weights are renamed; the record of the family's model (which tensors it
  holds, split on which dimension, which rows are vocabulary) is read from the model itself,
  built at tp 1 on the "meta" device (shapes and marks, no memory); the conversion then pads
  the vocabulary and cuts every rank file for the target tp as a run's checkpoint, the
  record included, so a run at any layout loads it (``--load``).

``tools/convert_checkpoint.py --family package.module:OBJECT`` uses it (docs/conversion.md).
"""
import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator

from ..checkpoint.native_reader import FullCheckpoint
from ..common.errors import CheckpointError, ConfigError
from . import hf_io
from .convert import BaseConversionRequest
from .formats import NATIVE, hf_format


class LeadingOne(str):
    """An HF name in a name table whose tensor has a leading dimension of 1 that ours lacks:
    ``LeadingOne("final_logits_bias")`` maps BART's ``[1, V]`` bias onto a
    ``VocabParallelBias`` ``[V]`` (unsqueezed on the way out, squeezed on the way in)."""

    def to_hf(self, tensor):
        """Ours -> theirs: ``[V] -> [1, V]``."""
        return tensor.unsqueeze(0)

    def from_hf(self, tensor):
        """Theirs -> ours: ``[1, V] -> [V]`` (a tensor without the leading 1 is left as
        it is, and the shape check names it)."""
        return tensor.squeeze(0) if tensor.dim() > 0 and tensor.shape[0] == 1 else tensor


def _to_hf(hf_name, tensor):
    return hf_name.to_hf(tensor) if isinstance(hf_name, LeadingOne) else tensor


def _from_hf(hf_name, tensor):
    return hf_name.from_hf(tensor) if isinstance(hf_name, LeadingOne) else tensor


def _shape(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def shape_problems(state: Dict[str, Any], expected: Dict[str, list], record: Dict[str, list],
                   names: Dict[str, str], true_vocab: int, path: str) -> list:
    """What in an HF state dict (under our names, declared reshapes applied) has another
    shape than our model's tensor: a shape mismatch named as one, or, where only the
    vocabulary rows differ, the vocabulary advice.

    Args:
        state: our name -> the HF tensor.
        expected: our name -> the model's whole shape at tp 1 (vocabulary rows padded).
        record: the model's sharding record (which dimension holds vocabulary rows).
        names: our name -> HF name.
        true_vocab: the HF config's vocabulary size.
        path: the HF directory, for messages.
    """
    problems = []
    for ours, tensor in state.items():
        want = list(expected[ours])
        dim, _, vocab = record[ours][:3]
        if vocab:
            want[max(dim, 0)] = true_vocab  # the HF side holds the real rows
        got = list(tensor.shape)
        if got == want:
            continue
        rows_only = vocab and len(got) == len(want) and all(
            g == w for i, (g, w) in enumerate(zip(got, want)) if i != max(dim, 0))
        if rows_only:
            problems.append(f"{names[ours]} has {got[max(dim, 0)]} vocabulary rows, the "
                            f"config.json's vocab_size is {true_vocab}: fix the vocab_size "
                            f"(or pass --true-vocab-size)")
            continue
        problems.append(
            f"{path}: {names[ours]} has shape {_shape(got)} but the model's {ours} has "
            f"{_shape(want)}: the name table maps one onto the other without a reshape; "
            f"declare it in the name table "
            + (f"(megatron.checkpoint_conversion.hf_table.LeadingOne({names[ours]!r}) for "
               f"the leading 1)" if got[:1] == [1] and got[1:] == want else
               "(a LeadingOne entry for a leading 1)")
            + f", or give the model a parameter of shape {_shape(got)}")
    return problems


@dataclass(frozen=True)
class HFNameTable:
    """How a family's whole tensors and a ``transformers`` model's state dict name the same
    weights.

    Attributes:
        names: ``names(args) -> {our name: HF name}`` for the model the saved args describe;
            every tensor of ours, each to one of theirs of the same shape, or to a
            :class:`LeadingOne` name (theirs ``[1, V]``, ours ``[V]``).
        to_hf_config: ``f(args) -> config.json dict`` (``model_type``, ``architectures``,
            the sizes, the real vocabulary size).
        from_hf_config: ``f(config.json dict) -> settings``: the saved-args entries of our
            model (``num_layers``, ``hidden_size``, ... and ``true_vocab_size``, the HF
            vocabulary); raises ConfigError for a variant our model does not compute.
        tied: ``{HF name: the HF name it is tied to}``: names a ``transformers`` model ties
            to another (``cls.predictions.decoder.weight`` to the word embedding); not
            written (``from_pretrained`` ties them back), read from their target when a file
            lacks them.
    """

    names: Callable[[Dict[str, Any]], Dict[str, str]]
    to_hf_config: Callable[[Dict[str, Any]], Dict[str, Any]]
    from_hf_config: Callable[[Dict[str, Any]], Dict[str, Any]]
    tied: Dict[str, str] = field(default_factory=dict)


@contextlib.contextmanager
def _tensor_parallel_one() -> Iterator[None]:
    """mpu at tp 1 without process groups (its v2.6 setters), unless it is initialised."""
    from .. import mpu

    if mpu.model_parallel_is_initialized():
        yield
        return
    mpu.set_tensor_model_parallel_world_size(1)
    mpu.set_tensor_model_parallel_rank(0)
    try:
        yield
    finally:
        mpu.set_tensor_model_parallel_world_size(None)
        mpu.set_tensor_model_parallel_rank(None)


def serial_record(family: Any, args: Dict[str, Any]):
    """The sharding record of ``family``'s serial model for the saved ``args`` and its
    tensors' shapes, read from the model built on the "meta" device (on the CPU if a layer
    cannot be built there).

    Args:
        family: the :class:`~megatron.families.ModelFamily`.
        args: saved args (the model's sizes, ``padded_vocab_size``).

    Returns:
        ``(record, {name: shape})``.
    """
    import torch

    from ..checkpoint.sharding import sharding_record
    from ..config import saved_run_config
    from ..common.device import device_override

    cfg = saved_run_config(args, family).replace(
        compute_dtype=torch.float32, checkpoint_activations=False, sequence_parallel=False)
    with _tensor_parallel_one():
        try:
            with device_override("meta"), torch.device("meta"):
                model = family.build_model(cfg, False)
        except (NotImplementedError, RuntimeError):  # an op with no meta kernel
            model = family.build_model(cfg, False)
        return sharding_record(model), {k: list(v.shape) for k, v in
                                        model.state_dict().items()}


class NameTableAdapter:
    """A family's HF adapter (``FAMILY``, ``read_hf``, ``write_hf``, as
    :mod:`.hf_gpt2`) made from its :class:`HFNameTable`."""

    def __init__(self, family: Any) -> None:
        self.family, self.FAMILY = family, family.name

    @property
    def table(self) -> HFNameTable:
        """The family's name table (asked for by an HF input or output only)."""
        if getattr(self.family, "hf_names", None) is None:
            raise ConfigError(f"the {self.FAMILY!r} model family declares no Hugging Face "
                              f"name table (ModelFamily.hf_names): it converts native -> "
                              f"native only (docs/new_model.md)")
        return self.family.hf_names

    def write_hf(self, ckpt: FullCheckpoint, path: str, request: Any) -> None:
        """Write ``ckpt`` (whole tensors, real vocabulary rows) as an HF directory."""
        names = self.table.names(ckpt.args)
        unnamed = sorted(set(ckpt.state) - set(names))
        absent = sorted(set(names) - set(ckpt.state))
        if unnamed or absent:
            raise CheckpointError(f"the {self.FAMILY!r} name table does not match the "
                                  f"checkpoint: tensors it does not name {unnamed[:4]}, names "
                                  f"it lacks {absent[:4]}")
        state = {str(hf): _to_hf(hf, ckpt.state[ours]).contiguous()
                 for ours, hf in names.items()}
        hf_io.write_hf_dir(path, self.table.to_hf_config(ckpt.args), state)

    def read_hf(self, path: str, request: Any) -> FullCheckpoint:
        """An HF directory as whole tensors under our names, with the record of our model
        (tp 1, one stage; the conversion pads and cuts it for the target)."""
        from ..tokenizer import vocab_size_with_padding

        settings = dict(self.table.from_hf_config(hf_io.read_config(path)))
        weights = hf_io.read_weights(path)
        names = self.table.names(settings)
        sources = {ours: hf if hf in weights else self.table.tied.get(hf)
                   for ours, hf in names.items()}
        missing = sorted(names[ours] for ours, src in sources.items() if src not in weights)
        if missing:
            raise CheckpointError(f"{path} lacks {', '.join(missing[:4])}: not a model the "
                                  f"{self.FAMILY!r} name table describes")
        divisible_by = request.divisible_by or 128
        args = dict(settings, tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                    make_vocab_size_divisible_by=divisible_by,
                    padded_vocab_size=vocab_size_with_padding(settings["true_vocab_size"],
                                                              divisible_by, 1))
        record, shapes = serial_record(self.family, args)
        if set(record) != set(names):
            raise CheckpointError(f"the {self.FAMILY!r} name table names other tensors than "
                                  f"its model holds: {sorted(set(record) ^ set(names))[:4]}")
        state = {ours: _from_hf(names[ours], weights[src]) for ours, src in sources.items()}
        problems = shape_problems(state, shapes, record, names, settings["true_vocab_size"],
                                  path)
        if problems:
            raise CheckpointError("; ".join(problems[:4]) +
                                  (f" ... ({len(problems)} in all)" if len(problems) > 4 else ""))
        return FullCheckpoint(state, args, request.iteration or 0, stage_records={0: record},
                              family=self.FAMILY)


def conversion_request_class(family: Any) -> type:
    """The conversion request of ``family``: native and hf (by its name table) formats,
    the flags every conversion tool takes (:class:`~.convert.BaseConversionRequest`)."""
    adapter = NameTableAdapter(family)
    return type(f"{family.name.title()}ConversionRequest", (BaseConversionRequest,),
                {"hf": adapter, "formats": (hf_format(adapter), NATIVE),
                 "__doc__": f"A conversion of the {family.name!r} model family."})
