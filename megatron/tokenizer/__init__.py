"""Tokenizers: GPT-2 byte-level BPE, SentencePiece (T5 sentinels), character vocabulary.

``build_tokenizer(args)`` picks one by ``tokenizer_type``. Every tokenizer has ``vocab_size``, ``tokenize(text) -> ids``,
``detokenize(ids) -> text``, ``eod``, ``pad``, ``sentinel_ids`` and ``name``.
"""
import logging

from megatron.common.errors import ConfigError, DataError

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


def _settings(args):
    """The tokenizer settings of ``args`` as a dict (a namespace, a RunConfig or a dict)."""
    if isinstance(args, dict):
        return args
    if hasattr(args, "to_dict"):
        return args.to_dict()
    return vars(args)


def _require(settings, key, flag, kind):
    path = settings.get(key)
    if not path:
        raise DataError(f"{kind} needs {flag} (path to the file)")
    return path


def build_tokenizer(args):
    """Build the tokenizer named by ``tokenizer_type`` (the padded vocabulary size is derived
    from its ``vocab_size`` by megatron.config, see :func:`vocab_size_with_padding`).

    Args:
        args: a namespace, RunConfig or dict with ``tokenizer_type``, ``vocab_file``,
            ``merge_file``, ``tokenizer_model``, and optionally ``vocab_extra_ids`` (100) and
            ``rank`` (0; only rank 0 logs).

    Returns:
        The tokenizer.
    """
    settings = _settings(args)
    kind = settings.get("tokenizer_type")
    if kind == "GPT2BPETokenizer":
        from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer

        tokenizer = GPT2BPETokenizer(_require(settings, "vocab_file", "--vocab-file", kind),
                                     _require(settings, "merge_file", "--merge-file", kind))
    elif kind == "SentencePieceTokenizer":
        from megatron.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

        extra = settings.get("vocab_extra_ids")
        tokenizer = SentencePieceTokenizer(
            _require(settings, "tokenizer_model", "--tokenizer-model", kind),
            vocab_extra_ids=100 if extra is None else extra)
    elif kind == "CharTokenizer":
        from megatron.tokenizer.char_tokenizer import CharTokenizer

        tokenizer = CharTokenizer(_require(settings, "vocab_file", "--vocab-file", kind))
    else:
        raise ConfigError(f"--tokenizer-type {kind!r} is not known; use one of "
                          f"{', '.join(TOKENIZER_TYPES)}")
    if not settings.get("rank"):
        logger.info("> building %s tokenizer: vocab %d", kind, tokenizer.vocab_size)
    return tokenizer
