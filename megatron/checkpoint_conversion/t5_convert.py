"""Whole T5 conversions (HF or native at any layout, in and out) and inference loading.

Everything goes through a :class:`~.native_reader.FullCheckpoint` with T5Model keys, as the
GPT-2 conversions do, so HF -> native (any tp/pp), native -> HF and native -> native
(resharding) are one reader plus one writer each.
"""
import os
from dataclasses import dataclass
from typing import Optional

import torch

from .. import mpu
from ..errors import CheckpointError, ConfigError
from . import hf_io, t5_hf
from .convert import FORMATS, BaseConversionRequest  # noqa: F401 (FORMATS: tool flags)
from .native_reader import FullCheckpoint
from .t5_native import read_native_t5, reshard_t5, stage_state_t5, write_native_t5
from .vocab_padding import resolve_true_vocab_size, tokenizer_from_args

@dataclass
class T5ConversionRequest(BaseConversionRequest):
    """A T5 conversion (the flags of tools/convert_checkpoint_t5.py).

    Attributes:
        tokenizer_model: sentencepiece model recorded in the native output's args.
    """

    tokenizer_model: Optional[str] = None


def read_hf_t5(path, iteration=0, tokenizer_model=None):
    """An HF T5 directory as a :class:`FullCheckpoint` (real vocabulary rows only)."""
    config = hf_io.read_config(path)
    if config.get("model_type", "t5") != "t5":
        raise CheckpointError(f"{path} holds a {config.get('model_type')!r} model, not T5")
    state, args = t5_hf.hf_to_full(config, hf_io.read_weights(path))
    if tokenizer_model:
        if not os.path.isfile(tokenizer_model):
            raise ConfigError(f"--tokenizer-model {tokenizer_model} does not exist")
        args["tokenizer_model"] = os.path.abspath(tokenizer_model)
    return FullCheckpoint(state, args, iteration or 0, {})


def write_hf_t5(ckpt, path, true_vocab=None):
    """Write ``ckpt`` as a ``T5ForConditionalGeneration`` directory."""
    vocab = resolve_true_vocab_size(ckpt.args, true_vocab) or ckpt.args["padded_vocab_size"]
    tokenizer = tokenizer_from_args(ckpt.args)
    ids = {} if tokenizer is None else {"pad_id": tokenizer.pad, "eos_id": tokenizer.eod}
    config, weights = t5_hf.full_to_hf(ckpt.state, ckpt.args, vocab, **ids)
    hf_io.write_hf_dir(path, config, weights)


def run_t5_conversion(request):
    """Convert as ``request`` says; returns the path written (errors before any write)."""
    in_format = request.input_format or ("hf" if hf_io.is_hf_dir(request.input) else "native")
    for name, value in (("input", in_format), ("output", request.output_format)):
        if value not in FORMATS:
            raise ConfigError(f"--{name}-format {value!r}: use one of {FORMATS}")
    if os.path.abspath(request.input) == os.path.abspath(request.output):
        raise ConfigError("--input and --output are the same directory")
    if in_format == "hf":
        ckpt = read_hf_t5(request.input, request.iteration, request.tokenizer_model)
    else:
        ckpt = read_native_t5(request.input, request.iteration)
    if request.output_format == "hf":
        if request.tp not in (None, 1) or request.pp not in (None, 1):
            raise ConfigError("--target-tensor/pipeline-parallel-size apply to native output")
        write_hf_t5(ckpt, request.output, request.true_vocab)
        return request.output
    tp = request.tp or ckpt.args.get("tensor_model_parallel_size", 1)
    pp = request.pp or ckpt.args.get("pipeline_model_parallel_size", 1)
    target = reshard_t5(ckpt, tp, pp, request.divisible_by, request.true_vocab)
    return write_native_t5(target, request.output,
                           source=f"{in_format}:{os.path.abspath(request.input)}")


def t5_config_from_args(args, compute_dtype=torch.float32):
    """A dropout-free :class:`T5TransformerConfig` from a saved args dict."""
    from ..model.t5_layers import T5TransformerConfig

    return T5TransformerConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"],
        num_attention_heads=args["num_attention_heads"], kv_channels=args["kv_channels"],
        ffn_hidden_size=args["ffn_hidden_size"], vocab_size=args["padded_vocab_size"],
        num_buckets=args.get("relative_attention_num_buckets", 32),
        max_distance=args.get("relative_attention_max_distance", 128),
        ff_type=args.get("t5_ff", "relu"), tie_embeddings=not args.get("untie_embeddings"),
        hidden_dropout=0.0, attention_dropout=0.0,
        layernorm_epsilon=args.get("layernorm_epsilon", 1e-6),
        masked_softmax_fusion=args.get("masked_softmax_fusion", True),
        compute_dtype=compute_dtype)


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
    target = reshard_t5(full, tp, 1, true_vocab=true_vocab)
    model = T5Model(t5_config_from_args(target.args), parallel_output=False)
    state = stage_state_t5(target.state, target.args, mpu.get_tensor_model_parallel_rank())
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise CheckpointError(f"checkpoint {source} does not fit the model its args describe: "
                              f"{str(exc).splitlines()[0]}") from None
    return model.eval(), target.args
