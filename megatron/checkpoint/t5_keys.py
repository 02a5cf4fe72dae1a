"""Where each T5 weight lives: tensor-parallel split dims and pipeline-stage key names.

A *full* T5 state dict uses T5Model's key names with every tensor whole (L layers per stack,
``inner`` = heads x d_kv, ``f`` = d_ff, or 2 d_ff for gated-GeLU)::

    embedding.word_embeddings.weight                         [v_pad, h]     split on dim 0
    {encoder,decoder}.relative_bias.weight                   [buckets, heads] split on dim 1
    {stack}.layers.{i}.input_layernorm.weight                [h]            replicated
    {stack}.layers.{i}.self_attention.query_key_value.weight [3 inner, h]   split on dim 0
    {stack}.layers.{i}.self_attention.dense.weight           [h, inner]     split on dim 1
    {stack}.layers.{i}.post_attention_layernorm.weight       [h]            replicated
    decoder.layers.{i}.inter_attention.query.weight          [inner, h]     split on dim 0
    decoder.layers.{i}.inter_attention.key_value.weight      [2 inner, h]   split on dim 0
    decoder.layers.{i}.inter_attention.dense.weight          [h, inner]     split on dim 1
    decoder.layers.{i}.post_inter_attention_layernorm.weight [h]            replicated
    {stack}.layers.{i}.mlp.dense_h_to_ff.weight              [f, h]         split on dim 0
    {stack}.layers.{i}.mlp.dense_ff_to_h.weight              [h, d_ff]      split on dim 1
    {stack}.final_layernorm.weight                           [h]            replicated
    lm_head.weight  (untied only)                            [v_pad, h]     split on dim 0

Fused weights are laid out per head (per d_ff unit for gated-GeLU), so contiguous splits
give every rank whole heads. T5ModelPipe names the same tensors by layer-spec index: spec 0
(and the last spec when tied) is the embedding (``tied_modules.embed.*``), specs 1..L the
encoder layers, L+1 the encoder's final norm (``{L+1}.norm.weight``), L+2..2L+1 the decoder
layers, 2L+2 the decoder's final norm, 2L+3 the output layer (``{2L+3}.lm_head.weight`` when
untied). The relative-bias tables are ``{encoder,decoder}_relative_bias.weight`` on every
stage that holds layers of that stack.
"""
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..common.errors import CheckpointError
from .chunks import Bounds, placement_of, rank_bounds, spec_indices, vpp_of

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
LM_HEAD = "lm_head.weight"
STACKS = ("encoder", "decoder")
PIPE_TIED_PREFIX = "tied_modules.embed."

_ATTENTION = ("self_attention.query_key_value.weight", "self_attention.dense.weight")
_CROSS = ("inter_attention.query.weight", "inter_attention.key_value.weight",
          "inter_attention.dense.weight")
_MLP = ("mlp.dense_h_to_ff.weight", "mlp.dense_ff_to_h.weight")
ENCODER_LAYER_KEYS = ("input_layernorm.weight", *_ATTENTION, "post_attention_layernorm.weight",
                      *_MLP)
DECODER_LAYER_KEYS = ("input_layernorm.weight", *_ATTENTION, "post_attention_layernorm.weight",
                      *_CROSS, "post_inter_attention_layernorm.weight", *_MLP)
_SPLIT_BY_SUFFIX = {
    "query_key_value.weight": 0, "query.weight": 0, "key_value.weight": 0,
    "dense_h_to_ff.weight": 0, "attention.dense.weight": 1, "dense_ff_to_h.weight": 1,
    "relative_bias.weight": 1,
}
_LAYER_KEY = re.compile(r"^(encoder|decoder)\.layers\.(\d+)\.(.+)$")
_PIPE_KEY = re.compile(r"^(\d+)\.(.+)$")


