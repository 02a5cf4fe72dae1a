"""GPT-2 transformer on tensor-parallel layers. Activations are ``[s, b, h]`` throughout.

Per layer (pre-LayerNorm, GPT-2):
    x = x + dropout(attention(ln_1(x)))      attention: QKV column-parallel, dense row-parallel
    x = x + dropout(mlp(ln_2(x)))            mlp: fc1 column-parallel, GeLU, fc2 row-parallel
Each block does one all-reduce forward (in the row-parallel layer) and one backward (in
the column-parallel layer's ``f``), as in the Megatron-LM paper. With ``--num-experts`` the
layers ``--moe-layer-freq`` picks have an MoE block (megatron.mpu.moe) in the MLP's place.
"""
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import mpu
from .attention import (
    DEFAULT_ATTENTION_BACKEND,
    bmm_attention,
    resolve_attention_backend,
    sdpa_attention,
)
from .fused_layer_norm import MixedFusedLayerNorm
from .fused_softmax import AttnMaskType, FusedScaleMaskSoftmax
from .recompute import block_count, core_attention, recompute_core, run_layers
from .utils import init_method_normal, init_rng, scaled_init_method_normal


@dataclass(kw_only=True)
class ModelRunOptions:
    """The settings every model takes from the run rather than from its sizes (GPT-2's
    :class:`TransformerConfig` and T5's config extend it; keyword-only)."""

    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    checkpoint_activations: bool = False
    """Recompute each group of ``checkpoint_num_layers`` layers in the backward."""
    checkpoint_num_layers: int = 1
    recompute_granularity: Optional[str] = None
    """``full``, ``selective`` or None (megatron/config/recompute.py); full + uniform is
    ``checkpoint_activations``."""
    recompute_method: Optional[str] = None
    """Full recompute's ``uniform`` or ``block``."""
    recompute_num_layers: Optional[int] = None
    """Block: layers at the start of each stage or chunk that keep only their input."""
    masked_softmax_fusion: bool = True
    """Allow the fused masked-softmax kernel (``--[no-]masked-softmax-fusion``)."""
    compute_dtype: torch.dtype = torch.float32
    """dtype the scores arrive in (autocast), for choosing the softmax kernel."""
    seed: int = 1234
    """Base of the per-layer initialisation seeds."""
    true_vocab_size: Optional[int] = None
    """The tokenizer's vocabulary; the (padded) rows beyond it get -inf logits. None: no padding."""
    sequence_parallel: bool = False
    """Norm/dropout/residual activations split along the sequence (--sequence-parallel)."""
    attention_backend: str = DEFAULT_ATTENTION_BACKEND
    """``sdpa`` (scaled_dot_product_attention) or ``unfused`` (bmm + fused softmax);
    see megatron/model/attention.py."""
    token_layout: bool = False
    """The mask slot carries the token layout (context parallelism, document masking:
    megatron/mpu/context_parallel.py), not a bool mask; a pipeline declares it ``int``."""
    cp_comm_type: str = "p2p"
    """How the context-parallel attention exchanges keys and values (``--cp-comm-type``)."""
    fp8: Optional[mpu.Fp8Recipe] = None
    """The layers' column- and row-parallel linears run their GEMMs in FP8 with this recipe
    (``--fp8-format``); embedding, output layer and norms stay in the compute dtype."""


