"""Flags that choose how fast the step runs, not what it computes (docs/training.md).

    --attention-backend {auto,flash,fused,sdpa,unfused,local}   Megatron-LM's spellings
    --use-flash-attn                                            Megatron-LM's older flag
    --compile                                                   torch.compile each layer

``auto`` (the default), ``flash``, ``fused`` and ``sdpa`` run attention through
``scaled_dot_product_attention``; ``unfused`` and ``local`` run Megatron's bmm + fused
masked softmax (megatron/model/attention.py). Validation stores the implementation's name
(``sdpa`` / ``unfused``) in ``attention_backend``.
"""
from ..model.attention import ATTENTION_BACKENDS, resolve_attention_backend


def add_speed_args(parser):
    """Add the "speed" group: ``--attention-backend``, ``--use-flash-attn``, ``--compile``."""
    g = parser.add_argument_group("speed")
    g.add_argument("--attention-backend", choices=sorted(ATTENTION_BACKENDS), default="auto",
                   help="auto/flash/fused/sdpa: scaled_dot_product_attention (flash, cuDNN or "
                        "memory-efficient kernels); unfused/local: bmm + fused masked softmax")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="Megatron-LM's flag: same as --attention-backend flash (the default)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer layer (regional compilation)")
    return parser


def validate_speed(args, problems):
    """Resolve ``--attention-backend`` to ``sdpa`` / ``unfused``; a contradiction is a problem."""
    requested = getattr(args, "attention_backend", None) or "auto"
    backend = resolve_attention_backend(requested)
    if getattr(args, "use_flash_attn", False) and backend != "sdpa":
        problems.append(f"--use-flash-attn asks for the flash (SDPA) attention but "
                        f"--attention-backend is {requested}; give only one of them")
    args.attention_backend = backend
    args.compile = bool(getattr(args, "compile", False))
