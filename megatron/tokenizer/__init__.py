"""Tokenizers: GPT-2 byte-level BPE, SentencePiece (T5 sentinels), character vocabulary.

``build_tokenizer(args)`` picks one by ``args.tokenizer_type`` and sets
``args.padded_vocab_size``. Every tokenizer has ``vocab_size``, ``tokenize(text) -> ids``,
``detokenize(ids) -> text``, ``eod``, ``pad``, ``sentinel_ids`` and ``name``.
"""
import logging

from megatron.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "CharTokenizer")


def vocab_size_with_padding(orig_vocab_size, divisible_by, tp):
    """Round the vocab up to a multiple of ``divisible_by * tp`` (Megatron's rule).

    Args:
        orig_vocab_size: the tokenizer's vocab size.
        divisible_by: ``--make-vocab-size-divisible-by`` (128 by default).
        tp: tensor-model-parallel size; each rank then holds an equal, aligned vocab shard.
    """
    if divisible_by < 1 or tp < 1:
        raise ConfigError(f"--make-vocab-size-divisible-by ({divisible_by}) and the tensor "
                          f"parallel size ({tp}) must be >= 1")
    multiple = divisible_by * tp
    return -(-orig_vocab_size // multiple) * multiple


def _require(args, attr, flag, kind):
    path = getattr(args, attr, None)
    if not path:
        raise DataError(f"{kind} needs {flag} (path to the file)")
    return path


def build_tokenizer(args):
    """Build the tokenizer named by ``args.tokenizer_type``; sets ``args.padded_vocab_size``.

    Args:
        args: namespace with ``tokenizer_type``, ``vocab_file``, ``merge_file``,
            ``tokenizer_model``, and optionally ``vocab_extra_ids`` (100),
            ``make_vocab_size_divisible_by`` (128), ``tensor_model_parallel_size`` (1),
            ``rank`` (0; only rank 0 logs).

    Returns:
        The tokenizer.
    """
    kind = getattr(args, "tokenizer_type", None)
    rank = getattr(args, "rank", 0) or 0
    if kind == "GPT2BPETokenizer":
        from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

        tokenizer = GPT2BPETokenizer(_require(args, "vocab_file", "--vocab-file", kind),
                                     _require(args, "merge_file", "--merge-file", kind))
    elif kind == "SentencePieceTokenizer":
        from megatron.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

        extra = getattr(args, "vocab_extra_ids", None)
        tokenizer = SentencePieceTokenizer(
            _require(args, "tokenizer_model", "--tokenizer-model", kind),
            vocab_extra_ids=100 if extra is None else extra)
    elif kind == "CharTokenizer":
        from megatron.tokenizer.char_tokenizer import CharTokenizer

        tokenizer = CharTokenizer(_require(args, "vocab_file", "--vocab-file", kind))
    else:
        raise ConfigError(f"--tokenizer-type {kind!r} is not known; use one of "
                          f"{', '.join(TOKENIZER_TYPES)}")
    divisible_by = getattr(args, "make_vocab_size_divisible_by", None) or 128
    tp = getattr(args, "tensor_model_parallel_size", None) or 1
    args.true_vocab_size = tokenizer.vocab_size  # saved with checkpoints (resharding needs it)
    args.padded_vocab_size = vocab_size_with_padding(tokenizer.vocab_size, divisible_by, tp)
    if rank == 0:
        logger.info("> building %s tokenizer: vocab %d padded with %d dummy tokens to %d "
                    "(multiple of %d x tp %d)", kind, tokenizer.vocab_size,
                    args.padded_vocab_size - tokenizer.vocab_size, args.padded_vocab_size,
                    divisible_by, tp)
    return tokenizer