@dataclass
class TransformerConfig(ModelRunOptions):
    """Sizes and options of a GPT-2 transformer stack (from flags: megatron.families.gpt2)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    kv_channels: int
    """Per-head size (CPM's --kv-hidden-size)."""
    ffn_hidden_size: int
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    bias: bool = True
    """Biases in the linear layers (--hidden-bias; the experts of MoE layers have none)."""
    moe: Optional[mpu.moe.MoEConfig] = None
    """The MoE block of the layers ``moe_layers`` marks (``--num-experts``), or None."""
    moe_layers: Optional[Tuple[bool, ...]] = None
    """Per layer: an MoE block instead of the dense MLP (``--moe-layer-freq``)."""

    def is_moe_layer(self, layer_number: int) -> bool:
        """Whether 1-based layer ``layer_number`` has an MoE feed-forward."""
        return self.moe is not None and bool(self.moe_layers[layer_number - 1])


def make_layer_norm(config):
    return MixedFusedLayerNorm(config.hidden_size, eps=config.layernorm_epsilon,
                               device=mpu.get_device(),
                               sequence_parallel=config.sequence_parallel)


class ParallelMLP(nn.Module):
    """h -> ffn (split across tp) -> GeLU -> h."""

    def __init__(self, config):
        super().__init__()
        std = config.init_method_std
        self.dense_h_to_4h = mpu.ColumnParallelLinear(
            config.hidden_size, config.ffn_hidden_size, bias=config.bias, gather_output=False,
            init_method=init_method_normal(std), sequence_parallel=config.sequence_parallel,
            fp8=config.fp8)
        self.dense_4h_to_h = mpu.RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, bias=config.bias, input_is_parallel=True,
            init_method=scaled_init_method_normal(std, config.num_layers),
            sequence_parallel=config.sequence_parallel, fp8=config.fp8)

    def forward(self, hidden):  # [s, b, h] (SP: [s/tp, b, h] in and out)
        intermediate, _ = self.dense_h_to_4h(hidden)  # [s, b, ffn/tp]
        output, _ = self.dense_4h_to_h(F.gelu(intermediate, approximate="tanh"))
        return output  # [s, b, h]


class ParallelSelfAttention(nn.Module):
    """Causal multi-head self-attention with the heads split across tensor-parallel ranks.

    The fused QKV weight is laid out per head, ``[heads, (q, k, v), kv_channels]`` along its
    output dimension, so a contiguous split gives each rank whole heads.
    """

    def __init__(self, config, layer_number):
        super().__init__()
        self.layer_number = layer_number
        tp = self.tp_size = mpu.get_tensor_model_parallel_world_size()
        self.heads_per_partition = mpu.divide(config.num_attention_heads, tp,
                                              "attention heads", "tensor-model-parallel size")
        self.head_dim = config.kv_channels
        projection = config.kv_channels * config.num_attention_heads
        std = config.init_method_std
        self.query_key_value = mpu.ColumnParallelLinear(
            config.hidden_size, 3 * projection, bias=config.bias, gather_output=False,
            init_method=init_method_normal(std), sequence_parallel=config.sequence_parallel,
            fp8=config.fp8)
        self.scale_mask_softmax = FusedScaleMaskSoftmax.for_dtype(
            config.compute_dtype, AttnMaskType.causal, config.masked_softmax_fusion,
            attention_mask_func, scale=1.0 / math.sqrt(self.head_dim))
        self.attention_dropout = nn.Dropout(config.attention_dropout)
        self.attention_backend = resolve_attention_backend(config.attention_backend)
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.cp_comm_type = config.cp_comm_type
        self.recompute_core = recompute_core(config)  # selective recompute
        self.dense = mpu.RowParallelLinear(
            projection, config.hidden_size, bias=config.bias, input_is_parallel=True,
            init_method=scaled_init_method_normal(std, config.num_layers),
            sequence_parallel=config.sequence_parallel, fp8=config.fp8)

    def forward(self, hidden, attention_mask, kv_cache=None):  # [sq, b, h] (SP: [sq/tp, b, h])
        np_, hn = self.heads_per_partition, self.head_dim
        mixed, _ = self.query_key_value(hidden)  # [sq, b, np * 3 * hn], gathered under SP
        sq, b = mixed.shape[:2]
        q, k, v = mixed.view(sq, b, np_, 3 * hn).split(hn, dim=-1)  # each [sq, b, np, hn]
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_number - 1, k, v)  # [sk, b, np, hn]
        sk = k.shape[0]
        if kv_cache is not None and attention_mask is not None:
            attention_mask = attention_mask[..., sk - sq:sk, :sk]
        if mpu.is_token_layout(attention_mask):  # context parallelism / document masking
            context = mpu.context_parallel_attention(q, k, v, attention_mask, scale=self.scale,
                                                     comm_type=self.cp_comm_type)
        else:
            context = core_attention(self._core, self.recompute_core and kv_cache is None,
                                     self.training, q, k, v, attention_mask)  # [sq, b, np*hn]
        output, _ = self.dense(context)
        return output  # [sq, b, h]

    def _core(self, q, k, v, attention_mask):
        """Scores, softmax, dropout and context: ``[s, b, np, hn]`` -> ``[sq, b, np * hn]``."""
        if self.attention_backend == "sdpa":
            return sdpa_attention(q, k, v, scale=self.scale, causal=True,
                                  mask=_extra_mask(attention_mask),
                                  dropout_p=self.attention_dropout.p if self.training else 0.0,
                                  per_rank_dropout=self.tp_size > 1)
        return bmm_attention(q, k, v, self.scale_mask_softmax, self.attention_dropout,
                             mask=attention_mask, per_rank_dropout=self.tp_size > 1)


