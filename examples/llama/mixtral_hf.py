"""The Llama example as Mixtral <-> transformers' ``MixtralForCausalLM`` (transformers 5's
stacked experts: ``mlp.gate.weight [E, h]``, ``mlp.experts.gate_up_proj [E, 2f, h]`` with the
gate first, ``mlp.experts.down_proj [E, h, f]``: the layout of mpu's grouped experts, so the
tensors map one to one). Whole tensors on both sides: cut them for a layout (tp, ep) with
:func:`megatron.checkpoint.sharding.slice_recorded`, merge a layout's with ``merge_recorded``.
"""
import dataclasses

from llama_model import LlamaConfig, _hf_names
from megatron.mpu import moe

#: our per-layer MoE tensor -> transformers' (under ``model.layers.{i}.``)
_HF_MOE = {"mlp.router.weight": "mlp.gate.weight",
           "mlp.experts.weight1": "mlp.experts.gate_up_proj",
           "mlp.experts.weight2": "mlp.experts.down_proj"}
_DENSE_MLP = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")


def _names(config: LlamaConfig) -> dict:
    names = {ours: theirs for ours, theirs in _hf_names(config).items()
             if not ours.endswith(_DENSE_MLP)}
    for i in range(config.num_layers):
        names.update({f"{i + 1}.{ours}": f"model.layers.{i}.{theirs}"
                      for ours, theirs in _HF_MOE.items()})
    return names


def hf_config(config: LlamaConfig, max_positions: int = 2048):
    """transformers' ``MixtralConfig`` of the same model (every layer MoE, top-k softmax)."""
    from transformers import MixtralConfig

    m = config.moe
    return MixtralConfig(
        vocab_size=config.true_vocab_size or config.vocab_size,
        hidden_size=config.hidden_size, intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_theta": config.rope_theta, "rope_type": "default"},
        max_position_embeddings=max_positions, tie_word_embeddings=False,
        num_local_experts=m.num_experts, num_experts_per_tok=m.topk, router_jitter_noise=0.0,
        router_aux_loss_coef=m.aux_loss_coeff, hidden_act="silu", sliding_window=None)


def config_from_hf(hf: dict, padded_vocab: int, **block) -> LlamaConfig:
    """Our config of a ``MixtralConfig`` dict (every layer an MoE layer).

    Args:
        hf: the ``config.json`` dict.
        padded_vocab: the vocabulary rows of our embedding.
        **block: other :class:`~megatron.mpu.moe.MoEConfig` settings (``grouped_gemm`` ...).
    """
    from megatron.common.errors import ConfigError

    if hf.get("model_type", "mixtral") != "mixtral" or hf.get("sliding_window"):
        raise ConfigError(f"this Hugging Face model cannot be converted as Mixtral: model_type "
                          f"{hf.get('model_type')!r}, sliding_window {hf.get('sliding_window')}")
    rope = dict(hf.get("rope_parameters") or {})
    heads = hf["num_attention_heads"]
    block_config = moe.MoEConfig(
        num_experts=hf["num_local_experts"], topk=hf["num_experts_per_tok"],
        hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"],
        activation="swiglu", aux_loss_coeff=hf.get("router_aux_loss_coef", 0.0), **block)
    return LlamaConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"], vocab_size=padded_vocab,
        true_vocab_size=hf["vocab_size"],
        rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 1e6),
        norm_eps=float(hf.get("rms_norm_eps", 1e-5)), moe=block_config,
        moe_layers=(True,) * hf["num_hidden_layers"])


def to_hf(full: dict, config: LlamaConfig) -> dict:
    """Our whole tensors (vocabulary rows unpadded) -> a ``MixtralForCausalLM`` state dict."""
    vocab = config.true_vocab_size or config.vocab_size
    out = {theirs: full[ours] for ours, theirs in _names(config).items()}
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        out[key] = out[key][:vocab]
    return out


def from_hf(state: dict, config: LlamaConfig) -> dict:
    """A ``MixtralForCausalLM`` state dict -> our whole tensors."""
    return {ours: state[theirs] for ours, theirs in _names(config).items()}


def with_all_moe(config: LlamaConfig, block: moe.MoEConfig) -> LlamaConfig:
    """``config`` with every layer an MoE layer of ``block`` (Mixtral's structure)."""
    return dataclasses.replace(config, moe=block, moe_layers=(True,) * config.num_layers)
