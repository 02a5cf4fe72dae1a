"""T5's Hugging Face side of the conversions, and inference loading.

Native reading, resharding and writing are the generic ones (:mod:`.native_reader`,
:mod:`.native_writer`, with :mod:`.t5_keys`); :func:`run_t5_conversion` is the generic
:func:`~.convert.run_conversion` with a :class:`T5ConversionRequest`.
"""
import os
from dataclasses import dataclass
from typing import Optional


from .. import mpu
from ..errors import CheckpointError, ConfigError
from ..families import get_family
from . import hf_io, t5_hf
from .convert import FORMATS, BaseConversionRequest, run_conversion  # noqa: F401 (tool flags)
from .native_reader import FullCheckpoint, read_native
from .native_writer import reshard, stage_state
from .vocab_padding import resolve_true_vocab_size, tokenizer_from_args

@dataclass
class T5ConversionRequest(BaseConversionRequest):
    """A T5 conversion (the flags of tools/convert_checkpoint_t5.py).

    Attributes:
        tokenizer_model: sentencepiece model recorded in the native output's args.
    """

    tokenizer_model: Optional[str] = None

    family = "t5"


#: Megatron-style name of the generic conversion, for T5 requests.
run_t5_conversion = run_conversion


def read_native_t5(root, iteration=None):
    """A native T5 checkpoint as a :class:`FullCheckpoint` (the generic reader)."""
    return read_native(root, iteration, family="t5")


def read_hf_t5(path, request=None):
    """An HF T5 directory as a :class:`FullCheckpoint` (real vocabulary rows only).

    Args:
        path: a ``save_pretrained`` directory.
        request: the :class:`T5ConversionRequest` (its ``iteration`` and
            ``tokenizer_model`` go into the native output), or None.
    """
    iteration = request.iteration if request is not None else 0
    tokenizer_model = request.tokenizer_model if request is not None else None
    config = hf_io.read_config(path)
    if config.get("model_type", "t5") != "t5":
        raise CheckpointError(f"{path} holds a {config.get('model_type')!r} model, not T5")
    state, args = t5_hf.hf_to_full(config, hf_io.read_weights(path))
    if tokenizer_model:
        if not os.path.isfile(tokenizer_model):
            raise ConfigError(f"--tokenizer-model {tokenizer_model} does not exist")
        args["tokenizer_model"] = os.path.abspath(tokenizer_model)
    return FullCheckpoint(state, args, iteration or 0, {})


def write_hf_t5(ckpt, path, request=None):
    """Write ``ckpt`` as a ``T5ForConditionalGeneration`` directory."""
    true_vocab = request.true_vocab if request is not None else None
    vocab = resolve_true_vocab_size(ckpt.args, true_vocab) or ckpt.args["padded_vocab_size"]
    tokenizer = tokenizer_from_args(ckpt.args)
    ids = {} if tokenizer is None else {"pad_id": tokenizer.pad, "eos_id": tokenizer.eod}
    config, weights = t5_hf.full_to_hf(ckpt.state, ckpt.args, vocab, **ids)
    hf_io.write_hf_dir(path, config, weights)


def load_t5_for_inference(source, iteration=None, true_vocab=None):
    """T5Model (eval, gathered logits) with the weights of a native or HF checkpoint.

    Every tensor-parallel rank calls it; the model runs at this group's tp (pp must be 1).
    Any layout is merged and resharded in memory.

    Args:
        source: a native ``--save`` directory or an HF ``save_pretrained`` directory.
        iteration: native: which iteration (default: latest).
        true_vocab: real vocabulary rows, if needed to re-pad and unknown otherwise.

    Returns:
        ``(model, args)`` with the args of this layout (``padded_vocab_size``, sizes).
    """
    from ..model.t5_model import T5Model

    if mpu.get_pipeline_model_parallel_world_size() != 1:
        raise ConfigError("T5 inference runs without pipeline stages; launch tp processes only")
    full = read_hf_t5(source) if hf_io.is_hf_dir(source) else read_native_t5(source, iteration)
    tp = mpu.get_tensor_model_parallel_world_size()
    target = reshard(full, tp, 1, true_vocab=true_vocab)
    model = T5Model(get_family("t5").config_from_saved(target.args), parallel_output=False)
    state = stage_state(target.state, target.args, mpu.get_tensor_model_parallel_rank())
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise CheckpointError(f"checkpoint {source} does not fit the model its args describe: "
                              f"{str(exc).splitlines()[0]}") from None
    return model.eval(), target.args
