"""The flag groups (see megatron/config/parser.py for how they are parsed and checked).

Each ``add_*`` function adds one group. First spelling = CPM-Pretrain's, later ones =
Megatron-LM v2 aliases. ``None`` defaults are filled in by validation (derived values).
"""
from .recompute import add_recompute_flags
from .run_config import PIPELINE_SCHEDULES


def _bool_pair(group, name, default, help):
    """``--name`` / ``--no-name`` for a boolean, dest ``name`` with dashes as underscores."""
    dest = name.replace("-", "_")
    group.add_argument(f"--{name}", dest=dest, action="store_true", help=help)
    group.add_argument(f"--no-{name}", dest=dest, action="store_false",
                       help=f"opposite of --{name}")
    group.set_defaults(**{dest: default})


def add_model_args(parser):
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None, help="transformer layers")
    g.add_argument("--hidden-size", type=int, default=None, help="model width h")
    g.add_argument("--num-attention-heads", type=int, default=None, help="attention heads")
    g.add_argument("--kv-hidden-size", "--kv-channels", dest="kv_channels", type=int,
                   default=None, help="per-head size (default hidden/heads)")
    g.add_argument("--ff-hidden-size", "--ffn-hidden-size", dest="ffn_hidden_size", type=int,
                   default=None, help="feed-forward width (default 4 x hidden)")
    g.add_argument("--seq-length", type=int, default=None, help="tokens per sample")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="learned positions (default seq-length)")
    _bool_pair(g, "hidden-bias", True, "biases in the linear layers (GPT-2 has them)")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x tensor-parallel size")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each block of layers in backward")
    g.add_argument("--checkpoint-num-layers", type=int, default=1,
                   help="layers per recomputed block")
    add_recompute_flags(g)
    g.add_argument("--eod-mask-loss", action="store_true", help="no loss on end-of-document tokens")
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="decoders: a token attends only within its own document (documents end "
                        "at the end-of-document token; Megatron-LM's flag)")
    g.add_argument("--reset-position-ids", action="store_true",
                   help="decoders: positions restart at 0 after each end-of-document token")


def add_parallel_args(parser):
    g = parser.add_argument_group("parallelism")
    g.add_argument("--model-parallel-size", "--tensor-model-parallel-size",
                   dest="tensor_model_parallel_size", type=int, default=1)
    g.add_argument("--pipe-parallel-size", "--pipeline-model-parallel-size",
                   dest="pipeline_model_parallel_size", type=int, default=1,
                   help="pipeline stages; 0 and 1 both mean no pipeline")
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="model chunks per pipeline rank (interleaved 1F1B; rank r holds "
                        "chunks r, r+p, ...; needs pp >= 2; docs/pipeline_schedules.md)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="layers per model chunk; derives --virtual-pipeline-model-parallel-size")
    g.add_argument("--pipeline-schedule", choices=list(PIPELINE_SCHEDULES),
                   default=None,
                   help="pipeline schedule (pp >= 2): 1f1b (default), interleaved (implied by "
                        "--virtual-pipeline-model-parallel-size > 1), zb-h1 or zbv (zero "
                        "bubble: the backward split into input and weight passes; zbv places "
                        "2 chunks per rank in a V); docs/pipeline_schedules.md")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None,
                   help="default: nccl with GPUs, gloo without")
    g.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                   help="set by launchers")
    g.add_argument("--deepspeed", action="store_true", help="data parallelism with DeepSpeed")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config",
                   default=None, help="DeepSpeed JSON config")
    g.add_argument("--zero-stage", type=int, default=None,
                   help="ZeRO stage (overrides the JSON config's zero_optimization.stage): "
                        "with --deepspeed DeepSpeed's (0-2); otherwise 1 means "
                        "--use-distributed-optimizer")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the fp32 master weights' Adam states over the data-parallel "
                        "(x context) ranks: gradients reduce-scattered, parameters "
                        "all-gathered (Megatron-LM's; ZeRO stage 1); docs/training.md")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="reduce each gradient bucket as the last micro-batch's backward "
                        "completes it, overlapping the backward")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer: all-gather the updated parameters "
                        "asynchronously, each bucket waited for at its first use")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient bucket (default: max(40M, 1M x dp) with "
                        "--overlap-grad-reduce, else one bucket)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split LayerNorm/dropout activations along the sequence across the "
                        "tensor-parallel ranks (Megatron-LM's; needs tp > 1; "
                        "docs/scale_out.md)")
    g.add_argument("--context-parallel-size", type=int, default=1,
                   help="ranks that split each sequence (context parallelism, Megatron-core's "
                        "flag): each holds 2 of 2 x this many chunks in a load-balanced causal "
                        "order; world = tp x cp x pp x dp; docs/scale_out.md")
    g.add_argument("--cp-comm-type", choices=["p2p", "all_gather", "a2a"], default="p2p",
                   help="how context-parallel attention sees the other ranks' keys and values: "
                        "p2p (a ring, overlapped with attention), all_gather, or a2a "
                        "(all-to-all of the heads, Ulysses; heads / tp divisible by cp)")


