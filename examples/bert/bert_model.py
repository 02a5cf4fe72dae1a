"""A BERT-style masked language model on megatron-tds: bidirectional encoder layers (post-
LayerNorm, GeLU), learned positions and token types, and an MLM head tied to the word
embedding across pipeline stages. The second walk-through of docs/new_model.md.

One list of layer specs (:func:`bert_specs`) is both models: ``SpecModel`` builds it in one
process, a tds ``PipelineModule`` as stages. The head is tied to the embedding through
``megatron.model.lm_head.tied_embedding_specs``, so the shared weight is called
``tied_modules.embed.word_embeddings.weight`` at every (tp, pp, v) and a checkpoint moves
between layouts by its sharding record alone. The batch function masks tokens at random
(BERT's 80 / 10 / 10 rule); each call draws under generators seeded by its place in the run,
so the first stage (inputs) and the last (labels) mask the same positions. :data:`BERT` is
the model family; its name table (:data:`HF_NAMES`) converts to and from transformers'
``BertForMaskedLM`` with ``tools/convert_checkpoint.py --family``.

Between stages travels ``(hidden [s, b, h] float, padding_mask [b, 1, 1, s] bool)`` (True
= a padding key; with --sequence-parallel the hidden state is the rank's ``[s/tp, b, h]``).
"""
import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron import mpu
from megatron.checkpoint_conversion.hf_table import HFNameTable
from megatron.common.errors import ConfigError
from megatron.families import ModelFamily, decoder_lm, pipeline_placement, pipeline_topology
from megatron.model.lm_head import VocabParallelBias, tied_embedding_specs
from megatron.model.spec_model import SpecModel
from megatron.model.utils import init_method_normal, init_rng, replicated_parameter


