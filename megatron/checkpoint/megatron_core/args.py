"""Megatron-Core's saved ``args`` <-> this project's saved-args dict.

The sizes are read as for Megatron-LM's own checkpoints (:func:`..megatron_lm.args.model_args`:
from the tensors, checked against the args, the heads from the args or the caller's hints);
here only what Megatron-Core adds: the features of its ``GPTModel`` that GPT2Model does not
compute are refused by name, and a written checkpoint's args say what Megatron-LM's
``GPTModel`` must be built with to load it (learned positions, LayerNorm, GeLU, tied output
layer, as GPT-2).
"""
import argparse
from typing import Any, Dict, Mapping, Tuple

from ...common.errors import ConfigError
from ..megatron_lm.args import megatron_namespace

#: ``(saved arg, what is not zero / true for a model GPT2Model computes, feature)``.
_FEATURES = (("num_experts", "mixture of experts"),
             ("moe_layer_freq_list", "mixture of experts"),
             ("qk_layernorm", "query/key LayerNorm"),
             ("multi_latent_attention", "multi-latent attention"),
             ("squared_relu", "squared ReLU"),
             ("gated_linear_unit", "a gated linear unit (SwiGLU / GeGLU)"),
             ("mtp_num_layers", "multi-token prediction"),
             ("hybrid_override_pattern", "a hybrid (Mamba) layer pattern"),
             ("heterogeneous_layers_config_path", "heterogeneous layers"))


def check_core_supported(saved: Mapping[str, Any]) -> None:
    """Raise ConfigError for a Megatron-Core model GPT2Model does not compute (what
    :func:`..megatron_lm.args.check_supported` checks, plus Megatron-Core's own features).

    Args:
        saved: the checkpoint's args as a dict (stand-ins replaced by their values).
    """
    problems = [f"{name}={saved[name]!r} ({feature})" for name, feature in _FEATURES
                if saved.get(name)]
    heads, groups = saved.get("num_attention_heads"), saved.get("num_query_groups")
    if saved.get("group_query_attention") and groups and heads and groups != heads:
        problems.append(f"num_query_groups={groups} of {heads} heads (grouped-query attention)")
    if saved.get("add_qkv_bias") and saved.get("add_bias_linear") is False:
        problems.append("add_qkv_bias=True without add_bias_linear (biases on the QKV only)")
    if saved.get("transformer_impl") == "inference_optimized":
        problems.append("transformer_impl='inference_optimized'")
    if problems:
        raise ConfigError("this Megatron-Core model is not a GPT-2 that GPT2Model computes: "
                          + ", ".join(problems))


def core_namespace(args: Dict[str, Any], iteration: int,
                   consumed: Tuple[int, int] = (0, 0)) -> argparse.Namespace:
    """The ``args`` a written Megatron-Core checkpoint saves: Megatron-LM's settings
    (:func:`..megatron_lm.args.megatron_namespace`) and the ones that make Megatron-LM build
    GPT-2's structure with Megatron-Core's ``GPTModel``.

    Args:
        args: this project's saved-args dict of the target layout.
        iteration: the iteration saved.
        consumed: (consumed train samples, consumed valid samples).
    """
    namespace = megatron_namespace(args, iteration, consumed)
    heads = args["num_attention_heads"]
    bias = bool(args.get("hidden_bias", True))
    vars(namespace).update(
        position_embedding_type="learned_absolute", normalization="LayerNorm",
        num_query_groups=heads, group_query_attention=False, swiglu=False,
        add_bias_linear=bias, add_qkv_bias=bias, untie_embeddings_and_output_weights=False,
        share_embeddings_and_output_weights=True, use_legacy_models=False,
        ckpt_format="torch_dist", num_experts=None, qk_layernorm=False,
        multi_latent_attention=False, squared_relu=False, gated_linear_unit=False)
    if args.get("true_vocab_size"):  # not Megatron-LM's: read back by this project's reader
        namespace.true_vocab_size = int(args["true_vocab_size"])
    return namespace

