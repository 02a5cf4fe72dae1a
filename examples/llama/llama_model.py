"""A Llama-style decoder on megatron-tds: RMSNorm, rotary positions, SwiGLU, grouped-query
attention, no biases, untied output layer. The walk-through is docs/new_model.md. With
``--num-experts`` it is Mixtral: the layers ``--moe-layer-freq`` picks have mpu's MoE block
(SwiGLU experts, top-k softmax router) in the MLP's place.

One list of layers (:func:`llama_specs`) is both models: :class:`LlamaModel` builds it in one
process, :class:`LlamaModelPipe` as tds pipeline stages. Both name a tensor by its layer's
index in that list (``"3.self_attn.q_proj.weight"``), so a checkpoint's names do not depend
on the layout, and the sharding the mpu layers record with it is all a resume at another
(tp, pp, v) needs: no key map. :data:`LLAMA` is the model family ``pretrain()`` takes.

Between pipeline stages travels ``(hidden [s, b, h] float, attention_mask [1, 1, s, s]
bool)`` (with --sequence-parallel the hidden state is the rank's ``[s/tp, b, h]``; under
context parallelism or document masking the mask slot carries mpu's int token layout
``[1 or 2, b, s / cp]`` and ``s`` is the rank's ``s / cp`` tokens).
"""
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron import mpu
from megatron.families import (FEATURES, ModelFamily, pipeline_placement, pipeline_topology,
                               uses_token_layout)
from megatron.families import decoder_lm  # batch function, datasets, stage contract
from megatron.model.language_model import masked_lm_loss
from megatron.model.utils import init_method_normal, init_rng


@dataclass(frozen=True)
class LlamaConfig:
    """The model's sizes and switches (built from a run's flags by :func:`model_config`)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    ffn_hidden_size: int
    vocab_size: int
    """Padded vocabulary rows (divisible by tp)."""
    true_vocab_size: Optional[int] = None
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_method_std: float = 0.02
    seed: int = 1234
    sequence_parallel: bool = False
    checkpoint_activations: bool = False
    token_layout: bool = False
    """The mask slot carries mpu's token layout (context parallelism, document masking):
    positions for the rotary angles and the attention's document starts."""
    cp_comm_type: str = "p2p"
    """How the context-parallel attention exchanges keys and values (``--cp-comm-type``)."""
    moe: Optional[Any] = None
    """The :class:`megatron.mpu.moe.MoEConfig` of the MoE layers (Mixtral), or None."""
    moe_layers: Optional[tuple] = None
    """Per layer: an MoE block instead of the SwiGLU MLP."""
    fp8: Optional[mpu.Fp8Recipe] = None
    """The layers' projections in FP8 with this recipe (``--fp8-format``); the embedding,
    the norms and the untied output layer stay in the compute dtype."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def _linear(config, kind, n_in, n_out, fp8=True):
    """A bias-free column- (``"col"``, output split) or row-parallel (``"row"``) linear; in
    FP8 when the config asks for it, unless ``fp8`` is False (the output layer)."""
    init = init_method_normal(config.init_method_std)
    sp, recipe = config.sequence_parallel, config.fp8 if fp8 else None
    if kind == "col":
        return mpu.ColumnParallelLinear(n_in, n_out, bias=False, gather_output=False,
                                        init_method=init, sequence_parallel=sp, fp8=recipe)
    return mpu.RowParallelLinear(n_in, n_out, bias=False, input_is_parallel=True,
                                 init_method=init, sequence_parallel=sp, fp8=recipe)


class LlamaEmbedding(nn.Module):
    """``(tokens [b, s], position_ids, mask) -> (hidden [s, b, h], mask)``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        with init_rng(config.seed, "embedding"):
            self.embed_tokens = mpu.VocabParallelEmbedding(
                config.vocab_size, config.hidden_size,
                init_method=init_method_normal(config.init_method_std))

    def forward(self, inputs):
        tokens, _, attention_mask = inputs
        hidden = self.embed_tokens(tokens).transpose(0, 1).contiguous()  # [s, b, h]
        if self.sequence_parallel:
            hidden = mpu.scatter_to_sequence_parallel_region(hidden)  # [s/tp, b, h]
        return hidden, attention_mask


