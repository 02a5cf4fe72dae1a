"""Where each GPT-2 weight lives: tensor-parallel split dims and pipeline-stage key names.

A *full* state dict uses GPT2Model's key names with every tensor whole::

    embedding.word_embeddings.weight                     [v_pad, h]   split on dim 0 (vocab)
    embedding.position_embeddings.weight                 [p, h]       replicated
    transformer.layers.{i}.input_layernorm.{weight,bias} [h]          replicated
    transformer.layers.{i}.attention.query_key_value.*   [3h(, h)]    split on dim 0 (heads)
    transformer.layers.{i}.attention.dense.weight        [h, h]       split on dim 1
    transformer.layers.{i}.attention.dense.bias          [h]          replicated
    transformer.layers.{i}.post_attention_layernorm.*    [h]          replicated
    transformer.layers.{i}.mlp.dense_h_to_4h.*           [ffn(, h)]   split on dim 0
    transformer.layers.{i}.mlp.dense_4h_to_h.weight      [h, ffn]     split on dim 1
    transformer.layers.{i}.mlp.dense_4h_to_h.bias        [h]          replicated
    transformer.final_layernorm.{weight,bias}            [h]          replicated

These are the ``partition_dim`` attributes the mpu layers set (stride 1 everywhere: the QKV
weight is laid out per head, so a contiguous split gives whole heads); a test checks the
table against the attributes of a built model.

GPT2ModelPipe (pipeline runs) names the same tensors by DeepSpeed layer-spec index:
spec 0 and spec L+2 are the tied embedding (``tied_modules.embed.*``, present on the first
and the last stage), spec i in 1..L is transformer layer i-1 (``{i}.<layer key>``) and spec
L+1 the final LayerNorm (``{L+1}.norm.*``).
"""
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from ..common.errors import CheckpointError
from .chunks import Bounds, placement_of, rank_bounds, spec_indices, vpp_of

WORD_EMBEDDINGS = "embedding.word_embeddings.weight"
POSITION_EMBEDDINGS = "embedding.position_embeddings.weight"
LAYER_PREFIX = "transformer.layers."
FINAL_NORM_PREFIX = "transformer.final_layernorm."

#: Per-layer parameter names (relative to ``transformer.layers.{i}.``).
LAYER_KEYS = (
    "input_layernorm.weight", "input_layernorm.bias",
    "attention.query_key_value.weight", "attention.query_key_value.bias",
    "attention.dense.weight", "attention.dense.bias",
    "post_attention_layernorm.weight", "post_attention_layernorm.bias",
    "mlp.dense_h_to_4h.weight", "mlp.dense_h_to_4h.bias",
    "mlp.dense_4h_to_h.weight", "mlp.dense_4h_to_h.bias",
)
_LAYER_SPLIT_DIMS = {
    "attention.query_key_value.weight": 0, "attention.query_key_value.bias": 0,
    "attention.dense.weight": 1,
    "mlp.dense_h_to_4h.weight": 0, "mlp.dense_h_to_4h.bias": 0,
    "mlp.dense_4h_to_h.weight": 1,
}
_LAYER_KEY = re.compile(r"^transformer\.layers\.(\d+)\.(.+)$")

PIPE_TIED_PREFIX = "tied_modules.embed."
_PIPE_KEY = re.compile(r"^(\d+)\.(.+)$")


def full_keys(num_layers: int, bias: bool = True) -> List[str]:
    """Every key of a full GPT2Model state dict, in model order.

    Args:
        num_layers: transformer layers.
        bias: the linear layers have biases (``--hidden-bias``).
    """
    keys = [WORD_EMBEDDINGS, POSITION_EMBEDDINGS]
    layer_keys = [k for k in LAYER_KEYS if bias or not _is_linear_bias(k)]
    for i in range(num_layers):
        keys += [f"{LAYER_PREFIX}{i}.{k}" for k in layer_keys]
    return keys + [FINAL_NORM_PREFIX + "weight", FINAL_NORM_PREFIX + "bias"]


def _is_linear_bias(layer_key):
    return layer_key.endswith(".bias") and "layernorm" not in layer_key


def tp_split_dim(key: str) -> Optional[int]:
    """Dimension along which ``key`` is split across tensor-parallel ranks, None if replicated."""
    if key == WORD_EMBEDDINGS:
        return 0
    match = _LAYER_KEY.match(key)
    return _LAYER_SPLIT_DIMS.get(match.group(2)) if match else None


def is_pipe_state(state: Mapping[str, Any]) -> bool:
    """True when ``state`` uses GPT2ModelPipe's key names (a pipeline-stage file)."""
    return any(k.startswith(PIPE_TIED_PREFIX) or _PIPE_KEY.match(k) for k in state)


def pipe_to_full_key(key: str, num_layers: int) -> str:
    """A GPT2ModelPipe stage key -> the GPT2Model key of the same tensor.

    Args:
        key: e.g. ``tied_modules.embed.word_embeddings.weight`` or ``3.mlp.dense_4h_to_h.bias``.
        num_layers: transformer layers L (spec L+1 is the final LayerNorm).
    """
    if key.startswith(PIPE_TIED_PREFIX):
        return "embedding." + key[len(PIPE_TIED_PREFIX):]
    match = _PIPE_KEY.match(key)
    if match:
        spec, rest = int(match.group(1)), match.group(2)
        if 1 <= spec <= num_layers:
            return f"{LAYER_PREFIX}{spec - 1}.{rest}"
        if spec == num_layers + 1 and rest.startswith("norm."):
            return FINAL_NORM_PREFIX + rest[len("norm."):]
    raise CheckpointError(f"unexpected pipeline-stage key {key!r} for a {num_layers}-layer GPT-2")


