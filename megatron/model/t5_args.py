"""T5's flags and their one validation pass (on top of megatron/arguments.py's).

Flags (CPM-Pretrain's names; the generic ``--num-layers`` counts layers per stack,
``--hidden-size`` is d_model, ``--kv-hidden-size`` d_kv, ``--ff-hidden-size`` d_ff):

    --enc-seq-length / --encoder-seq-length   encoder tokens (``--seq-length`` defaults to it)
    --dec-seq-length / --decoder-seq-length   decoder tokens (labels of the span corruption)
    --relative-attention-num-buckets 32       --relative-attention-max-distance 128
    --t5-ff {relu,gated-gelu}                 T5 v1.0 / v1.1 feed-forward
    --untie-embeddings                        separate lm head, no d_model^-0.5 scaling (v1.1)
    --noise-density 0.15  --mean-span-length 3   span corruption

:func:`check_t5_args` lists every T5 problem in one ConfigError before anything starts:
lengths the span corruption cannot fill, relative-attention settings whose buckets are not
defined, a tokenizer without sentinels, an encoder sample longer than the data.
"""
import argparse

from ..errors import ConfigError, DataError
from .t5_layers import FF_TYPES

#: T5 has no position embeddings; the generic --max-position-embeddings is set this high so
#: any --enc-seq-length validates and a checkpoint loads at another length (fine-tuning).
NO_POSITION_LIMIT = 2 ** 31 - 1

#: Defaults pretrain_t5.py sets for the generic flags (a flag or config file overrides them).
T5_DEFAULTS = {"tokenizer_type": "SentencePieceTokenizer", "layernorm_epsilon": 1e-6,
               "hidden_bias": False, "max_position_embeddings": NO_POSITION_LIMIT}


def add_t5_args(parser):
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
    parser.set_defaults(layer_stacks=2)  # pipeline stages may hold up to 2 x --num-layers
    return parser


def t5_defaults(argv=None):
    """Entry-script defaults: :data:`T5_DEFAULTS`, plus ``--seq-length`` from the encoder
    length (or the encoder length from ``--seq-length``) when only one of them is given.

    Args:
        argv: the command line (default ``sys.argv[1:]``); a ``--config`` file is read too.
    """
    from ..arguments import build_parser
    from ..config_file import apply_config_file

    parser = build_parser(add_t5_args)
    parser.set_defaults(**T5_DEFAULTS)
    pre, _ = parser.parse_known_args(argv)
    if pre.config:
        apply_config_file(parser, pre.config)
        pre, _ = parser.parse_known_args(argv)
    defaults = dict(T5_DEFAULTS)
    if pre.enc_seq_length is not None and pre.seq_length is None:
        defaults["seq_length"] = pre.enc_seq_length
    elif pre.enc_seq_length is None and pre.seq_length is not None:
        defaults["enc_seq_length"] = pre.seq_length
    return defaults


def _length_problems(args, problems):
    enc, dec = args.enc_seq_length, args.dec_seq_length
    if enc is None:
        problems.append("--enc-seq-length (or --seq-length) is required")
    elif args.seq_length != enc:
        problems.append(f"--seq-length ({args.seq_length}) and --enc-seq-length ({enc}) "
                        f"disagree; give only --enc-seq-length")
    if dec is None:
        problems.append("--dec-seq-length is required (decoder tokens per sample)")
    elif dec < 2:
        problems.append(f"--dec-seq-length must be >= 2, got {dec}")


def _relative_attention_problems(args, problems):
    buckets, distance = args.relative_attention_num_buckets, args.relative_attention_max_distance
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


def _data_problems(args, plan, problems):
    from ..validation import parse_data_path

    try:
        _, prefixes = parse_data_path(args.data_path or [])
        for prefix in prefixes:
            tokens = _split_tokens(prefix, args.split)
            if tokens < plan["raw"]:
                problems.append(
                    f"--enc-seq-length {args.enc_seq_length} needs {plan['raw']} raw tokens per "
                    f"sample but the train split of {prefix} holds {tokens}; shorten the "
                    f"sequences or give more data")
    except (DataError, ConfigError, OSError) as exc:
        problems.append(str(exc))


def check_t5_args(args, tokenizer):
    """Raise one ConfigError listing every T5 problem (nothing else has started yet).

    Args:
        args: validated generic args with the T5 flags.
        tokenizer: the run's tokenizer (needs sentinels, pad and eos).
    """
    from ..data.t5_dataset import make_plan

    problems = []
    _length_problems(args, problems)
    _relative_attention_problems(args, problems)
    if not problems:
        try:
            plan = make_plan(args.enc_seq_length, args.dec_seq_length, tokenizer,
                             args.noise_density, args.mean_span_length)
        except ConfigError as exc:
            problems.append(str(exc))
        else:
            if args.data_path:
                _data_problems(args, plan, problems)
    if problems:
        raise ConfigError("invalid T5 configuration:\n  - " + "\n  - ".join(problems))


def validate_t5_command_line(argv, defaults):
    """Parse ``argv`` as pretrain_t5.py will, then run :func:`check_t5_args` (no side effects).

    Returns:
        The parsed args.
    """
    from ..arguments import parse_args
    from ..tokenizer import build_tokenizer

    args = parse_args(argv, add_t5_args, defaults)
    check_t5_args(args, build_tokenizer(argparse.Namespace(**vars(args))))
    return args