class LlamaLayer(nn.Module):
    """One decoder layer: ``(hidden, mask) -> (hidden, mask)``.

    Attention: queries split by head across tensor-parallel ranks, keys and values by
    key-value head (each rank holds whole groups), positions rotated (RoPE), then
    ``scaled_dot_product_attention``; MLP: ``down(silu(gate(x)) * up(x))``.
    """

    def __init__(self, config: LlamaConfig, index: int):
        super().__init__()
        h, d = config.hidden_size, config.head_dim
        q_out, kv_out = config.num_attention_heads * d, config.num_key_value_heads * d
        sp = config.sequence_parallel
        self.head_dim = d
        with init_rng(config.seed, "layer", index):
            self.input_layernorm = mpu.RMSNorm(h, config.norm_eps, sequence_parallel=sp)
            self.q_proj = _linear(config, "col", h, q_out)
            self.k_proj = _linear(config, "col", h, kv_out)
            self.v_proj = _linear(config, "col", h, kv_out)
            self.o_proj = _linear(config, "row", q_out, h)
            self.post_attention_layernorm = mpu.RMSNorm(h, config.norm_eps,
                                                        sequence_parallel=sp)
            self.mlp = None
            if config.moe is not None and config.moe_layers[index]:  # Mixtral
                self.mlp = mpu.moe.MoELayer(config.moe, index + 1, sp)
            else:
                self.gate_proj = _linear(config, "col", h, config.ffn_hidden_size)
                self.up_proj = _linear(config, "col", h, config.ffn_hidden_size)
                self.down_proj = _linear(config, "row", config.ffn_hidden_size, h)
        self.rotary = mpu.RotaryEmbedding(d, config.rope_theta)
        self.cp_comm_type = config.cp_comm_type

    def attention(self, x, attention_mask):
        q, k, v = self.q_proj(x)[0], self.k_proj(x)[0], self.v_proj(x)[0]  # [s, b, n/tp * d]
        s, b = q.shape[:2]
        q, k, v = (t.view(s, b, -1, self.head_dim) for t in (q, k, v))  # [s, b, n, d]
        if mpu.is_token_layout(attention_mask):  # context parallelism / document masking
            # each token's own position: a context-parallel rank's chunks, or per document
            cos, sin = self.rotary.at_positions(mpu.layout_positions(attention_mask))
            q, k = mpu.apply_rotary(q, cos, sin), mpu.apply_rotary(k, cos, sin)
            out = mpu.context_parallel_attention(q, k, v, attention_mask,
                                                 comm_type=self.cp_comm_type)
            return self.o_proj(out)[0]
        cos, sin = self.rotary(s, q.device)
        q, k = mpu.apply_rotary(q, cos, sin), mpu.apply_rotary(k, cos, sin)
        group = q.shape[2] // k.shape[2]  # query heads per key-value head
        k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, d]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask)
        out = out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, n/tp * d]
        return self.o_proj(out)[0]

    def forward(self, inputs):
        hidden, attention_mask = inputs  # [s, b, h] (SP: [s/tp, b, h]), [1, 1, s, s]
        hidden = hidden + self.attention(self.input_layernorm(hidden), attention_mask)
        x = self.post_attention_layernorm(hidden)
        if self.mlp is not None:
            return hidden + self.mlp(x), attention_mask
        mlp = self.down_proj(F.silu(self.gate_proj(x)[0]) * self.up_proj(x)[0])[0]
        return hidden + mlp, attention_mask


