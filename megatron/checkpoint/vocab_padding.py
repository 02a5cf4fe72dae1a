"""Padded vocabulary across layouts: keep the real rows, re-pad with zeros.

Training pads the vocabulary to a multiple of ``make_vocab_size_divisible_by x tp``
(:func:`megatron.tokenizer.vocab_size_with_padding`), so a checkpoint resharded to another
tp may need another padded size -- the one a training run at the new tp computes from its
tokenizer, or its load check (``padded_vocab_size``) fails. The real rows are kept; when the
padded size changes, every padding row is zero (padded ids never occur in data and are never
sampled). When it does not change, the rows are copied as they are, so the model is the same
function bit for bit.
"""
import argparse
import os
from typing import Any, Dict, Optional, Sequence

import torch

from ..common.errors import CheckpointError
from ..tokenizer import vocab_size_with_padding
from .gpt2_keys import WORD_EMBEDDINGS


def tokenizer_from_args(args: Dict[str, Any]) -> Optional[Any]:
    """The tokenizer the saved args name, when its files still exist; else None.

    Args:
        args: saved args dict (``tokenizer_type``, ``vocab_file``, ``merge_file``, ...).
    """
    kind = args.get("tokenizer_type")
    files = [args.get(k) for k in ("vocab_file", "merge_file", "tokenizer_model") if args.get(k)]
    if not kind or not files or not all(os.path.isfile(f) for f in files):
        return None
    from ..tokenizer import build_tokenizer

    namespace = argparse.Namespace(
        tokenizer_type=kind, vocab_file=args.get("vocab_file"),
        merge_file=args.get("merge_file"), tokenizer_model=args.get("tokenizer_model"),
        vocab_extra_ids=args.get("vocab_extra_ids"), make_vocab_size_divisible_by=1,
        tensor_model_parallel_size=1, rank=1)
    try:
        return build_tokenizer(namespace)
    except ValueError:
        return None


def resolve_true_vocab_size(args: Dict[str, Any], override: Optional[int] = None) -> Optional[int]:
    """The number of real (unpadded) vocabulary rows, or None when it cannot be known.

    Args:
        args: saved args dict of the source checkpoint.
        override: ``--true-vocab-size`` given by the user (wins).

    Looks at the override, then ``args['true_vocab_size']`` (written by the conversion
    tool), then the tokenizer files the args name.
    """
    for value in (override, args.get("true_vocab_size")):
        if value:
            return int(value)
    tokenizer = tokenizer_from_args(args)
    return tokenizer.vocab_size if tokenizer is not None else None


def target_padded_size(args: Dict[str, Any], tp: int, divisible_by: Optional[int],
                       true_vocab: Optional[int]) -> int:
    """Padded vocabulary size for layout ``tp``, as a training run there would compute it.

    Args:
        args: source args dict (``padded_vocab_size``, ``tensor_model_parallel_size``,
            ``make_vocab_size_divisible_by``).
        tp: target tensor-parallel size.
        divisible_by: target ``--make-vocab-size-divisible-by``.
        true_vocab: real rows, or None if unknown.

    Raises:
        CheckpointError: the size changes with the layout and the real vocabulary is unknown.
    """
    if true_vocab is not None:
        if true_vocab > args["padded_vocab_size"]:
            raise CheckpointError(f"true vocabulary size {true_vocab} is larger than the "
                                  f"checkpoint's padded vocabulary {args['padded_vocab_size']}")
        return vocab_size_with_padding(true_vocab, divisible_by, tp)
    same = (tp == args.get("tensor_model_parallel_size")
            and divisible_by == args.get("make_vocab_size_divisible_by"))
    if same:
        return args["padded_vocab_size"]
    raise CheckpointError("the padded vocabulary size depends on the tensor-parallel size, and "
                          "the real vocabulary size is unknown (the tokenizer files the "
                          "checkpoint names are gone); pass --true-vocab-size N (or "
                          "--vocab-file/--merge-file)")


def repad_vocab_rows(state: Dict[str, torch.Tensor], true_vocab: int, padded: int,
                     vocab_keys: Sequence[str] = (WORD_EMBEDDINGS,)) -> Dict[str, torch.Tensor]:
    """``state`` with its vocabulary tensors re-padded to ``padded`` rows (a new dict).

    Args:
        state: full state dict.
        true_vocab: real rows to keep (None: only allowed when the size does not change).
        padded: target number of rows.
        vocab_keys: the tensors with a row per vocabulary entry (the family's ``VOCAB_KEYS``:
            the word embedding, and T5's untied lm head).
    """
    out = dict(state)
    for key in vocab_keys:
        if key not in state or state[key].shape[0] == padded:
            continue
        weight = state[key]  # [v_pad_old, h]
        if true_vocab is None or true_vocab > min(weight.shape[0], padded):
            raise CheckpointError(f"cannot re-pad {weight.shape[0]} vocabulary rows to "
                                  f"{padded} without knowing the real vocabulary size (got "
                                  f"{true_vocab}); pass --true-vocab-size")
        new = torch.zeros(padded, weight.shape[1], dtype=weight.dtype)  # [v_pad_new, h]
        new[:true_vocab] = weight[:true_vocab]
        out[key] = new
    return out