def _extra_mask(attention_mask):
    """The part of a GPT-2 mask that the causal triangle does not already cover.

    A batch-broadcast ``[1, 1, s, s]`` mask is the causal triangle itself (what
    ``get_ltor_masks_and_position_ids`` builds, as Megatron-LM's does without
    ``reset_attention_mask``), so it is not read: the triangle comes from ``is_causal`` and
    the flash kernel stays eligible, as in Megatron-LM's flash path. A per-sample
    ``[b, 1, s, s]`` mask (b > 1, e.g. document boundaries) is applied on top.
    """
    if attention_mask is None or attention_mask.shape[0] == 1:
        return None
    return attention_mask


def attention_mask_func(scores, mask):
    """Megatron's mask function: masked scores become -10000 (True in ``mask`` = masked)."""
    return scores.masked_fill_(mask, -10000.0)


class ParallelTransformerLayer(nn.Module):
    """One pre-LayerNorm GPT-2 block; weights drawn from a seed of its own (layer_number)."""

    def __init__(self, config, layer_number):
        super().__init__()
        self.layer_number = layer_number
        with init_rng(config.seed, "transformer_layer", layer_number):
            self.input_layernorm = make_layer_norm(config)
            self.attention = ParallelSelfAttention(config, layer_number)
            self.post_attention_layernorm = make_layer_norm(config)
            if config.is_moe_layer(layer_number):  # [s, b, h] -> [s, b, h] like the MLP
                self.mlp = mpu.moe.MoELayer(config.moe, layer_number, config.sequence_parallel)
            else:
                self.mlp = ParallelMLP(config)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)
        self.sequence_parallel = config.sequence_parallel

    def _dropout(self, x):
        return mpu.sequence_parallel_dropout(self.hidden_dropout, x, self.sequence_parallel)

    def forward(self, hidden, attention_mask, kv_cache=None):  # [s, b, h] (SP: [s/tp, b, h])
        attn = self.attention(self.input_layernorm(hidden), attention_mask, kv_cache)
        hidden = hidden + self._dropout(attn)
        return hidden + self._dropout(self.mlp(self.post_attention_layernorm(hidden)))


class ParallelTransformer(nn.Module):
    """``num_layers`` blocks and the final LayerNorm, with optional activation recompute."""

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            ParallelTransformerLayer(config, i + 1) for i in range(config.num_layers))
        self.final_layernorm = make_layer_norm(config)

    def _run(self, start, end):
        def run(hidden, attention_mask):
            for layer in self.layers[start:end]:
                hidden = layer(hidden, attention_mask)
            return hidden

        return run

    def forward(self, hidden, attention_mask, kv_cache=None):  # [s, b, h]
        if self.config.checkpoint_activations and self.training and kv_cache is None:
            step = self.config.checkpoint_num_layers
            for start in range(0, len(self.layers), step):
                hidden = mpu.checkpoint(self._run(start, start + step), hidden, attention_mask)
        elif kv_cache is None:  # block recompute: the first layers keep only their input
            hidden = run_layers(self.layers, block_count(self.config), self.training,
                                hidden, attention_mask)
        else:
            for layer in self.layers:
                hidden = layer(hidden, attention_mask, kv_cache)
        return self.final_layernorm(hidden)