class LlamaFinalNorm(nn.Module):
    """``(hidden, mask) -> hidden``."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.norm = mpu.RMSNorm(config.hidden_size, config.norm_eps,
                                sequence_parallel=config.sequence_parallel)

    def forward(self, inputs):
        return self.norm(inputs[0])


class LlamaHead(nn.Module):
    """``hidden [s, b, h] -> logits [b, s, v/tp]`` (untied; padded vocabulary at -inf)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.true_vocab_size = config.true_vocab_size
        with init_rng(config.seed, "lm_head"):
            self.lm_head = _linear(config, "col", config.hidden_size, config.vocab_size,
                                   fp8=False)  # the output layer stays in bf16
        mpu.mark_padded_vocab_rows(self.lm_head.weight)

    def forward(self, hidden):
        logits = self.lm_head(hidden)[0]  # [s, b, v/tp]
        mpu.mask_padded_vocab_logits_(logits, self.true_vocab_size)
        return logits.transpose(0, 1)


def llama_specs(config: LlamaConfig) -> list:
    """The model as tds layer specs: embedding, ``num_layers`` layers, final norm, head."""
    from tds.pipe import LayerSpec

    return ([LayerSpec(LlamaEmbedding, config)]
            + [LayerSpec(LlamaLayer, config, i) for i in range(config.num_layers)]
            + [LayerSpec(LlamaFinalNorm, config), LayerSpec(LlamaHead, config)])


class LlamaModel(nn.Module):
    """The layers of :func:`llama_specs` in one process, named as the pipeline names them.

    ``forward(tokens [b, s], position_ids, attention_mask) -> logits [b, s, v/tp]``.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        for i, spec in enumerate(llama_specs(config)):
            self.add_module(str(i), spec.build())

    def forward(self, tokens, position_ids, attention_mask):
        x = (tokens, position_ids, attention_mask)
        for layer in self.children():
            if self.config.checkpoint_activations and isinstance(layer, LlamaLayer):
                x = mpu.checkpoint(lambda h, m, layer=layer: layer((h, m)), *x)
            else:
                x = layer(x)
        return x


def pipeline_model(config: LlamaConfig, num_virtual_stages: int = 1, placement: str = "loop"):
    """The same layers as tds pipeline stages (a ``PipelineModule`` with its contract;
    ``placement`` "v" for ZB-V, :func:`megatron.families.pipeline_placement`)."""
    from tds.pipe import PipelineModule

    model = PipelineModule(
        layers=llama_specs(config), loss_fn=masked_lm_loss, topology=pipeline_topology(),
        partition_method="type:LlamaLayer",
        activation_checkpoint_interval=1 if config.checkpoint_activations else 0,
        activation_checkpoint_func=mpu.checkpoint, checkpointable_layers=["LlamaLayer"],
        num_virtual_stages=num_virtual_stages, placement=placement)
    return decoder_lm.set_decoder_contract(model, config.sequence_parallel, config.token_layout)


@torch.no_grad()
def generate_greedy(model: LlamaModel, tokens: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy decoding with the serial model at any tensor-parallel size (the whole prefix
    is recomputed each step: an example, not a server).

    Args:
        model: a :class:`LlamaModel` (in eval mode).
        tokens: the prompts, ``[b, s]``.
        new_tokens: how many tokens to append.

    Returns:
        ``[b, s + new_tokens]``.
    """
    from megatron.model.utils import causal_attention_mask

    for _ in range(new_tokens):
        mask = causal_attention_mask(tokens.shape[1], tokens.device)
        logits = model(tokens, None, mask)[:, -1].contiguous()  # [b, v/tp], padding -inf
        logits = mpu.gather_from_tensor_model_parallel_region(logits)  # [b, v]
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    return tokens


