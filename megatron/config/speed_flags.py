"""Flags that choose how fast the step runs, not what it computes (docs/training.md).

    --attention-backend {auto,flash,fused,sdpa,unfused,local}   Megatron-LM's spellings
    --use-flash-attn                                            Megatron-LM's older flag
    --compile                   each pipeline chunk (pp 1: the model and its loss) compiled
    --cuda-graphs               with --compile: CUDA graphs over each compiled region

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
                   help="torch.compile each pipeline chunk as one region, its loss included "
                        "(pp 1: the whole model; docs/training.md, Compiling)")
    g.add_argument("--cuda-graphs", action="store_true",
                   help="with --compile: replay each compiled region as a CUDA graph "
                        "(torch.compile mode reduce-overhead), for steps the host cannot keep "
                        "up with; needs a CUDA device, pp 1 and the DDP path (no --deepspeed)")
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
    args.cuda_graphs = bool(getattr(args, "cuda_graphs", False))
    if args.cuda_graphs:
        _check_cuda_graphs(args, problems)


def _check_cuda_graphs(args, problems):
    """Where CUDA graphs are refused, and why (the graphs replay fixed memory: whatever runs
    between regions must not depend on host decisions or on memory a replay overwrites)."""
    import torch

    if not args.compile:
        problems.append("--cuda-graphs replays the regions --compile builds: add --compile")
    if not torch.cuda.is_available():
        problems.append("--cuda-graphs needs a CUDA device (none here); drop it on a CPU")
    if (getattr(args, "pipeline_model_parallel_size", 1) or 1) > 1:
        problems.append("--cuda-graphs is not supported with pipeline parallelism (the "
                        "sends, receives and deferred weight passes between the chunks' "
                        "regions run outside any graph); drop it or use pp 1")
    if getattr(args, "deepspeed", False):
        problems.append("--cuda-graphs is not supported with --deepspeed (its engine's "
                        "hooks run between the regions); use the DDP path")
