"""T5, described once: flags and their part of the one validation pass, model config, the
model (serial or pipeline stages of the same layers), its batch and loss, datasets, FLOP
count, checkpoint keys and HF adapter.

Flags (CPM-Pretrain's names; the generic ``--num-layers`` counts layers per stack,
``--hidden-size`` is d_model, ``--kv-hidden-size`` d_kv, ``--ff-hidden-size`` d_ff):

    --enc-seq-length / --encoder-seq-length   encoder tokens (``--seq-length`` defaults to it)
    --dec-seq-length / --decoder-seq-length   decoder tokens (labels of the span corruption)
    --relative-attention-num-buckets 32       --relative-attention-max-distance 128
    --t5-ff {relu,gated-gelu}                 T5 v1.0 / v1.1 feed-forward
    --untie-embeddings                        separate lm head, no d_model^-0.5 scaling (v1.1)
    --noise-density 0.15  --mean-span-length 3   span corruption

:func:`validate` and :func:`validate_with_tokenizer` add every T5 problem to the one
validation pass (megatron/config): lengths the span corruption cannot fill,
relative-attention settings whose buckets are not defined, a tokenizer without sentinels,
an encoder sample longer than the data.
"""
import argparse
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from .. import mpu
from ..checkpoint import t5_keys
from ..checkpoint_conversion import t5_hf
from ..config.run_config import RunConfig
from ..config.run_config import Section
from ..common.errors import ConfigError, DataError
from ..model.language_model import masked_lm_loss
from ..model.t5_layers import FF_TYPES, T5DecoderLayer, T5EncoderLayer
from ..model.t5_model import t5_attention_masks
from .base import FEATURES, ModelFamily, pipeline_placement, pipeline_topology, transformer_kwargs

#: The integer tensors of a T5 sample (megatron.data.t5_dataset), broadcast in one call.
BATCH_KEYS = ("text_enc", "text_dec", "labels", "loss_mask", "enc_real")

#: T5 has no position embeddings; the generic --max-position-embeddings is set this high so
#: any --enc-seq-length validates and a checkpoint loads at another length (fine-tuning).
NO_POSITION_LIMIT = 2 ** 31 - 1

#: Defaults pretrain_t5.py sets for the generic flags (a flag or config file overrides them).
T5_DEFAULTS = {"tokenizer_type": "SentencePieceTokenizer", "layernorm_epsilon": 1e-6,
               "hidden_bias": False, "max_position_embeddings": NO_POSITION_LIMIT}


@dataclass(frozen=True)
class T5Settings(Section):
    """T5's own flags, typed (``cfg.t5``)."""

    enc_seq_length: int
    dec_seq_length: int
    relative_attention_num_buckets: int
    relative_attention_max_distance: int
    t5_ff: str
    """``relu`` (v1.0) or ``gated-gelu`` (v1.1)."""
    untie_embeddings: bool
    noise_density: float
    mean_span_length: float