@dataclass(frozen=True)
class BertConfig:
    """The model's sizes and switches (from a run's flags: :func:`model_config`)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int
    vocab_size: int
    """Padded vocabulary rows (divisible by tp)."""
    max_position_embeddings: int
    true_vocab_size: Optional[int] = None
    type_vocab_size: int = 2
    norm_eps: float = 1e-12
    init_method_std: float = 0.02
    seed: int = 1234
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    sequence_parallel: bool = False
    """Layers split the sequence across tp (what makes --sequence-parallel supported)."""
    checkpoint_activations: bool = False
    """Layers recomputed in the backward (what makes --checkpoint-activations supported)."""


def _replicated_linear(n_in, n_out, std, sp):
    """A ``[n_out, n_in]`` weight and bias every tp rank holds (summed over tp under SP)."""
    weight = replicated_parameter((n_out, n_in), init_method_normal(std), mpu.get_device())
    bias = nn.Parameter(torch.zeros(n_out, device=mpu.get_device()))
    if sp:
        mpu.mark_sequence_parallel(weight)
        mpu.mark_sequence_parallel(bias)
    return weight, bias


class BertEmbeddings(nn.Module):
    """``(words [b, s, h], token_types [b, s], mask) -> (hidden [s, b, h], mask)``: positions
    and token types added, LayerNorm, dropout (the word lookup is the tied module's)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        h, init = config.hidden_size, init_method_normal(config.init_method_std)
        self.sequence_parallel = config.sequence_parallel
        with init_rng(config.seed, "bert_embeddings"):
            self.position_embeddings = nn.Embedding(
                config.max_position_embeddings, h, _weight=replicated_parameter(
                    (config.max_position_embeddings, h), init, mpu.get_device()))
            self.token_type_embeddings = nn.Embedding(
                config.type_vocab_size, h, _weight=replicated_parameter(
                    (config.type_vocab_size, h), init, mpu.get_device()))
        self.norm = mpu.MixedFusedLayerNorm(h, config.norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(self, inputs):
        words, token_types, mask = inputs  # [b, s, h], [b, s], [b, 1, 1, s]
        positions = torch.arange(words.shape[1], device=words.device)
        hidden = words + self.position_embeddings(positions) + \
            self.token_type_embeddings(token_types)
        hidden = self.norm(hidden).transpose(0, 1).contiguous()  # [s, b, h]
        if self.sequence_parallel:
            hidden = mpu.scatter_to_sequence_parallel_region(hidden)  # [s/tp, b, h]
        return mpu.sequence_parallel_dropout(self.dropout, hidden, self.sequence_parallel), mask


class BertLayer(nn.Module):
    """One encoder layer, post-LayerNorm: ``x = norm1(x + attention(x)); x = norm2(x +
    output(gelu(intermediate(x))))``; queries, keys and values split by head across tp."""

    def __init__(self, config: BertConfig, index: int):
        super().__init__()
        h, f, sp = config.hidden_size, config.ffn_hidden_size, config.sequence_parallel
        init = init_method_normal(config.init_method_std)
        self.head_dim = h // config.num_attention_heads
        self.attention_dropout = config.attention_dropout
        self.sequence_parallel = sp

        def col(n_in, n_out):
            return mpu.ColumnParallelLinear(n_in, n_out, gather_output=False, init_method=init,
                                            sequence_parallel=sp)

        def row(n_in, n_out):
            return mpu.RowParallelLinear(n_in, n_out, input_is_parallel=True,
                                         init_method=init, sequence_parallel=sp)

        with init_rng(config.seed, "layer", index):
            self.query, self.key, self.value = col(h, h), col(h, h), col(h, h)
            self.dense = row(h, h)
            self.intermediate, self.output = col(h, f), row(f, h)
        self.norm1 = mpu.MixedFusedLayerNorm(h, config.norm_eps, sequence_parallel=sp)
        self.norm2 = mpu.MixedFusedLayerNorm(h, config.norm_eps, sequence_parallel=sp)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def attention(self, x, mask):
        q, k, v = (proj(x)[0] for proj in (self.query, self.key, self.value))  # [s, b, n/tp d]
        s, b = q.shape[:2]
        q, k, v = (t.view(s, b, -1, self.head_dim).permute(1, 2, 0, 3) for t in (q, k, v))
        p = self.attention_dropout if self.training else 0.0
        with mpu.get_cuda_rng_tracker().fork() if p else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~mask, dropout_p=p)
        out = out.permute(2, 0, 1, 3).reshape(s, b, -1)  # [s, b, n/tp d]
        return self.dense(out)[0]

    def _dropout(self, x):
        return mpu.sequence_parallel_dropout(self.dropout, x, self.sequence_parallel)

    def forward(self, inputs):
        hidden, mask = inputs  # [s, b, h] (SP: [s/tp, b, h]), [b, 1, 1, s]
        hidden = self.norm1(hidden + self._dropout(self.attention(hidden, mask)))
        ffn = self.output(F.gelu(self.intermediate(hidden)[0]))[0]
        return self.norm2(hidden + self._dropout(ffn)), mask


class BertLMTransform(nn.Module):
    """The MLM head's transform: ``(hidden, mask) -> norm(gelu(dense(hidden)))``."""

    def __init__(self, config: BertConfig):
        super().__init__()
        sp = self.sequence_parallel = config.sequence_parallel
        with init_rng(config.seed, "lm_transform"):
            self.weight, self.bias = _replicated_linear(
                config.hidden_size, config.hidden_size, config.init_method_std, sp)
        self.norm = mpu.MixedFusedLayerNorm(config.hidden_size, config.norm_eps,
                                            sequence_parallel=sp)

    def forward(self, inputs):
        hidden = inputs[0]
        weight, bias = self.weight, self.bias
        if self.sequence_parallel:
            weight, bias = mpu.sequence_parallel_param(weight), mpu.sequence_parallel_param(bias)
        return self.norm(F.gelu(F.linear(hidden, weight, bias)))


def bert_specs(config: BertConfig) -> list:
    """The model as tds layer specs: the tied word lookup, the embeddings, ``num_layers``
    layers, the MLM transform, the tied logits and their bias."""
    from tds.pipe import LayerSpec

    lookup, logits = tied_embedding_specs(
        config.vocab_size, config.hidden_size, init_method_std=config.init_method_std,
        seed=config.seed, true_vocab_size=config.true_vocab_size,
        sequence_parallel=config.sequence_parallel)
    return ([lookup, LayerSpec(BertEmbeddings, config)]
            + [LayerSpec(BertLayer, config, i) for i in range(config.num_layers)]
            + [LayerSpec(BertLMTransform, config), logits,
               LayerSpec(VocabParallelBias, config.vocab_size)])


def serial_model(config: BertConfig) -> SpecModel:
    """``model(tokens [b, s], token_types [b, s], padding_mask [b, 1, 1, s]) -> logits
    [b, s, v/tp]``, the layers named as the pipeline names them."""
    return SpecModel(bert_specs(config), checkpointable=["BertLayer"],
                     recompute=config.checkpoint_activations)


def pipeline_model(config: BertConfig, num_virtual_stages: int = 1, placement: str = "loop"):
    """The same specs as tds pipeline stages, with their stage contract."""
    from tds.pipe import PipelineModule

    model = PipelineModule(
        layers=bert_specs(config), loss_fn=mlm_loss, topology=pipeline_topology(),
        partition_method="type:BertLayer",
        activation_checkpoint_interval=1 if config.checkpoint_activations else 0,
        activation_checkpoint_func=mpu.checkpoint, checkpointable_layers=["BertLayer"],
        num_virtual_stages=num_virtual_stages, placement=placement)
    # (hidden, padding mask): as a decoder's (hidden, causal mask), only the mask's shape differs
    return decoder_lm.set_decoder_contract(model, config.sequence_parallel)


def mlm_loss(logits, labels):
    """Mean loss over the masked positions: ``logits [b, s, v/tp]``, ``labels = (ids [b, s],
    chosen [b, s] float)`` (a micro-batch with no masked position: 0, not 0/0)."""
    ids, chosen = labels
    losses = mpu.vocab_parallel_cross_entropy(logits.transpose(0, 1), ids.t(),
                                              inplace=True).t()  # [b, s]
    return (losses * chosen).sum() / chosen.sum().clamp(min=1.0)


def make_batch_fn(cfg: Any, tokenizer: Any):
    """``raw -> ((tokens, token_types, padding_mask), (ids, chosen))``: BERT's masking.

    ``--mask-prob`` of the positions are chosen; of those 80 % become the mask token, 10 % a
    random token and 10 % stay. The draws come from torch's generators, which the run seeds
    per call from (seed, iteration, micro-batch), so every stage draws the same masks. The
    GPT-2 tokenizer of the tests has no [MASK]: its end-of-text id stands in.
    """
    shapes = [(cfg.batch.micro_batch_size, cfg.batch.seq_length + 1)]
    mask_id, vocab, prob = tokenizer.eod, tokenizer.vocab_size, cfg.get("mask_prob", 0.15)

    def batch(data):
        text = mpu.broadcast_data(["text"], data, torch.int64, shapes=shapes)["text"]
        ids = text[:, :-1].contiguous()  # [b, s] (packed text: no padding)
        chosen = torch.rand(ids.shape, device=ids.device) < prob
        action = torch.rand(ids.shape, device=ids.device)
        randoms = torch.randint(0, vocab, ids.shape, device=ids.device)
        tokens = torch.where(chosen & (action < 0.8), mask_id,
                             torch.where(chosen & (action >= 0.9), randoms, ids))
        padding = torch.zeros(ids.shape[0], 1, 1, ids.shape[1], dtype=torch.bool,
                              device=ids.device)
        return (tokens, torch.zeros_like(ids), padding), (ids, chosen.float())

    return batch


# ---------------------------------------------------------------- Hugging Face BertForMaskedLM
_HF_LAYER = {"query": "attention.self.query", "key": "attention.self.key",
             "value": "attention.self.value", "dense": "attention.output.dense",
             "norm1": "attention.output.LayerNorm", "intermediate": "intermediate.dense",
             "output": "output.dense", "norm2": "output.LayerNorm"}


def hf_names(args: Dict[str, Any]) -> Dict[str, str]:
    """Our whole-model name -> ``BertForMaskedLM``'s (spec indices: 0 the tied lookup, 1 the
    embeddings, 2.. the layers, then the transform, the tied logits, the bias)."""
    n = args["num_layers"]
    names = {"tied_modules.embed.word_embeddings.weight": "bert.embeddings.word_embeddings.weight",
             "1.position_embeddings.weight": "bert.embeddings.position_embeddings.weight",
             "1.token_type_embeddings.weight": "bert.embeddings.token_type_embeddings.weight",
             f"{n + 2}.weight": "cls.predictions.transform.dense.weight",
             f"{n + 2}.bias": "cls.predictions.transform.dense.bias",
             f"{n + 4}.bias": "cls.predictions.bias"}
    for ours, theirs in (("1.norm", "bert.embeddings.LayerNorm"),
                         (f"{n + 2}.norm", "cls.predictions.transform.LayerNorm")):
        names.update({f"{ours}.{p}": f"{theirs}.{p}" for p in ("weight", "bias")})
    for i in range(n):
        for ours, theirs in _HF_LAYER.items():
            names.update({f"{i + 2}.{ours}.{p}": f"bert.encoder.layer.{i}.{theirs}.{p}"
                          for p in ("weight", "bias")})
    return names


def to_hf_config(args: Dict[str, Any]) -> Dict[str, Any]:
    """``BertForMaskedLM``'s ``config.json`` of the saved args (the real vocabulary)."""
    return {"architectures": ["BertForMaskedLM"], "model_type": "bert",
            "vocab_size": args.get("true_vocab_size") or args["padded_vocab_size"],
            "hidden_size": args["hidden_size"], "num_hidden_layers": args["num_layers"],
            "num_attention_heads": args["num_attention_heads"],
            "intermediate_size": args.get("ffn_hidden_size") or 4 * args["hidden_size"],
            "hidden_act": "gelu", "max_position_embeddings": args["max_position_embeddings"],
            "type_vocab_size": 2, "layer_norm_eps": args.get("layernorm_epsilon", 1e-12),
            "initializer_range": args.get("init_method_std", 0.02),
            "hidden_dropout_prob": args.get("hidden_dropout", 0.1),
            "attention_probs_dropout_prob": args.get("attention_dropout", 0.1),
            "tie_word_embeddings": True, "pad_token_id": 0}


def from_hf_config(hf: Dict[str, Any]) -> Dict[str, Any]:
    """Our saved-args settings of a ``BertForMaskedLM`` ``config.json``.

    Raises:
        ConfigError: a BERT variant this model does not compute.
    """
    problems = [f"{key} {hf.get(key)!r} (this model computes {want!r})"
                for key, want in (("model_type", "bert"), ("hidden_act", "gelu"),
                                  ("position_embedding_type", "absolute"),
                                  ("type_vocab_size", 2), ("tie_word_embeddings", True))
                if hf.get(key, want) != want]
    if problems:
        raise ConfigError("this Hugging Face BERT cannot be converted: " + "; ".join(problems))
    return {"num_layers": hf["num_hidden_layers"], "hidden_size": hf["hidden_size"],
            "num_attention_heads": hf["num_attention_heads"],
            "ffn_hidden_size": hf["intermediate_size"],
            "max_position_embeddings": hf["max_position_embeddings"],
            "layernorm_epsilon": hf.get("layer_norm_eps", 1e-12),
            "init_method_std": hf.get("initializer_range", 0.02),
            "hidden_dropout": hf.get("hidden_dropout_prob", 0.1),
            "attention_dropout": hf.get("attention_probs_dropout_prob", 0.1),
            "true_vocab_size": hf["vocab_size"]}


HF_NAMES = HFNameTable(
    names=hf_names, to_hf_config=to_hf_config, from_hf_config=from_hf_config,
    tied={"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
          "cls.predictions.decoder.bias": "cls.predictions.bias"})


# ---------------------------------------------------------------- the model family
def add_flags(parser):
    parser.add_argument_group("bert").add_argument(
        "--mask-prob", type=float, default=0.15, help="share of positions masked")
    return parser


def validate(ns, problems):
    if not 0.0 < ns.mask_prob <= 1.0:
        problems.append(f"--mask-prob {ns.mask_prob} must be in (0, 1]")


def model_config(cfg: Any, dropout: bool = True) -> BertConfig:
    """The model config of a run (or of a checkpoint's saved settings)."""
    m = cfg.model
    return BertConfig(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=m.ffn_hidden_size or 4 * m.hidden_size,
        vocab_size=m.padded_vocab_size, max_position_embeddings=m.max_position_embeddings,
        true_vocab_size=m.true_vocab_size, norm_eps=m.layernorm_epsilon,
        init_method_std=m.init_method_std, seed=m.seed,
        hidden_dropout=m.hidden_dropout if dropout else 0.0,
        attention_dropout=m.attention_dropout if dropout else 0.0,
        sequence_parallel=cfg.parallel.sequence_parallel and dropout,
        checkpoint_activations=m.checkpoint_activations)


def build_model(cfg: Any, pipeline: bool) -> nn.Module:
    config = model_config(cfg)
    if pipeline:
        return pipeline_model(config, cfg.parallel.vpp, pipeline_placement(cfg))
    return serial_model(config)


def flops_per_step(cfg: Any) -> float:
    """Matmul FLOPs of a step (forward + backward = 3 x forward): per token and layer the
    multiply-adds of q, k, v and the output (``4 h^2``), scores and context (``2 s h``) and
    the MLP (``2 h f``); the transform ``h^2`` and the tied logits ``h V``."""
    c = model_config(cfg)
    b, s, h = cfg.batch.global_batch_size, cfg.batch.seq_length, c.hidden_size
    per_layer = 4 * h * h + 2 * s * h + 2 * h * c.ffn_hidden_size
    return 3.0 * 2.0 * b * s * (c.num_layers * per_layer + h * h + h * c.vocab_size)


BERT = ModelFamily(
    name="bert", label="BERT", add_flags=add_flags, model_config=model_config,
    build_model=build_model, build_datasets=decoder_lm.build_datasets,
    flops_per_step=flops_per_step, make_batch_fn=make_batch_fn, loss_fn=mlm_loss,
    validate=validate, hf_names=HF_NAMES,
    flag_defaults={"tokenizer_type": "GPT2BPETokenizer", "layernorm_epsilon": 1e-12},
    checked_settings=("layernorm_epsilon",), compile_classes=(BertLayer,))