def full_to_pipe_key(key: str) -> str:
    """A GPT2Model key -> the GPT2ModelPipe key (inverse of :func:`pipe_to_full_key`)."""
    if key.startswith("embedding."):
        return PIPE_TIED_PREFIX + key[len("embedding."):]
    match = _LAYER_KEY.match(key)
    if match:
        return f"{int(match.group(1)) + 1}.{match.group(2)}"
    if key.startswith(FINAL_NORM_PREFIX):
        raise ValueError("the final LayerNorm's pipe key depends on num_layers; use "
                         "stage_state_keys")
    raise CheckpointError(f"unexpected GPT-2 key {key!r}")


def stage_spec_bounds(num_layers: int, pp_size: int, vpp_size: int = 1,
                      placement: str = "loop") -> List[Bounds]:
    """``[start, end)`` layer-spec indices of each pipeline stage, as the engine places them
    (with ``vpp_size`` > 1, per rank the list of its chunks' ranges: :mod:`.chunks`).

    GPT2ModelPipe partitions with ``partition_method='type:transformer'``: DeepSpeed's
    ``partition_balanced`` over weights ``[0, 1 x L, 0, 0]`` (embedding, layers, final norm,
    tied head). Calling the same function keeps a converted checkpoint's stages identical
    to those a pipeline run builds.

    Args:
        num_layers: transformer layers L.
        pp_size: pipeline stages.
        vpp_size: model chunks per pipeline rank.
        placement: the chunks' placement ("loop", or "v" for ZB-V: :mod:`.chunks`).
    """
    return rank_bounds([0] + [1] * num_layers + [0, 0], pp_size, vpp_size, placement)


def stage_full_keys(full_keys_list: Sequence[str], num_layers: int,
                    bounds: Bounds) -> Dict[str, str]:
    """``{full key: pipe key}`` for the tensors one stage holds.

    Args:
        full_keys_list: every key of the full state dict.
        num_layers: transformer layers L.
        bounds: the stage's ``(start, end)`` spec indices, or its chunks' (from
            :func:`stage_spec_bounds`).
    """
    specs = spec_indices(bounds)
    has_embedding = 0 in specs or num_layers + 2 in specs
    out = {}
    for key in full_keys_list:
        if key.startswith("embedding."):
            if has_embedding:
                out[key] = full_to_pipe_key(key)
        elif key.startswith(FINAL_NORM_PREFIX):
            if num_layers + 1 in specs:
                out[key] = f"{num_layers + 1}.norm.{key[len(FINAL_NORM_PREFIX):]}"
        else:
            pipe_key = full_to_pipe_key(key)
            if int(pipe_key.split(".", 1)[0]) in specs:
                out[key] = pipe_key
    return out


# ---------------------------------------------------------------- the schema the generic
# reader, writer and resharder use (megatron/checkpoint/native_*.py)
NAME = "GPT-2"
FAMILY = "gpt2"
"""The model family (megatron.families) these keys belong to."""
CONVERT_TOOL = "tools/convert_checkpoint.py"
"""The conversion tool for this model's checkpoints (named in messages)."""
VOCAB_KEYS = (WORD_EMBEDDINGS,)
"""Tensors with one row per (padded) vocabulary entry."""


def expected_keys(args: Dict[str, Any]) -> List[str]:
    """Every key of the full state dict the saved ``args`` describe."""
    return full_keys(args["num_layers"], args.get("hidden_bias", True))


def describe(args: Dict[str, Any]) -> str:
    return f"{args['num_layers']}-layer GPT-2"


def stage_bounds(args: Dict[str, Any], pp: int) -> List[Bounds]:
    return stage_spec_bounds(args["num_layers"], pp, vpp_of(args), placement_of(args))


def stage_keys(full_keys_list: Sequence[str], args: Dict[str, Any],
               bounds: Bounds) -> Dict[str, str]:
    return stage_full_keys(full_keys_list, args["num_layers"], bounds)


def stage_replica(key: str) -> Optional[str]:
    """How a tensor found on a second pipeline stage is treated: ``agree`` (a tied copy
    that must equal the first), ``first`` (an unused copy: the first stage's is real) or
    None (it must not repeat). The last stage's embedding copy serves the tied output layer;
    its position embedding is never used there and keeps its initial values."""
    return {WORD_EMBEDDINGS: "agree", POSITION_EMBEDDINGS: "first"}.get(key)


TP_DIVIDES = (("num_attention_heads", "attention heads"), ("ffn_hidden_size", "ffn hidden size"),
              ("padded_vocab_size", "padded vocabulary size"))
"""Sizes a tensor-parallel layout must divide, with their names in messages."""


def pipeline_capacity(args: Dict[str, Any]) -> Tuple[int, str]:
    """(most pipeline stages, how to name that limit in a message)."""
    return args["num_layers"], f"the number of layers ({args['num_layers']})"


def matches(args: Dict[str, Any], names: Optional[Sequence[str]] = None) -> bool:
    """Whether a checkpoint describes a GPT-2: transformer args that are not T5's and, when
    the first rank file's tensor names are given, GPT-2's word embeddings among them (every
    first stage holds them, serial or pipeline), so another model's checkpoint with the same
    generic args is not taken for GPT-2.

    Args:
        args: the saved args.
        names: the tensor names of the (tp 0, pp 0) file, or None when not at hand.
    """
    if "num_layers" not in args or "t5_ff" in args:
        return False
    return names is None or bool({WORD_EMBEDDINGS, PIPE_TIED_PREFIX + "word_embeddings.weight"}
                                 & set(names))