def add_t5_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the T5 group to ``parser`` (an ``extra_args_provider``)."""
    g = parser.add_argument_group("T5")
    g.add_argument("--enc-seq-length", "--encoder-seq-length", dest="enc_seq_length", type=int,
                   default=None, help="encoder tokens per sample (default: --seq-length)")
    g.add_argument("--dec-seq-length", "--decoder-seq-length", dest="dec_seq_length", type=int,
                   default=None, help="decoder tokens per sample (labels + eos, padded)")
    g.add_argument("--relative-attention-num-buckets", type=int, default=32,
                   help="relative position buckets (half per direction in the encoder)")
    g.add_argument("--relative-attention-max-distance", type=int, default=128,
                   help="distances from here on share the last bucket")
    g.add_argument("--t5-ff", choices=FF_TYPES, default="relu",
                   help="feed-forward: relu (T5 v1.0) or gated-gelu (T5 v1.1)")
    g.add_argument("--untie-embeddings", action="store_true",
                   help="own output layer, no d_model^-0.5 output scaling (T5 v1.1)")
    g.add_argument("--noise-density", type=float, default=0.15,
                   help="span corruption: fraction of tokens masked")
    g.add_argument("--mean-span-length", type=float, default=3.0,
                   help="span corruption: mean masked span length")
    return parser


def derive(ns: argparse.Namespace) -> None:
    """``--seq-length`` from the encoder length (or the encoder length from ``--seq-length``)
    when only one of them is given."""
    if ns.enc_seq_length is not None and ns.seq_length is None:
        ns.seq_length = ns.enc_seq_length
    elif ns.enc_seq_length is None and ns.seq_length is not None:
        ns.enc_seq_length = ns.seq_length


def _length_problems(ns, problems):
    enc, dec = ns.enc_seq_length, ns.dec_seq_length
    if enc is None:
        problems.append("--enc-seq-length (or --seq-length) is required")
    elif ns.seq_length != enc:
        problems.append(f"--seq-length ({ns.seq_length}) and --enc-seq-length ({enc}) "
                        f"disagree; give only --enc-seq-length")
    if dec is None:
        problems.append("--dec-seq-length is required (decoder tokens per sample)")
    elif dec < 2:
        problems.append(f"--dec-seq-length must be >= 2, got {dec}")


def _relative_attention_problems(ns, problems):
    buckets, distance = ns.relative_attention_num_buckets, ns.relative_attention_max_distance
    if buckets < 4:
        problems.append(f"--relative-attention-num-buckets ({buckets}) must be >= 4: the "
                        f"encoder splits the buckets by direction, then into exact and "
                        f"log-spaced halves")
    elif distance <= buckets // 2:
        problems.append(f"--relative-attention-max-distance ({distance}) must be larger than "
                        f"the exactly-bucketed distances ({buckets // 2} in the decoder): "
                        f"raise it or lower --relative-attention-num-buckets")


def _split_tokens(prefix, split):
    """Tokens in the train split of the indexed dataset at ``prefix``."""
    import numpy as np

    from ..data.dataset_utils import get_train_valid_test_split_
    from ..data.indexed_dataset import make_dataset

    indexed = make_dataset(prefix)
    bounds = get_train_valid_test_split_(split, len(indexed))
    return int(np.sum(indexed.sizes[bounds[0]:bounds[1]], dtype=np.int64))


def _data_problems(ns, plan, problems):
    from ..config.validation import parse_data_path

    try:
        _, prefixes = parse_data_path(ns.data_path or [])
        for prefix in prefixes:
            tokens = _split_tokens(prefix, ns.split)
            if tokens < plan["raw"]:
                problems.append(
                    f"--enc-seq-length {ns.enc_seq_length} needs {plan['raw']} raw tokens per "
                    f"sample but the train split of {prefix} holds {tokens}; shorten the "
                    f"sequences or give more data")
    except (DataError, ConfigError, OSError) as exc:
        problems.append(str(exc))


def validate(ns: argparse.Namespace, problems: List[str]) -> None:
    """The T5 flag checks that need no files."""
    _length_problems(ns, problems)
    _relative_attention_problems(ns, problems)


def validate_with_tokenizer(ns: argparse.Namespace, tokenizer: Any,
                            problems: List[str]) -> None:
    """Span-corruption checks: the tokenizer's sentinels and the data's train split."""
    from ..data.t5_dataset import make_plan

    if ns.enc_seq_length is None or ns.dec_seq_length is None or ns.dec_seq_length < 2:
        return
    try:
        plan = make_plan(ns.enc_seq_length, ns.dec_seq_length, tokenizer, ns.noise_density,
                         ns.mean_span_length)
    except ConfigError as exc:
        problems.append(str(exc))
        return
    if ns.data_path:
        _data_problems(ns, plan, problems)


def model_config(cfg: RunConfig, dropout: bool = True) -> Any:
    """The :class:`~megatron.model.t5_layers.T5TransformerConfig` of a run or a checkpoint
    (arguments: :func:`megatron.families.transformer_kwargs`)."""
    from ..model.t5_layers import T5TransformerConfig

    t5, m = cfg.t5, cfg.model
    moe = moe_layers = None
    if cfg.moe.enabled:  # the Switch Transformer: T5's FFN per expert, T5's initialisation
        width = cfg.moe.moe_ffn_hidden_size or m.ffn_hidden_size
        moe = cfg.moe.block(m.hidden_size, m.ffn_hidden_size,
                            "geglu" if t5.t5_ff == "gated-gelu" else "relu",
                            m.hidden_size ** -0.5, width ** -0.5)
        moe_layers = tuple(cfg.moe.layers(m.num_layers))
    return T5TransformerConfig(
        **transformer_kwargs(cfg, dropout), vocab_size=cfg.model.padded_vocab_size,
        num_buckets=t5.relative_attention_num_buckets,
        max_distance=t5.relative_attention_max_distance, ff_type=t5.t5_ff,
        tie_embeddings=not t5.untie_embeddings, moe=moe, moe_layers=moe_layers)


def build_model(cfg: RunConfig, pipeline: bool, parallel_output: bool = True) -> torch.nn.Module:
    """T5Model, or T5ModelPipe (a tds PipelineModule) when ``pipeline``."""
    config = model_config(cfg)
    if pipeline:
        from ..model.t5_model_pipe import T5ModelPipe

        return T5ModelPipe(config, pipeline_topology(), loss_fn=masked_lm_loss,
                           num_virtual_stages=cfg.parallel.vpp, placement=pipeline_placement(cfg))
    from ..model.t5_model import T5Model

    return T5Model(config, parallel_output)


def make_batch_fn(cfg: RunConfig, tokenizer: Any) -> Callable[[Any], Tuple[tuple, tuple]]:
    """``raw -> ((enc_ids, dec_ids, enc_mask, dec_mask, cross_mask), (labels, loss_mask))``.

    Tensor-parallel rank 0 reads (the others pass None) and shares the ``[b, s]`` integer
    tensors with its group in one broadcast; the bool masks (enc ``[b, 1, se, se]``, dec
    ``[b, 1, sd, sd]``, cross ``[b, 1, sd, se]``, True = masked) are built on the device.
    """
    mb, enc, dec = cfg.batch.micro_batch_size, cfg.t5.enc_seq_length, cfg.t5.dec_seq_length
    # sizes fixed by the configuration: the broadcast needs no shape header (no host sync)
    shapes = [(mb, enc), (mb, dec), (mb, dec), (mb, dec), (mb, enc)]  # BATCH_KEYS' order

    def batch(data):
        b = mpu.broadcast_data(list(BATCH_KEYS), data, torch.int64, shapes=shapes)
        masks = t5_attention_masks(b["enc_real"].bool(), b["loss_mask"].bool())
        return (b["text_enc"], b["text_dec"], *masks), (b["labels"], b["loss_mask"].float())

    return batch


def build_datasets(cfg: RunConfig, tokenizer: Any, num_samples: Sequence[int]
                   ) -> Tuple[Optional[Any], Optional[Any], Optional[Any]]:
    """Train/valid/test span-corruption datasets (None for an empty split)."""
    from ..data.t5_dataset import build_train_valid_test_datasets

    return build_train_valid_test_datasets(
        data_prefix=cfg.data.data_path, splits_string=cfg.data.split,
        train_valid_test_num_samples=num_samples, enc_seq_length=cfg.t5.enc_seq_length,
        dec_seq_length=cfg.t5.dec_seq_length, seed=cfg.model.seed, tokenizer=tokenizer,
        noise_density=cfg.t5.noise_density, mean_span_length=cfg.t5.mean_span_length)


def flops_per_step(cfg: RunConfig) -> float:
    """Matmul FLOPs of one training step (see :func:`megatron.model.t5_model.t5_flops_per_step`)."""
    from ..model.t5_model import t5_flops_per_step

    return t5_flops_per_step(model_config(cfg), cfg.t5.enc_seq_length, cfg.t5.dec_seq_length,
                             cfg.batch.global_batch_size)


FAMILY = ModelFamily(
    name="t5", add_flags=add_t5_args, model_config=model_config, build_model=build_model,
    build_datasets=build_datasets, flops_per_step=flops_per_step, make_batch_fn=make_batch_fn,
    loss_fn=masked_lm_loss, keys=t5_keys, hf=t5_hf, flag_defaults=T5_DEFAULTS, label="T5",
    layer_stacks=2, derive=derive, validate=validate,
    validate_with_tokenizer=validate_with_tokenizer, settings=T5Settings,
    compile_classes=(T5EncoderLayer, T5DecoderLayer),
    # encoder-decoder context parallelism and document masking are not implemented
    supports=frozenset(FEATURES) - {"context_parallel", "document_masking"},
    memory_model="t5")