def full_keys(num_layers: int, tied: bool = True) -> List[str]:
    """Every key of a full T5Model state dict, in model order."""
    keys = [WORD_EMBEDDINGS]
    for stack, layer_keys in zip(STACKS, (ENCODER_LAYER_KEYS, DECODER_LAYER_KEYS)):
        keys.append(f"{stack}.relative_bias.weight")
        for i in range(num_layers):
            keys += [f"{stack}.layers.{i}.{k}" for k in layer_keys]
        keys.append(f"{stack}.final_layernorm.weight")
    return keys if tied else keys + [LM_HEAD]


def tp_split_dim(key: str) -> Optional[int]:
    """Dimension along which ``key`` is split across tensor-parallel ranks, None if replicated."""
    if key in (WORD_EMBEDDINGS, LM_HEAD):
        return 0
    for suffix, dim in _SPLIT_BY_SUFFIX.items():
        if key.endswith(suffix):
            return dim
    return None


def is_pipe_state(state: Mapping[str, Any]) -> bool:
    """True when ``state`` uses T5ModelPipe's key names (a pipeline-stage file)."""
    return any(k.startswith(PIPE_TIED_PREFIX) or _PIPE_KEY.match(k) for k in state)


def pipe_to_full_key(key: str, num_layers: int) -> str:
    """A T5ModelPipe stage key -> the T5Model key of the same tensor."""
    L = num_layers
    if key.startswith(PIPE_TIED_PREFIX):
        return "embedding." + key[len(PIPE_TIED_PREFIX):]
    for stack in STACKS:
        if key.startswith(f"{stack}_relative_bias."):
            return f"{stack}.relative_bias." + key.split(".", 1)[1]
    match = _PIPE_KEY.match(key)
    if match:
        spec, rest = int(match.group(1)), match.group(2)
        if 1 <= spec <= L:
            return f"encoder.layers.{spec - 1}.{rest}"
        if L + 2 <= spec <= 2 * L + 1:
            return f"decoder.layers.{spec - L - 2}.{rest}"
        if spec in (L + 1, 2 * L + 2) and rest.startswith("norm."):
            stack = "encoder" if spec == L + 1 else "decoder"
            return f"{stack}.final_layernorm.{rest[len('norm.'):]}"
        if spec == 2 * L + 3 and rest == LM_HEAD:
            return LM_HEAD
    raise CheckpointError(f"unexpected pipeline-stage key {key!r} for a {L}-layer T5")


def full_to_pipe_key(key: str, num_layers: int) -> str:
    """A T5Model key -> the T5ModelPipe key (inverse of :func:`pipe_to_full_key`)."""
    L = num_layers
    if key.startswith("embedding."):
        return PIPE_TIED_PREFIX + key[len("embedding."):]
    if key == LM_HEAD:
        return f"{2 * L + 3}.{LM_HEAD}"
    match = _LAYER_KEY.match(key)
    if match:
        first = 1 if match.group(1) == "encoder" else L + 2
        return f"{first + int(match.group(2))}.{match.group(3)}"
    for stack, spec in (("encoder", L + 1), ("decoder", 2 * L + 2)):
        if key.startswith(f"{stack}.final_layernorm."):
            return f"{spec}.norm.{key.rsplit('.', 1)[1]}"
        if key.startswith(f"{stack}.relative_bias."):
            return f"{stack}_relative_bias.{key.rsplit('.', 1)[1]}"
    raise CheckpointError(f"unexpected T5 key {key!r}")


def spec_weights(num_layers: int) -> List[int]:
    """T5ModelPipe's partition weights: 1 per encoder/decoder layer spec, 0 elsewhere."""
    return [0] + [1] * num_layers + [0] + [1] * num_layers + [0, 0]


def stage_spec_bounds(num_layers: int, pp_size: int, vpp_size: int = 1,
                      placement: str = "loop") -> List[Bounds]:
    """``[start, end)`` layer-spec indices of each stage, as DeepSpeed partitions them
    (with ``vpp_size`` > 1, per rank the list of its chunks' ranges: :mod:`.chunks`)."""
    return rank_bounds(spec_weights(num_layers), pp_size, vpp_size, placement)


