"""Megatron-LM's saved ``args`` (an ``argparse.Namespace``, or nothing) <-> this project's
saved-args dict.

Sizes are taken from the tensors where they can be (hidden size, layers, padded vocabulary,
positions, FFN size, biases) and checked against the saved args when there are any. What
tensors cannot tell comes from the args, else from the caller's hints (a training run's
flags, the conversion tool's ``--num-attention-heads``): the number of attention heads, the
tokenizer, and the real (unpadded) vocabulary size.

Megatron-LM variants GPT2Model does not compute are refused: post-LayerNorm residuals
(``--apply-residual-connection-post-layernorm``), rotary or other position embeddings,
RMSNorm, SwiGLU, grouped-query attention, untied output layers.
"""
import argparse
from typing import Any, Dict, Mapping, Optional, Tuple

from ...common.errors import CheckpointError, ConfigError
from .. import gpt2_keys

#: Megatron-LM's default ``--make-vocab-size-divisible-by``.
DEFAULT_DIVISIBLE_BY = 128
#: Settings copied as they are when the saved args have them.
_COPIED = ("seq_length", "layernorm_epsilon", "hidden_dropout", "attention_dropout",
           "init_method_std", "tokenizer_type", "vocab_file", "merge_file",
           "make_vocab_size_divisible_by")
_DEFAULTS = {"layernorm_epsilon": 1e-5, "hidden_dropout": 0.1, "attention_dropout": 0.1,
             "init_method_std": 0.02, "make_vocab_size_divisible_by": DEFAULT_DIVISIBLE_BY}


def namespace_dict(args: Any) -> Dict[str, Any]:
    """The saved args as a plain dict ({} when absent)."""
    if args is None:
        return {}
    if isinstance(args, argparse.Namespace):
        return dict(vars(args))
    if isinstance(args, dict):
        return dict(args)
    raise CheckpointError(f"the checkpoint's args are a {type(args).__name__}, expected an "
                          f"argparse.Namespace")


def check_supported(saved: Mapping[str, Any]) -> None:
    """Raise ConfigError for a Megatron-LM model GPT2Model does not compute."""
    problems = []
    if saved.get("apply_residual_connection_post_layernorm"):
        problems.append("apply_residual_connection_post_layernorm=True")
    if saved.get("position_embedding_type", "learned_absolute") != "learned_absolute":
        problems.append(f"position_embedding_type={saved['position_embedding_type']!r}")
    if saved.get("normalization", "LayerNorm") != "LayerNorm":
        problems.append(f"normalization={saved['normalization']!r}")
    if saved.get("swiglu"):
        problems.append("swiglu=True")
    if saved.get("group_query_attention"):
        problems.append("group_query_attention=True")
    if saved.get("untie_embeddings_and_output_weights"):
        problems.append("untie_embeddings_and_output_weights=True")
    if problems:
        raise ConfigError("this Megatron-LM model is not a GPT-2 that GPT2Model computes: "
                          + ", ".join(problems))


def _agree(saved, name, measured, path):
    value = saved.get(name)
    if value is not None and measured is not None and value != measured:
        raise CheckpointError(f"{path}: its args say {name}={value}, its tensors {measured}")


