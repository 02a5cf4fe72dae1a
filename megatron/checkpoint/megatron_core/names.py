"""Megatron-Core's GPT weight names <-> this project's full GPT-2 keys (:mod:`..gpt2_keys`).

Megatron-Core's ``GPTModel`` (``megatron/core/models/gpt``) names its tensors by module::

    embedding.word_embeddings.weight                 embedding.word_embeddings.weight
    embedding.position_embeddings.weight             embedding.position_embeddings.weight
    decoder.layers.{i}.<layer name>                  transformer.layers.{i}.<our layer key>
    decoder.final_layernorm.{weight,bias}            transformer.final_layernorm.*
    output_layer.weight                              the tied output copy a last pipeline
                                                     stage holds (legacy files, pp > 1)

The layer names come in two spellings of the same tensors: the local spec's
(``input_layernorm``, ``pre_mlp_layernorm``) and TransformerEngine's, which fuses each
LayerNorm into the linear after it (``self_attention.linear_qkv.layer_norm_weight``,
``mlp.linear_fc1.layer_norm_weight``). A ``torch_dist`` checkpoint always uses the fused
names (the local spec maps its own to them when it saves, so the two load each other's);
a legacy ``mp_rank_*`` file uses its spec's module names. ``*._extra_state`` entries
(TransformerEngine's FP8 metadata, None in the local spec) carry no weights and are
skipped.

In ``torch_dist`` the layers are stacked on a first dimension (``decoder.layers.<name>``
of shape ``[L, ...]``, the global layer index first), or, for models saved with
``non_homogeneous_layers``, kept per layer under their global index. Legacy files number
layers within their pipeline stage (and virtual chunk); the caller adds the offset.

The fused QKV rows are per head ``[np, 3, hn]`` (Megatron-Core's
``[ng, (np/ng + 2), hn]`` with one query group per head), which is this project's order.
"""
import re
from typing import Any, Dict, Iterable, List, Optional

import torch

from ...common.errors import CheckpointError
from .. import gpt2_keys

#: Megatron-Core layer names (both spellings) -> our layer keys (``gpt2_keys.LAYER_KEYS``).
LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "input_layernorm.bias": "input_layernorm.bias",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_bias": "input_layernorm.bias",
    "self_attention.linear_qkv.weight": "attention.query_key_value.weight",
    "self_attention.linear_qkv.bias": "attention.query_key_value.bias",
    "self_attention.linear_proj.weight": "attention.dense.weight",
    "self_attention.linear_proj.bias": "attention.dense.bias",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.bias": "post_attention_layernorm.bias",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_bias": "post_attention_layernorm.bias",
    "mlp.linear_fc1.weight": "mlp.dense_h_to_4h.weight",
    "mlp.linear_fc1.bias": "mlp.dense_h_to_4h.bias",
    "mlp.linear_fc2.weight": "mlp.dense_4h_to_h.weight",
    "mlp.linear_fc2.bias": "mlp.dense_4h_to_h.bias",
}
#: What a ``torch_dist`` checkpoint calls each of our layer keys (the fused spelling).
DIST_LAYER_NAMES = {ours: theirs for theirs, ours in LAYER_NAMES.items()
                    if not theirs.startswith(("input_layernorm", "pre_mlp_layernorm"))}