def add_training_args(parser):
    g = parser.add_argument_group("training")
    g.add_argument("--batch-size", "--micro-batch-size", dest="micro_batch_size", type=int,
                   default=None, help="samples per micro-batch per data-parallel rank")
    g.add_argument("--gas", "--gradient-accumulation-steps", dest="gas", type=int, default=None,
                   help="micro-batches per step (default 1, or from --global-batch-size)")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="batch-size x gas x data-parallel size")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--lr", type=float, default=None, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: train-iters")
    g.add_argument("--use-checkpoint-lr-scheduler", "--use-checkpoint-opt_param-scheduler",
                   dest="use_checkpoint_lr_scheduler", action="store_true",
                   help="on resume, keep the checkpoint's learning-rate schedule (peak, min, "
                        "warmup, decay length and style) instead of the flags' (by default "
                        "the flags' wins, and a change is printed with the new rate)")
    g.add_argument("--warmup", "--lr-warmup", dest="warmup", type=float, default=0.01,
                   help="warmup: a fraction of lr-decay-iters if < 1, else iterations")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--skip-nonfinite-steps", action="store_true",
                   help="fp32/bf16: skip the update of a step whose gradient norm is inf/nan "
                        "(counted as a skipped iteration) instead of stopping the run")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--fp16", action="store_true", help="fp16 compute, fp32 master weights")
    g.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 master weights")
    g.add_argument("--fp8-format", choices=["e4m3", "hybrid"], default=None,
                   help="with --bf16: the transformer layers' linear GEMMs in float8 (e4m3; "
                        "hybrid: their gradients e5m2); embedding, output layer, norms and "
                        "loss stay bf16 (Megatron-LM's flag; docs/training.md, FP8)")
    g.add_argument("--fp8-recipe", choices=["tensorwise", "rowwise"], default=None,
                   help="FP8 scaling: one scale per tensor (default) or per row, both from "
                        "the current amax (nothing to save in a checkpoint)")
    g.add_argument("--loss-scale", type=float, default=0.0,
                   help="static loss scale; 0 = dynamic (fp16 only)")
    g.add_argument("--initial-scale-power", type=int, default=16,
                   help="dynamic scale starts at 2^this")
    g.add_argument("--loss-scale-window", type=int, default=1000,
                   help="steps without overflow before the scale doubles")
    g.add_argument("--hysteresis", type=int, default=2,
                   help="overflows tolerated before the scale is lowered")
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving) when iteration %% this == 0")