def model_args(saved: Dict[str, Any], full: Dict[str, Any], tp: int, pp: int,
               hints: Optional[Dict[str, Any]], path: str) -> Dict[str, Any]:
    """This project's saved-args dict for a whole model read from a Megatron-LM checkpoint.

    Args:
        saved: the Megatron-LM args as a dict ({} when the file has none).
        full: ``{full GPT-2 key: tensor}`` (merged, not yet checked complete).
        tp, pp: the checkpoint's layout.
        hints: settings the tensors and args may lack (``num_attention_heads``,
            ``true_vocab_size``, ``vocab_file``, ``merge_file``, ``tokenizer_type``).
        path: for messages.
    """
    check_supported(saved)
    words = full.get(gpt2_keys.WORD_EMBEDDINGS)
    positions = full.get(gpt2_keys.POSITION_EMBEDDINGS)
    if words is None or positions is None:
        raise CheckpointError(f"{path}: no word or position embeddings (the first pipeline "
                              f"stage's files are missing?)")
    layers = len({k.split(".")[2] for k in full if k.startswith(gpt2_keys.LAYER_PREFIX)})
    hidden = words.shape[1]
    qkv = full.get(f"{gpt2_keys.LAYER_PREFIX}0.attention.query_key_value.weight")
    h_to_4h = full.get(f"{gpt2_keys.LAYER_PREFIX}0.mlp.dense_h_to_4h.weight")
    if qkv is None or h_to_4h is None:
        raise CheckpointError(f"{path}: the first transformer layer is missing")
    heads = saved.get("num_attention_heads") or hints.get("num_attention_heads")
    if not heads:
        raise ConfigError(f"{path} saves no args, so its number of attention heads is "
                          f"unknown; pass --num-attention-heads (the released GPT-2 345M "
                          f"has 16)")
    _agree(saved, "hidden_size", hidden, path)
    _agree(saved, "num_layers", layers, path)
    _agree(saved, "padded_vocab_size", words.shape[0], path)
    _agree(saved, "max_position_embeddings", positions.shape[0], path)
    _agree(saved, "ffn_hidden_size", h_to_4h.shape[0], path)
    if hints.get("num_attention_heads") and hints["num_attention_heads"] != heads:
        raise CheckpointError(f"{path}: its args say num_attention_heads={heads}, the run "
                              f"{hints['num_attention_heads']}")
    if qkv.shape[0] % (3 * heads):
        raise CheckpointError(f"{path}: query_key_value has {qkv.shape[0]} rows, not a "
                              f"multiple of 3 x {heads} heads")
    kv_channels = qkv.shape[0] // (3 * heads)
    args = {k: v for k, v in _DEFAULTS.items()}
    args.update({k: saved[k] for k in _COPIED if saved.get(k) is not None})
    args.update({k: hints[k] for k in ("vocab_file", "merge_file", "tokenizer_type")
                 if hints.get(k)})
    if args.get("vocab_file") and not args.get("tokenizer_type"):
        args["tokenizer_type"] = "GPT2BPETokenizer"
    args.update(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        kv_channels=kv_channels, ffn_hidden_size=h_to_4h.shape[0],
        max_position_embeddings=positions.shape[0], padded_vocab_size=words.shape[0],
        hidden_bias=f"{gpt2_keys.LAYER_PREFIX}0.attention.query_key_value.bias" in full,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    args.setdefault("seq_length", positions.shape[0])
    true_vocab = hints.get("true_vocab_size")
    if true_vocab:
        args["true_vocab_size"] = int(true_vocab)
    return args


def megatron_namespace(args: Dict[str, Any], iteration: int,
                       consumed: Tuple[int, int] = (0, 0)) -> argparse.Namespace:
    """The ``argparse.Namespace`` a version-3 file saves: every setting Megatron-LM's
    ``check_checkpoint_args`` compares, and the model's sizes.

    Args:
        args: this project's saved-args dict of the target layout.
        iteration: the iteration saved.
        consumed: (consumed train samples, consumed valid samples).
    """
    return argparse.Namespace(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"],
        num_attention_heads=args["num_attention_heads"],
        kv_channels=args.get("kv_channels") or args["hidden_size"] // args["num_attention_heads"],
        ffn_hidden_size=args.get("ffn_hidden_size") or 4 * args["hidden_size"],
        max_position_embeddings=args["max_position_embeddings"],
        seq_length=args.get("seq_length") or args["max_position_embeddings"],
        padded_vocab_size=args["padded_vocab_size"],
        make_vocab_size_divisible_by=args.get("make_vocab_size_divisible_by")
        or DEFAULT_DIVISIBLE_BY,
        tokenizer_type=args.get("tokenizer_type") or "GPT2BPETokenizer",
        vocab_file=args.get("vocab_file"), merge_file=args.get("merge_file"),
        tensor_model_parallel_size=args["tensor_model_parallel_size"],
        pipeline_model_parallel_size=args["pipeline_model_parallel_size"],
        virtual_pipeline_model_parallel_size=None,
        layernorm_epsilon=args.get("layernorm_epsilon", 1e-5),
        hidden_dropout=args.get("hidden_dropout", 0.1),
        attention_dropout=args.get("attention_dropout", 0.1),
        init_method_std=args.get("init_method_std", 0.02),
        apply_residual_connection_post_layernorm=False, openai_gelu=True,
        bias_gelu_fusion=True, iteration=iteration,
        consumed_train_samples=consumed[0], consumed_valid_samples=consumed[1])
