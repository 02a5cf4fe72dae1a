"""Megatron-LM's GPT weight names <-> this project's full GPT-2 keys (:mod:`..gpt2_keys`).

Megatron-LM saves ``state_dict_for_save_checkpoint()``: nested dicts, which
:func:`flatten` joins with dots::

    language_model.embedding.word_embeddings.weight          embedding.word_embeddings.weight
    language_model.embedding.position_embeddings.weight      embedding.position_embeddings.weight
    language_model.transformer.layers.{j}.<layer key>         transformer.layers.{offset+j}.<...>
      (.encoder. from v2.5 on; .attention. became .self_attention. with it)
    language_model.transformer.final_layernorm.{weight,bias} transformer.final_layernorm.*
    word_embeddings_for_head.weight                          the tied output copy held by the
                                                             last pipeline stage (pp > 1)

Layer numbers are local to a pipeline stage (and to a virtual-pipeline chunk): the caller
gives the offset. The per-layer names (``input_layernorm``, ``query_key_value``, ``dense``,
``post_attention_layernorm``, ``mlp.dense_h_to_4h``, ``mlp.dense_4h_to_h``) are the same in
both projects; only the fused QKV row order differs by version (:mod:`.qkv`).
"""
import re
from typing import Any, Dict, Optional, Tuple

from ...common.errors import CheckpointError
from .. import gpt2_keys

LANGUAGE_MODEL = "language_model."
HEAD_COPY = "word_embeddings_for_head.weight"
#: The two names of the transformer stack, oldest first.
STACK_NAMES = ("transformer", "encoder")
_LAYER = re.compile(r"^(?:transformer|encoder)\.layers\.(\d+)\.(.+)$")
_FINAL_NORM = re.compile(r"^(?:transformer|encoder)\.final_layernorm\.(weight|bias)$")
_EMBEDDING = {"embedding.word_embeddings.weight": gpt2_keys.WORD_EMBEDDINGS,
              "embedding.position_embeddings.weight": gpt2_keys.POSITION_EMBEDDINGS}
#: Tensors of other heads or features (BERT's, an untied output layer, TransformerEngine's
#: metadata), named in the error when met.
_UNTIED = ("output_layer.weight", "lm_head.weight")


def flatten(tree: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    """Nested dicts of tensors -> ``{dotted.name: tensor}``."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


def language_model_part(flat: Dict[str, Any]) -> Tuple[Dict[str, Any], Optional[Any]]:
    """The language-model tensors (prefix removed) and the head copy (or None).

    A model dict without ``language_model`` is the language model itself, as Megatron-LM's
    ``GPTModel.load_state_dict`` reads it.
    """
    head = flat.get(HEAD_COPY)
    if any(k.startswith(LANGUAGE_MODEL) for k in flat):
        rest = sorted(k for k in flat if not k.startswith(LANGUAGE_MODEL) and k != HEAD_COPY)
        if rest:
            raise CheckpointError(_unknown(rest))
        lm = {k[len(LANGUAGE_MODEL):]: v for k, v in flat.items() if k.startswith(LANGUAGE_MODEL)}
    else:
        lm = {k: v for k, v in flat.items() if k != HEAD_COPY}
    return lm, head


def _unknown(keys):
    untied = [k for k in keys if k.endswith(_UNTIED)]
    if untied:
        return (f"the checkpoint has an untied output layer ({untied[0]}); GPT2Model ties its "
                f"output layer to the word embeddings, so it cannot be loaded")
    return (f"the checkpoint holds tensors that are not a Megatron-LM GPT model's: "
            f"{keys[:4]} (a BERT, T5 or other model, or a newer Megatron-core layout)")


def layer_counts(lm: Dict[str, Any]) -> int:
    """Number of transformer layers in one chunk's language-model tensors."""
    found = {int(m.group(1)) for k in lm if (m := _LAYER.match(k))}
    if found and found != set(range(len(found))):
        raise CheckpointError(f"layer numbers {sorted(found)} of a pipeline stage are not "
                              f"0..{len(found) - 1}")
    return len(found)


def to_full_keys(lm: Dict[str, Any], offset: int) -> Dict[str, Any]:
    """One chunk's language-model tensors -> ``{full GPT-2 key: tensor}``.

    Args:
        lm: from :func:`language_model_part`.
        offset: the global index of this chunk's first layer.
    """
    out, unknown = {}, []
    for key, tensor in lm.items():
        if key.endswith("._extra_state"):
            continue
        match = _LAYER.match(key)
        if match:
            rest = match.group(2).replace("self_attention.", "attention.", 1)
            if rest not in gpt2_keys.LAYER_KEYS:
                unknown.append(key)
                continue
            out[f"{gpt2_keys.LAYER_PREFIX}{offset + int(match.group(1))}.{rest}"] = tensor
            continue
        match = _FINAL_NORM.match(key)
        if match:
            out[gpt2_keys.FINAL_NORM_PREFIX + match.group(1)] = tensor
        elif key in _EMBEDDING:
            out[_EMBEDDING[key]] = tensor
        else:
            unknown.append(key)
    if unknown:
        raise CheckpointError(_unknown(sorted(unknown)))
    return out


def is_qkv(full_key: str) -> bool:
    return ".attention.query_key_value." in full_key


# ---------------------------------------------------------------- writing (version 3)
def stage_tree(stage: Dict[str, Any], first_layer: int,
               has_head_copy: bool) -> Dict[str, Any]:
    """One stage's full-key tensors -> the nested dict Megatron-LM v2.5+ saves as ``model``.

    Args:
        stage: ``{full GPT-2 key: tensor}`` of this stage (already this tp rank's shard).
        first_layer: the global index of the stage's first layer (layers are renumbered
            from 0, as Megatron-LM numbers them within a stage).
        has_head_copy: this is the last of several stages: it holds the tied output copy
            of the word embeddings as ``word_embeddings_for_head``.
    """
    embedding, encoder = {}, {}
    for key, tensor in stage.items():
        if key == gpt2_keys.WORD_EMBEDDINGS and has_head_copy:
            continue
        if key in (gpt2_keys.WORD_EMBEDDINGS, gpt2_keys.POSITION_EMBEDDINGS):
            embedding[key.split(".")[1]] = {"weight": tensor}
        elif key.startswith(gpt2_keys.FINAL_NORM_PREFIX):
            encoder["final_layernorm." + key[len(gpt2_keys.FINAL_NORM_PREFIX):]] = tensor
        else:
            index, rest = key[len(gpt2_keys.LAYER_PREFIX):].split(".", 1)
            rest = rest.replace("attention.", "self_attention.", 1)
            encoder[f"layers.{int(index) - first_layer}.{rest}"] = tensor
    language_model = {}
    if embedding:
        language_model["embedding"] = embedding
    language_model["encoder"] = encoder
    tree = {"language_model": language_model}
    if has_head_copy:
        tree["word_embeddings_for_head"] = {"weight": stage[gpt2_keys.WORD_EMBEDDINGS]}
    return tree
