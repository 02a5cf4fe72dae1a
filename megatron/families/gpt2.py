"""GPT-2, described once: model config from flags, the model (serial or pipeline stages of the
same layers), its batch and loss, datasets, FLOP count, checkpoint keys and HF adapter."""
from typing import Any

import torch

from ..checkpoint import gpt2_keys, megatron_core, megatron_lm
from ..checkpoint_conversion import hf_gpt2
from ..config.run_config import RunConfig
from ..model.language_model import masked_lm_loss
from ..model.transformer import ParallelTransformerLayer
from .base import FEATURES, ModelFamily, pipeline_placement, pipeline_topology, transformer_kwargs
from .decoder_lm import build_datasets, make_batch_fn  # noqa: F401 (GPT-2's, public here)


def model_config(cfg: RunConfig, dropout: bool = True) -> Any:
    """The :class:`~megatron.model.transformer.TransformerConfig` of a run or a checkpoint
    (arguments: :func:`megatron.families.transformer_kwargs`)."""
    from ..model.transformer import TransformerConfig

    m = cfg.model
    moe = moe_layers = None
    if cfg.moe.enabled:  # experts: GPT-2's GeLU MLP, fc2 at the residual's scaled std
        moe = cfg.moe.block(m.hidden_size, m.ffn_hidden_size, "gelu", m.init_method_std,
                            m.init_method_std / (2.0 * m.num_layers) ** 0.5)
        moe_layers = tuple(cfg.moe.layers(m.num_layers))
    return TransformerConfig(**transformer_kwargs(cfg, dropout),
                             init_method_std=m.init_method_std, bias=m.hidden_bias,
                             moe=moe, moe_layers=moe_layers)


def build_model(cfg: RunConfig, pipeline: bool, parallel_output: bool = True) -> torch.nn.Module:
    """GPT2Model, or GPT2ModelPipe (a tds PipelineModule) when ``pipeline``."""
    config = model_config(cfg)
    if pipeline:
        from ..model.gpt2_model_pipe import GPT2ModelPipe

        return GPT2ModelPipe(config, cfg.model.padded_vocab_size,
                             cfg.model.max_position_embeddings, pipeline_topology(),
                             loss_fn=masked_lm_loss, num_virtual_stages=cfg.parallel.vpp,
                             placement=pipeline_placement(cfg))
    from ..model.gpt2_model import GPT2Model

    return GPT2Model(config, cfg.model.padded_vocab_size, cfg.model.max_position_embeddings,
                     parallel_output)


def flops_per_step(cfg: RunConfig) -> float:
    """Matmul FLOPs of one training step (forward + backward = 3 x forward, no recompute),
    from the real sizes: attention width ``heads x kv_channels`` and ``ffn_hidden_size``
    (Megatron's ``72 B s l h^2 (1 + s / 6h + V / 12lh)`` when they are h and 4h).

    Per token and layer (multiply-adds): QKV ``h x 3a``, scores and context ``2 s a``,
    output ``a x h``, MLP ``2 h f`` (a = heads x kv, f = ffn); logits ``h x V``. An MoE
    layer counts what a token runs through (the active parameters): the router ``h x E``,
    its k experts ``k x 2 h f_e`` and the shared experts ``2 h f_s``.
    """
    b, s = cfg.batch.global_batch_size, cfg.batch.seq_length
    m = cfg.model
    h, vocab = m.hidden_size, m.padded_vocab_size
    # a saved configuration without the sizes had validation's defaults: 4h and h / heads
    ffn = m.ffn_hidden_size or 4 * h
    attn = m.num_attention_heads * m.kv_channels if m.kv_channels and m.num_attention_heads \
        else h
    attention = 3 * h * attn + 2 * s * attn + attn * h  # multiply-adds / token
    layers = sum(attention + mlp_multiply_adds(cfg, h, ffn, moe)
                 for moe in cfg.moe.layers(m.num_layers))
    return 3.0 * 2.0 * b * s * (layers + h * vocab)


def mlp_multiply_adds(cfg: RunConfig, h: int, ffn: int, moe: bool, gated: bool = False) -> int:
    """Multiply-adds per token of one feed-forward: dense ``2 h f`` (3 h f gated), or an MoE
    block's active ones (router, top-k experts, shared experts).

    Args:
        cfg: the run (its ``cfg.moe``).
        h, ffn: the model's width and dense FFN width.
        moe: whether the layer has an MoE block.
        gated: a gated FFN (SwiGLU / GeGLU: three matrices).
    """
    per = (3 if gated else 2) * h
    if not moe:
        return per * ffn
    s = cfg.moe
    shared = s.moe_shared_expert_intermediate_size or 0
    return h * s.num_experts + s.moe_router_topk * per * (s.moe_ffn_hidden_size or ffn) + \
        per * shared


def _add_flags(parser):
    return parser


FAMILY = ModelFamily(
    name="gpt2", add_flags=_add_flags, model_config=model_config, build_model=build_model,
    build_datasets=build_datasets, flops_per_step=flops_per_step, make_batch_fn=make_batch_fn,
    loss_fn=masked_lm_loss, keys=gpt2_keys, hf=hf_gpt2,
    foreign_checkpoints=(megatron_core, megatron_lm),
    flag_defaults={"tokenizer_type": "GPT2BPETokenizer"},
    compile_classes=(ParallelTransformerLayer,), supports=frozenset(FEATURES),
    memory_model="gpt2")