# ---------------------------------------------------------------- Hugging Face Llama
#: per-layer tensors: our name -> transformers' LlamaForCausalLM name (``model.layers.{i}.``)
_HF_LAYER = {"input_layernorm.weight": "input_layernorm.weight",
             "post_attention_layernorm.weight": "post_attention_layernorm.weight",
             **{f"{p}_proj.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"},
             **{f"{p}_proj.weight": f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")}}


def _hf_names(config: LlamaConfig) -> dict:
    """Our full-model key -> transformers' key."""
    last = config.num_layers + 1
    names = {"0.embed_tokens.weight": "model.embed_tokens.weight",
             f"{last}.norm.weight": "model.norm.weight",
             f"{last + 1}.lm_head.weight": "lm_head.weight"}
    for i in range(config.num_layers):
        names.update({f"{i + 1}.{ours}": f"model.layers.{i}.{theirs}"
                      for ours, theirs in _HF_LAYER.items()})
    return names


def hf_config(config: LlamaConfig, max_positions: int = 2048):
    """transformers' ``LlamaConfig`` of the same model (real vocabulary, no padding)."""
    from transformers import LlamaConfig as HFLlamaConfig

    return HFLlamaConfig(
        vocab_size=config.true_vocab_size or config.vocab_size,
        hidden_size=config.hidden_size, intermediate_size=config.ffn_hidden_size,
        num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta, max_position_embeddings=max_positions,
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, hidden_act="silu")


def config_from_hf(hf: dict, padded_vocab: int) -> LlamaConfig:
    """Our config of a transformers ``LlamaConfig`` (a ``config.json`` dict): the inverse of
    :func:`hf_config`, the vocabulary padded to ``padded_vocab`` rows.

    Raises:
        ConfigError: a Llama variant this model does not compute (biases, other activation,
            rope scaling, a head size other than hidden / heads).
    """
    from megatron.common.errors import ConfigError

    heads = hf["num_attention_heads"]
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})  # transformers 5 / 4
    theta = hf.get("rope_theta") or rope.get("rope_theta") or 10000.0
    problems = [f"{key} {hf.get(key)!r} (this model computes {want!r})"
                for key, want in (("model_type", "llama"), ("hidden_act", "silu"),
                                  ("attention_bias", False), ("mlp_bias", False))
                if hf.get(key, want) != want]
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        problems.append(f"rope scaling {rope} (this model computes plain RoPE)")
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads) or hf["hidden_size"] % heads:
        problems.append(f"head_dim {hf.get('head_dim')} (this model uses hidden_size / "
                        f"num_attention_heads = {hf['hidden_size'] / heads:g})")
    if problems:
        raise ConfigError("this Hugging Face Llama cannot be converted: " + "; ".join(problems))
    return LlamaConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads,
        ffn_hidden_size=hf["intermediate_size"], vocab_size=padded_vocab,
        true_vocab_size=hf["vocab_size"], rope_theta=float(theta),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        init_method_std=hf.get("initializer_range", 0.02))


def to_hf(full: dict, config: LlamaConfig) -> dict:
    """Whole tensors (ours: :func:`megatron.checkpoint.sharding.merge_recorded`, vocabulary
    rows unpadded) -> a ``LlamaForCausalLM`` state dict. RoPE is in the same "rotate half"
    layout, so q and k need no permutation."""
    vocab = config.true_vocab_size or config.vocab_size
    out = {theirs: full[ours] for ours, theirs in _hf_names(config).items()}
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        out[key] = out[key][:vocab]
    return out


def from_hf(state: dict, config: LlamaConfig) -> dict:
    """A ``LlamaForCausalLM`` state dict -> our whole tensors (vocabulary unpadded: cut
    them for a layout with :func:`megatron.checkpoint.sharding.slice_recorded`)."""
    return {ours: state[theirs] for ours, theirs in _hf_names(config).items()}


# ---------------------------------------------------------------- the model family
def add_flags(parser):
    g = parser.add_argument_group("llama")
    g.add_argument("--num-key-value-heads", type=int, default=None,
                   help="key-value heads (grouped-query attention; default: as many as heads)")
    g.add_argument("--rope-theta", type=float, default=10000.0, help="rotary base")
    return parser


def validate(ns, problems):
    heads, tp = ns.num_attention_heads, ns.tensor_model_parallel_size
    ns.num_key_value_heads = ns.num_key_value_heads or heads
    kv = ns.num_key_value_heads
    if heads % kv:
        problems.append(f"--num-attention-heads ({heads}) must be a multiple of "
                        f"--num-key-value-heads ({kv})")
    if kv % tp:
        problems.append(f"--num-key-value-heads ({kv}) must be divisible by "
                        f"--tensor-model-parallel-size ({tp}): each rank holds whole groups")


