"""Hugging Face T5 (``T5ForConditionalGeneration``) <-> full T5Model state dict and args: the T5
family's HF adapter (:func:`read_hf`, :func:`write_hf`; T5 with MoE layers is
``SwitchTransformersForConditionalGeneration``: :mod:`.switch_hf`).

Differences bridged here (everything else maps one to one, no transposes: both store
linear weights ``[out, in]``):

- HF's separate ``q``, ``k``, ``v`` (rows ``[heads, d_kv]`` each) are fused per head,
  ``[heads, (q, k, v), d_kv]``, in self-attention; cross-attention fuses ``k`` and ``v``.
- Gated-GeLU's ``wi_0`` (gate) and ``wi_1`` are interleaved per unit, ``[d_ff, (0, 1)]``.
- HF keeps each relative-bias table in the stack's first block; T5Model keeps it in the
  stack (``{stack}.relative_bias.weight``); both share it across the stack's layers.
- Output layer: HF's ``scale_decoder_outputs`` (transformers >= 5) or
  ``tie_word_embeddings`` (older files) says whether the decoder output is scaled by
  d_model^-0.5 against the shared embedding (T5 v1.0) or goes through ``lm_head`` unscaled
  (v1.1). T5Model ties exactly when it scales, so a scaled model with a separate lm_head
  that differs from the embedding cannot be represented (an error).
- The vocabulary is padded here with zero rows; HF keeps ``vocab_size`` rows.
"""
import os
import sys

import torch

from ..checkpoint import t5_keys
from ..checkpoint.native_reader import FullCheckpoint
from ..checkpoint.vocab_padding import resolve_true_vocab_size, tokenizer_from_args
from ..common.errors import CheckpointError, ConfigError
from . import hf_io

FF_TYPES = ("relu", "gated-gelu")


def _fuse(tensors, rows_per_head):
    """Per-head fuse: n tensors ``[heads * d, h]`` -> ``[heads * n * d, h]`` as ``[heads, n, d]``."""
    h = tensors[0].shape[-1]
    return torch.stack([t.reshape(-1, rows_per_head, h) for t in tensors], dim=1).reshape(-1, h)


def _unfuse(tensor, parts, rows_per_head):
    """Inverse of :func:`_fuse`: ``[heads * n * d, h]`` -> n tensors ``[heads * d, h]``."""
    grouped = tensor.view(-1, parts, rows_per_head, tensor.shape[-1])  # [heads, n, d, h]
    return [grouped[:, i].reshape(-1, tensor.shape[-1]).contiguous() for i in range(parts)]


def scales_output(config):
    """Whether HF scales the decoder output by d_model^-0.5 (tied T5 v1.0 style)."""
    if "scale_decoder_outputs" in config:
        return bool(config["scale_decoder_outputs"])
    return bool(config.get("tie_word_embeddings", True))


def hf_args(config):
    """The model part of a native args dict from an HF ``config.json`` dict."""
    layers, dec_layers = config["num_layers"], config.get("num_decoder_layers")
    if dec_layers not in (None, layers):
        raise CheckpointError(f"HF config has {layers} encoder and {dec_layers} decoder layers; "
                              f"T5Model uses the same number in both stacks")
    ff = config.get("feed_forward_proj", "relu")
    if ff not in FF_TYPES:
        raise CheckpointError(f"HF feed_forward_proj {ff!r} is not supported; T5Model has "
                              f"'relu' (T5 v1.0) and 'gated-gelu' (T5 v1.1)")
    return {"model_type": "t5", "num_layers": layers, "hidden_size": config["d_model"],
            "num_attention_heads": config["num_heads"], "kv_channels": config["d_kv"],
            "ffn_hidden_size": config["d_ff"], "true_vocab_size": config["vocab_size"],
            "relative_attention_num_buckets": config.get("relative_attention_num_buckets", 32),
            "relative_attention_max_distance": config.get("relative_attention_max_distance",
                                                          128),
            "t5_ff": ff, "untie_embeddings": not scales_output(config),
            "layernorm_epsilon": config.get("layer_norm_epsilon", 1e-6), "hidden_bias": False,
            # HF T5 has one dropout_rate for hidden states and attention probabilities.
            "hidden_dropout": config.get("dropout_rate", 0.1),
            "attention_dropout": config.get("dropout_rate", 0.1),
            "tokenizer_type": "SentencePieceTokenizer"}


def _get(weights, key):
    if key not in weights:
        raise CheckpointError(f"HF T5 weights lack {key}")
    return weights[key]