TOP_NAMES = {
    "embedding.word_embeddings.weight": gpt2_keys.WORD_EMBEDDINGS,
    "embedding.position_embeddings.weight": gpt2_keys.POSITION_EMBEDDINGS,
    "decoder.final_layernorm.weight": gpt2_keys.FINAL_NORM_PREFIX + "weight",
    "decoder.final_layernorm.bias": gpt2_keys.FINAL_NORM_PREFIX + "bias",
}
OUTPUT_LAYER = "output_layer.weight"
LAYERS = "decoder.layers."
#: Modules whose ``_extra_state`` a ``torch_dist`` checkpoint holds per layer (a local-spec
#: and a TransformerEngine-spec GPTModel between them ask for these when they load).
EXTRA_STATE_MODULES = ("self_attention.core_attention", "self_attention.linear_qkv",
                       "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
EXTRA_STATE = "._extra_state"
_PER_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
#: Names of Megatron-Core features GPT2Model does not compute, for the error message.
_FEATURES = (("rotary_pos_emb", "rotary position embeddings"),
             ("q_layernorm", "query/key LayerNorm (--qk-layernorm)"),
             ("k_layernorm", "query/key LayerNorm (--qk-layernorm)"),
             ("mlp.router", "mixture of experts"), ("mlp.experts", "mixture of experts"),
             ("linear_q_down_proj", "multi-latent attention"),
             ("linear_kv_down_proj", "multi-latent attention"),
             ("mtp.", "multi-token prediction"))


def is_core_name(key: str) -> bool:
    """Whether ``key`` is spelled as a Megatron-Core GPT model's tensor."""
    return key.startswith(("decoder.", "embedding.", "output_layer."))


def is_weight_name(key: str) -> bool:
    """Whether ``key`` names a model tensor (not ``_extra_state``, not optimizer state)."""
    return is_core_name(key) and EXTRA_STATE not in key


def unsupported(keys: Iterable[str]) -> CheckpointError:
    """The error for tensors with no GPT-2 counterpart, naming the feature when known."""
    keys = sorted(keys)
    for key in keys:
        for marker, feature in _FEATURES:
            if marker in key:
                return CheckpointError(f"the Megatron-Core checkpoint uses {feature} ({key}), "
                                       f"which GPT2Model does not compute")
    return CheckpointError(f"the checkpoint holds tensors that are not a Megatron-Core GPT "
                           f"model's: {keys[:4]} (a BERT, T5, Mamba or other model?)")


def _layer_key(index: int, rest: str) -> Optional[str]:
    ours = LAYER_NAMES.get(rest)
    return None if ours is None else f"{gpt2_keys.LAYER_PREFIX}{index}.{ours}"


def to_full_keys(flat: Dict[str, Any], offset: int = 0,
                 head_copy: Optional[List[Any]] = None) -> Dict[str, Any]:
    """Megatron-Core tensors -> ``{full GPT-2 key: tensor}``.

    Args:
        flat: ``{name: tensor}``: per-layer names (``decoder.layers.{j}.``, ``j`` local to
            the stage when ``offset`` is given) and stacked ones (``decoder.layers.<name>``
            ``[L, ...]``, global indices).
        offset: global index of the first layer ``decoder.layers.0.`` names.
        head_copy: a list that receives ``output_layer.weight`` when present (the tied copy
            a last legacy stage holds); None: such a tensor is refused (an untied head).

    Raises:
        CheckpointError: a tensor with no GPT-2 counterpart (the feature named when known).
    """
    out, unknown = {}, []
    for key, tensor in flat.items():
        if key.endswith(EXTRA_STATE):
            continue
        if key == OUTPUT_LAYER and head_copy is not None:
            head_copy.append(tensor)
            continue
        if key in TOP_NAMES:
            out[TOP_NAMES[key]] = tensor
            continue
        match = _PER_LAYER.match(key)
        if match:
            full = _layer_key(offset + int(match.group(1)), match.group(2))
            if full is not None:
                out[full] = tensor
                continue
        elif key.startswith(LAYERS) and key[len(LAYERS):] in LAYER_NAMES:
            for index, layer in enumerate(tensor.unbind(0)):  # [L, ...] -> L x [...]
                out[_layer_key(index, key[len(LAYERS):])] = layer
            continue
        unknown.append(key)
    if unknown:
        if OUTPUT_LAYER in unknown:
            raise CheckpointError(f"the checkpoint has an untied output layer "
                                  f"({OUTPUT_LAYER}); GPT2Model ties its output layer to the "
                                  f"word embeddings, so it cannot be loaded")
        raise unsupported(unknown)
    return out


def layer_count(flat: Dict[str, Any]) -> int:
    """Transformer layers in one legacy stage file's (or chunk's) tensors."""
    found = {int(m.group(1)) for k in flat if (m := _PER_LAYER.match(k))}
    if found and found != set(range(len(found))):
        raise CheckpointError(f"layer numbers {sorted(found)} of a pipeline stage are not "
                              f"0..{len(found) - 1}")
    return len(found)


def to_dist_names(full: Dict[str, Any], num_layers: int) -> Dict[str, Any]:
    """``{full GPT-2 key: tensor}`` -> ``torch_dist`` names, layers stacked ``[L, ...]``."""
    top = {ours: theirs for theirs, ours in TOP_NAMES.items()}
    out = {top[k]: v for k, v in full.items() if k in top}
    for ours, theirs in DIST_LAYER_NAMES.items():
        layers = [full.get(f"{gpt2_keys.LAYER_PREFIX}{i}.{ours}") for i in range(num_layers)]
        if all(layer is not None for layer in layers):
            out[LAYERS + theirs] = torch.stack(layers)  # L x [...] -> [L, ...]
    return out