def add_data_args(parser):
    g = parser.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None,
                   help="prefix, or weight prefix weight prefix ... for blending")
    g.add_argument("--data-impl", choices=["mmap", "lazy", "cached", "infer"], default="mmap",
                   help="accepted for Megatron compatibility: the format (mmap, or the older "
                        "lazy/cached TNTIDX, read-only) is read from each file")
    g.add_argument("--split", default="949,50,1", help="train,valid,test proportions")
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--tokenizer-type", default=None,
                   choices=["GPT2BPETokenizer", "SentencePieceTokenizer", "CharTokenizer"])
    g.add_argument("--tokenizer-model", default=None, help="sentencepiece .model file")
    g.add_argument("--vocab-extra-ids", type=int, default=100, help="T5 sentinel tokens")
    g.add_argument("--num-workers", type=int, default=0, help="DataLoader workers")
    g.add_argument("--prefetch-batches", type=int, default=2,
                   help="batches read ahead on a background thread (0: read on the "
                        "training thread)")


def add_checkpoint_args(parser):
    g = parser.add_argument_group("checkpointing")
    g.add_argument("--save", default=None, help="checkpoint directory to write")
    g.add_argument("--load", default=None, help="checkpoint directory to resume from")
    g.add_argument("--load-if-exists", action="store_true",
                   help="start from scratch when --load does not exist (otherwise an error, "
                        "unless --load is the --save folder)")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-load-optim", action="store_true", help="load weights only")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-verify-checkpoint", action="store_true",
                   help="load checkpoint files without checking them against the digests in "
                        "their manifest (docs/fault_tolerance.md)")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load weights only and start at iteration 0")


def add_fault_tolerance_args(parser):
    g = parser.add_argument_group("fault tolerance (docs/fault_tolerance.md)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM or SIGUSR1 (Slurm's --signal=USR1@120) to any rank, every "
                        "rank saves at the next step boundary and the run exits 0")
    g.add_argument("--exit-signal-check-interval", type=int, default=1,
                   help="steps between the ranks' agreements on a received signal (one "
                        "host-side all-reduce of one integer each time)")
    g.add_argument("--async-save", action="store_true",
                   help="snapshot each checkpoint to host memory and write it on a background "
                        "thread while training goes on")
    g.add_argument("--step-timeout", type=float, default=None,
                   help="seconds without a finished step before a watchdog prints the stuck "
                        "rank's stack and ends it (non-zero); off by default")
    g.add_argument("--startup-timeout", type=float, default=None,
                   help="seconds from start-up to the end of the first step (default: 10 x "
                        "--step-timeout, at least 300, plus the --load checkpoint's size at "
                        "100 MB/s and 600 with --compile)")
    g.add_argument("--save-timeout", type=float, default=None,
                   help="seconds a checkpoint save may take (default: 10 x --step-timeout, at "
                        "least 300)")


def add_logging_args(parser):
    g = parser.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--tensorboard-dir", default=None)
    g.add_argument("--wandb-project", default=None,
                   help="log the TensorBoard scalars to this Weights & Biases project too "
                        "(pip install 'megatron-tds[wandb]'; WANDB_MODE=offline for no network)")
    g.add_argument("--wandb-exp-name", default=None, help="W&B run name (default: W&B's)")
    g.add_argument("--wandb-save-dir", default=None,
                   help="folder for W&B's local run files (default: <--save>/wandb)")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="per-device peak for MFU (default: looked up from the GPU name)")
    g.add_argument("--config", default=None, help="YAML file of defaults (see configs/)")
    g.add_argument("--no-memory-check", dest="memory_check", action="store_false",
                   help="warn instead of refusing a GPU run the memory model predicts will "
                        "not fit (docs/memory.md)")


def add_kernel_args(parser):
    try:
        from ..fused_kernels import add_fused_kernel_args
    except ImportError:
        g = parser.add_argument_group("fused kernels")
        _bool_pair(g, "masked-softmax-fusion", True, "fused scale+mask+softmax kernel")
        return
    add_fused_kernel_args(parser)


def add_speed_args(parser):
    from .speed_flags import add_speed_args as add

    return add(parser)


def add_moe_args(parser):
    from .moe import add_moe_args as add

    return add(parser)


ADD_GROUPS = (add_model_args, add_parallel_args, add_training_args, add_data_args,
              add_checkpoint_args, add_fault_tolerance_args, add_logging_args, add_kernel_args,
              add_speed_args, add_moe_args)