def _hf_layer(weights, stack, i, ff, head_dim, mlp=True):
    """One HF block -> ``{T5Model layer key: tensor}`` (no stack prefix); ``mlp`` False
    leaves the feed-forward out (the Switch Transformer's: switch_hf.py)."""
    block = f"{stack}.block.{i}.layer."
    out = {"input_layernorm.weight": _get(weights, block + "0.layer_norm.weight")}
    sa = block + "0.SelfAttention."
    out["self_attention.query_key_value.weight"] = _fuse(
        [_get(weights, sa + p + ".weight") for p in "qkv"], head_dim)
    out["self_attention.dense.weight"] = _get(weights, sa + "o.weight")
    out["post_attention_layernorm.weight"] = _get(weights, block + "1.layer_norm.weight")
    ff_index = 1
    if stack == "decoder":
        ca = block + "1.EncDecAttention."
        out["inter_attention.query.weight"] = _get(weights, ca + "q.weight")
        out["inter_attention.key_value.weight"] = _fuse(
            [_get(weights, ca + p + ".weight") for p in "kv"], head_dim)
        out["inter_attention.dense.weight"] = _get(weights, ca + "o.weight")
        out["post_inter_attention_layernorm.weight"] = _get(weights,
                                                            block + "2.layer_norm.weight")
        ff_index = 2
    if not mlp:
        return out
    mlp = f"{block}{ff_index}.DenseReluDense."
    if ff == "gated-gelu":
        out["mlp.dense_h_to_ff.weight"] = _fuse([_get(weights, mlp + "wi_0.weight"),
                                                 _get(weights, mlp + "wi_1.weight")], 1)
    else:
        out["mlp.dense_h_to_ff.weight"] = _get(weights, mlp + "wi.weight")
    out["mlp.dense_ff_to_h.weight"] = _get(weights, mlp + "wo.weight")
    return out


def _output_layer(weights, args, shared):
    """The untied lm head, or None; an error for a scaled model with a distinct lm head."""
    head = weights.get("lm_head.weight")
    if args["untie_embeddings"]:
        return (head if head is not None else shared).clone()
    if head is not None and not torch.equal(head, shared):
        raise CheckpointError("the HF model scales its decoder output (tied T5 v1.0 style) but "
                              "has an lm_head that differs from the shared embedding; T5Model "
                              "cannot represent that combination")
    return None


def hf_to_full(config, weights):
    """``(full T5Model state dict with the real vocabulary rows, model args dict)``.

    Args:
        config: HF ``config.json`` dict.
        weights: HF ``{name: tensor}``.
    """
    args = hf_args(config)
    shared = _get(weights, "shared.weight").float()
    state = {t5_keys.WORD_EMBEDDINGS: shared}
    for stack in t5_keys.STACKS:
        bias = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        state[f"{stack}.relative_bias.weight"] = _get(weights, bias)
        for i in range(args["num_layers"]):
            for key, tensor in _hf_layer(weights, stack, i, args["t5_ff"],
                                               args["kv_channels"]).items():
                state[f"{stack}.layers.{i}.{key}"] = tensor
        state[f"{stack}.final_layernorm.weight"] = _get(weights,
                                                        f"{stack}.final_layer_norm.weight")
    head = _output_layer(weights, args, shared)
    if head is not None:
        state[t5_keys.LM_HEAD] = head
    state = {k: v.float().contiguous() for k, v in state.items()}
    return state, args


def _native_layer(state, stack, i, ff, head_dim, mlp=True):
    """Inverse of :func:`_hf_layer`: one T5Model layer -> HF block tensors."""
    src = f"{stack}.layers.{i}."
    block = f"{stack}.block.{i}.layer."
    out = {block + "0.layer_norm.weight": state[src + "input_layernorm.weight"]}
    q, k, v = _unfuse(state[src + "self_attention.query_key_value.weight"], 3, head_dim)
    for name, tensor in zip("qkvo", (q, k, v, state[src + "self_attention.dense.weight"])):
        out[f"{block}0.SelfAttention.{name}.weight"] = tensor
    out[block + "1.layer_norm.weight"] = state[src + "post_attention_layernorm.weight"]
    ff_index = 1
    if stack == "decoder":
        k, v = _unfuse(state[src + "inter_attention.key_value.weight"], 2, head_dim)
        ca = block + "1.EncDecAttention."
        out.update({ca + "q.weight": state[src + "inter_attention.query.weight"],
                    ca + "k.weight": k, ca + "v.weight": v,
                    ca + "o.weight": state[src + "inter_attention.dense.weight"],
                    block + "2.layer_norm.weight":
                        state[src + "post_inter_attention_layernorm.weight"]})
        ff_index = 2
    if not mlp:
        return out
    mlp = f"{block}{ff_index}.DenseReluDense."
    wi = state[src + "mlp.dense_h_to_ff.weight"]
    if ff == "gated-gelu":
        out[mlp + "wi_0.weight"], out[mlp + "wi_1.weight"] = _unfuse(wi, 2, 1)
    else:
        out[mlp + "wi.weight"] = wi
    out[mlp + "wo.weight"] = state[src + "mlp.dense_ff_to_h.weight"]
    return out