def model_config(cfg: Any, dropout: bool = True) -> LlamaConfig:
    """The model config of a run (or of a checkpoint's saved settings)."""
    m = cfg.model
    moe = moe_layers = None
    if cfg.moe.enabled:  # Mixtral: SwiGLU experts, Llama's initialisation
        moe = cfg.moe.block(m.hidden_size, m.ffn_hidden_size or 4 * m.hidden_size, "swiglu",
                            m.init_method_std)
        moe_layers = tuple(cfg.moe.layers(m.num_layers))
    return LlamaConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        vocab_size=m.padded_vocab_size, true_vocab_size=m.true_vocab_size,
        rope_theta=cfg.get("rope_theta", 10000.0), norm_eps=m.layernorm_epsilon,
        init_method_std=m.init_method_std, seed=m.seed,
        sequence_parallel=cfg.parallel.sequence_parallel and dropout,
        checkpoint_activations=m.checkpoint_activations,
        token_layout=uses_token_layout(cfg), cp_comm_type=cfg.parallel.cp_comm_type,
        moe=moe, moe_layers=moe_layers,
        fp8=cfg.precision.fp8 if dropout else None)


def build_model(cfg: Any, pipeline: bool) -> nn.Module:
    config = model_config(cfg)
    if pipeline:
        return pipeline_model(config, cfg.parallel.vpp, pipeline_placement(cfg))
    return LlamaModel(config)


def flops_per_step(cfg: Any) -> float:
    """Matmul FLOPs of a step (forward + backward = 3 x forward): per token and layer the
    multiply-adds of q and o (``h^2`` each), k and v (``h kv d`` each), scores and context
    (``2 s h``) and the MLP (``3 h f``; an MoE layer's active experts); the head ``h V``."""
    from megatron.families.gpt2 import mlp_multiply_adds

    c = model_config(cfg)
    b, s, h = cfg.batch.global_batch_size, cfg.batch.seq_length, c.hidden_size
    kv = c.num_key_value_heads * c.head_dim
    layers = sum(2 * h * h + 2 * h * kv + 2 * s * h +
                 mlp_multiply_adds(cfg, h, c.ffn_hidden_size, moe, gated=True)
                 for moe in (c.moe_layers or (False,) * c.num_layers))
    return 3.0 * 2.0 * b * s * (layers + h * c.vocab_size)


def memory_description(cfg: Any):
    """The memory model's description of these layers (the planner and the start-up check
    read it; docs/memory.md): RMSNorm, SwiGLU, grouped-query SDPA attention with rotary
    positions, no biases, no dropout, an output layer of its own."""
    from megatron.memory import LayerDescription

    return LayerDescription(norm="rmsnorm", mlp="swiglu", positions="rotary", bias=False,
                            kv_heads=model_config(cfg).num_key_value_heads,
                            tied_embeddings=False, dropout=False, attention="sdpa",
                            mask_tensor=True, separate_projections=True)


LLAMA = ModelFamily(
    name="llama", label="Llama", add_flags=add_flags, model_config=model_config,
    build_model=build_model, build_datasets=decoder_lm.build_datasets,
    flops_per_step=flops_per_step, make_batch_fn=decoder_lm.make_batch_fn,
    loss_fn=masked_lm_loss, validate=validate,
    # the model has no dropout: the generic flags' 0.1 would mean nothing (and context
    # parallelism refuses attention dropout)
    flag_defaults={"tokenizer_type": "GPT2BPETokenizer", "attention_dropout": 0.0,
                   "hidden_dropout": 0.0},
    checked_settings=("num_key_value_heads", "rope_theta", "layernorm_epsilon"),
    compile_classes=(LlamaLayer,),
    # block recompute is not implemented here (its layers recompute as uniform groups of 1)
    supports=frozenset(FEATURES) - {"recompute_block"}, memory_model=memory_description)