def stage_full_keys(full_keys_list: Sequence[str], num_layers: int, bounds: Bounds,
                    tied: bool = True) -> Dict[str, str]:
    """``{full key: pipe key}`` for the tensors one stage holds.

    Args:
        full_keys_list: every key of the full state dict.
        num_layers: layers per stack L.
        bounds: the stage's ``(start, end)`` spec indices, or its chunks'.
        tied: the output layer is the tied embedding (spec 2L+3 holds a copy of it).
    """
    L = num_layers
    specs = spec_indices(bounds)
    has_embedding = 0 in specs or (tied and 2 * L + 3 in specs)
    has_stack = {"encoder": bool(specs & set(range(1, L + 1))),
                 "decoder": bool(specs & set(range(L + 2, 2 * L + 2)))}
    out = {}
    for key in full_keys_list:
        pipe_key = full_to_pipe_key(key, L)
        if key.startswith("embedding."):
            keep = has_embedding
        elif ".relative_bias." in key:
            keep = has_stack[key.split(".", 1)[0]]
        else:
            keep = int(pipe_key.split(".", 1)[0]) in specs
        if keep:
            out[key] = pipe_key
    return out


# ---------------------------------------------------------------- the schema the generic
# reader, writer and resharder use (megatron/checkpoint/native_*.py)
NAME = "T5"
FAMILY = "t5"
"""The model family (megatron.families) these keys belong to."""
CONVERT_TOOL = "tools/convert_checkpoint_t5.py"
"""The conversion tool for this model's checkpoints (named in messages)."""
VOCAB_KEYS = (WORD_EMBEDDINGS, LM_HEAD)
"""Tensors with one row per (padded) vocabulary entry."""


def _tied(args):
    return not args.get("untie_embeddings", False)


def expected_keys(args: Dict[str, Any]) -> List[str]:
    """Every key of the full state dict the saved ``args`` describe."""
    return full_keys(args["num_layers"], _tied(args))


def describe(args: Dict[str, Any]) -> str:
    return f"{args['num_layers']}-layer {'tied' if _tied(args) else 'untied'} T5"


def stage_bounds(args: Dict[str, Any], pp: int) -> List[Bounds]:
    return stage_spec_bounds(args["num_layers"], pp, vpp_of(args), placement_of(args))


def stage_keys(full_keys_list: Sequence[str], args: Dict[str, Any],
               bounds: Bounds) -> Dict[str, str]:
    return stage_full_keys(full_keys_list, args["num_layers"], bounds, tied=_tied(args))


def stage_replica(key: str) -> Optional[str]:
    """Tensors that repeat across pipeline stages (the tied embedding, each stack's
    relative-bias table on every stage of the stack) must agree everywhere."""
    if key == WORD_EMBEDDINGS or ".relative_bias." in key:
        return "agree"
    return None


TP_DIVIDES = (("num_attention_heads", "attention heads"), ("ffn_hidden_size", "d_ff"),
              ("padded_vocab_size", "padded vocabulary size"))
"""Sizes a tensor-parallel layout must divide, with their names in messages."""


def pipeline_capacity(args: Dict[str, Any]) -> Tuple[int, str]:
    """(most pipeline stages, how to name that limit in a message)."""
    layers = 2 * args["num_layers"]
    return layers, f"the {layers} encoder + decoder layers"


def matches(args: Dict[str, Any], names: Optional[Sequence[str]] = None) -> bool:
    """Whether a checkpoint describes a T5: T5 runs record ``t5_ff``; when the first rank
    file's tensor names are given, T5's word embeddings must be among them.

    Args:
        args: the saved args.
        names: the tensor names of the (tp 0, pp 0) file, or None when not at hand.
    """
    if "t5_ff" not in args:
        return False
    return names is None or bool({WORD_EMBEDDINGS, PIPE_TIED_PREFIX + "word_embeddings.weight"}
                                 & set(names))