def full_to_hf(state, args, vocab_size, pad_id=0, eos_id=1):
    """``(config dict, {HF name: tensor})`` for ``T5ForConditionalGeneration``.

    Args:
        state: full T5Model state dict.
        args: the checkpoint's args (model sizes, ``t5_ff``, ``untie_embeddings``).
        vocab_size: rows to keep (the real vocabulary).
        pad_id, eos_id: the tokenizer's pad (also the decoder start) and eos ids.
    """
    untied, ff = bool(args.get("untie_embeddings")), args.get("t5_ff", "relu")
    weights = {"shared.weight": state[t5_keys.WORD_EMBEDDINGS][:vocab_size]}
    if untied:
        weights["lm_head.weight"] = state[t5_keys.LM_HEAD][:vocab_size]
    for stack in t5_keys.STACKS:
        bias = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        weights[bias] = state[f"{stack}.relative_bias.weight"]
        for i in range(args["num_layers"]):
            weights.update(_native_layer(state, stack, i, ff, args["kv_channels"]))
        weights[f"{stack}.final_layer_norm.weight"] = state[f"{stack}.final_layernorm.weight"]
    config = {
        "architectures": ["T5ForConditionalGeneration"], "model_type": "t5",
        "vocab_size": vocab_size, "d_model": args["hidden_size"], "d_kv": args["kv_channels"],
        "d_ff": args["ffn_hidden_size"], "num_layers": args["num_layers"],
        "num_decoder_layers": args["num_layers"], "num_heads": args["num_attention_heads"],
        "relative_attention_num_buckets": args.get("relative_attention_num_buckets", 32),
        "relative_attention_max_distance": args.get("relative_attention_max_distance", 128),
        "feed_forward_proj": ff, "layer_norm_epsilon": args.get("layernorm_epsilon", 1e-6),
        "tie_word_embeddings": not untied, "scale_decoder_outputs": not untied,
        "is_encoder_decoder": True, "pad_token_id": pad_id, "eos_token_id": eos_id,
        "decoder_start_token_id": pad_id, "initializer_factor": 1.0,
        # One rate in HF: the hidden-state dropout (T5 trains both at the same rate).
        "dropout_rate": args.get("hidden_dropout", 0.1),
    }
    return config, {k: v.contiguous() for k, v in weights.items()}


# ---------------------------------------------------------------- the adapter
FAMILY = "t5"


def read_hf(path, request=None):
    """An HF T5 directory as a :class:`FullCheckpoint` (real vocabulary rows only).

    Args:
        path: a ``save_pretrained`` directory.
        request: the conversion request (its ``iteration`` and ``tokenizer_model`` go into
            the native output), or None.
    """
    iteration = getattr(request, "iteration", None)
    tokenizer_model = getattr(request, "tokenizer_model", None)
    config = hf_io.read_config(path)
    if config.get("model_type") == "switch_transformers":  # T5 with MoE layers
        from . import switch_hf

        state, args = switch_hf.hf_to_full(config, hf_io.read_weights(path), sys.modules[__name__])
    elif config.get("model_type", "t5") != "t5":
        raise CheckpointError(f"{path} holds a {config.get('model_type')!r} model, not T5 "
                              f"(or Switch Transformers)")
    else:
        state, args = hf_to_full(config, hf_io.read_weights(path))
    if tokenizer_model:
        if not os.path.isfile(tokenizer_model):
            raise ConfigError(f"--tokenizer-model {tokenizer_model} does not exist")
        args["tokenizer_model"] = os.path.abspath(tokenizer_model)
    return FullCheckpoint(state, args, iteration or 0, {})


def write_hf(ckpt, path, request=None):
    """Write ``ckpt`` as a ``T5ForConditionalGeneration`` directory."""
    true_vocab = getattr(request, "true_vocab", None)
    vocab = resolve_true_vocab_size(ckpt.args, true_vocab) or ckpt.args["padded_vocab_size"]
    tokenizer = tokenizer_from_args(ckpt.args)
    ids = {} if tokenizer is None else {"pad_id": tokenizer.pad, "eos_id": tokenizer.eod}
    if ckpt.args.get("num_experts"):  # the Switch Transformer
        from ..config.moe import moe_layer_pattern
        from . import switch_hf

        pattern = moe_layer_pattern(ckpt.args.get("moe_layer_freq", "1"),
                                    ckpt.args["num_layers"])
        config, weights = switch_hf.full_to_hf(ckpt.state, ckpt.args, pattern, vocab,
                                               sys.modules[__name__], **ids)
    else:
        config, weights = full_to_hf(ckpt.state, ckpt.args, vocab, **ids)
    hf_io.write_hf_dir(path, config, weights)
