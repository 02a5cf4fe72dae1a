"""initialize_megatron(): flags, torch.distributed, mpu groups, seeds, kernels, tokenizer."""
import atexit
import os
import random
import socket
from datetime import timedelta
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from . import mpu
from .resilience.agreement import gather_failures, summary
from .config import build_run_config
from .config.parser import RankFileProblems
from .config.run_config import RunConfig
from .common.errors import ConfigError
from .common.global_vars import reset_globals, set_globals
from .observability.metrics_writers import build_metrics_writer
from .observability.startup_times import StartupTimes
from .common.timers import Timers
from .common.utils import print_rank_0

#: Seconds a collective may wait before torch.distributed gives up (so a hang ends).
DIST_TIMEOUT_S = int(os.environ.get("MEGATRON_DIST_TIMEOUT", "1800"))


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(cfg: RunConfig):
    """Start torch.distributed (env:// rendezvous, as torchrun and deepspeed set it up).

    The only place the default process group is created; a DeepSpeed backend attaches its
    communication layer to it later (megatron/training/backend_engine.py). A single process
    started without a launcher gets a local rendezvous of its own. Does nothing if the
    default group already exists (tests, DeepSpeed launcher). A group created here is
    destroyed at exit (:func:`destroy_distributed`).
    """
    if cfg.parallel.dist_backend == "nccl":
        torch.cuda.set_device(cfg.parallel.local_rank % torch.cuda.device_count())
    if dist.is_initialized():
        if dist.get_world_size() != cfg.parallel.world:
            raise RuntimeError(f"torch.distributed has {dist.get_world_size()} ranks but "
                               f"WORLD_SIZE says {cfg.parallel.world}")
    else:
        if cfg.parallel.world == 1 and "MASTER_ADDR" not in os.environ:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
        dist.init_process_group(backend=cfg.parallel.dist_backend, rank=cfg.parallel.rank,
                                world_size=cfg.parallel.world,
                                timeout=timedelta(seconds=DIST_TIMEOUT_S))
        atexit.register(destroy_distributed)


def destroy_distributed():
    """Destroy every process group this process made, while the interpreter is whole.

    Registered (``atexit``) by :func:`init_distributed` when it creates the default group:
    the creator tears it down. Left to interpreter finalization instead, gloo's worker
    threads can still hold finished work whose tensors keep Python references; destroying
    them while the interpreter is being torn down aborts the process ("terminate called
    without an active exception", SIGABRT) after a run that succeeded, in about one run in
    thirty at tp=2 on CPU. ``atexit`` runs after the entry script returned or raised and
    every non-daemon thread ended, before finalization.
    """
    if not dist.is_initialized():
        return
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    dist.destroy_process_group()


def set_random_seed(seed):
    """Seed Python, NumPy and torch; pipeline stages get different streams (Megatron's rule),
    and so do the ranks of a context-parallel group (they hold different tokens of the same
    samples: one stream would repeat each dropout mask in every chunk).

    Weight initialisation does not depend on this: layers are built under per-layer seeds
    derived from ``--seed`` (megatron.model.utils.init_rng), whatever the layout.
    """
    seed = seed + 100 * mpu.get_pipeline_model_parallel_rank() \
        + 1_000_003 * mpu.get_context_parallel_rank()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    mpu.model_parallel_cuda_manual_seed(seed)


def _load_kernels(cfg: RunConfig):
    try:
        from . import fused_kernels
    except ImportError:
        return
    fused_kernels.force_fallback(None)  # a previous run's agreement in this process
    status = fused_kernels.load(cfg.kernels)
    # kernels on some ranks only would give the replicas different arithmetic: agree
    failures = gather_failures(status.build_failure or None)
    if failures and not status.build_failure:
        fused_kernels.force_fallback(summary("building the fused kernels", failures))
        status = fused_kernels.load(cfg.kernels)
    if status:
        print_rank_0(f"> fused kernels: {status}")


def _tensorboard_writer(cfg: RunConfig):
    if not cfg.logging.tensorboard_dir or cfg.parallel.rank != cfg.parallel.world - 1:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("WARNING: --tensorboard-dir given but tensorboard is not installed "
              "(pip install tensorboard); not writing TensorBoard logs", flush=True)
        return None
    return SummaryWriter(log_dir=cfg.logging.tensorboard_dir, max_queue=1000)


def _agree_on_files(own):
    """Collective: every rank's verdict on the run's files (``own``: this rank's
    :class:`RankFileProblems`, or None). The same problems on every rank raise the usual
    message everywhere; problems some ranks alone have raise one naming the ranks."""
    failures = gather_failures("; ".join(own.problems) if own is not None else None)
    if not failures:
        return
    if own is not None and len(failures) == dist.get_world_size() and \
            len({cause for _, cause in failures}) == 1:
        raise ConfigError(str(own)) from None  # every rank's verdict: as a flag problem
    raise ConfigError(summary("checking the run's files", failures)) from own


def initialize_megatron(extra_args_provider=None, args_defaults=None, argv=None,
                        family=None):
    """Build the run configuration, then set up distributed state, seeds, kernels.

    The configuration (flags, YAML, every check, the tokenizer) is built first, on every
    rank, before any process group exists: a bad flag fails everywhere at once instead of
    leaving ranks waiting for each other. A file that only some ranks cannot see (a mount
    lost on one node: :class:`~megatron.config.parser.RankFileProblems`) is agreed on right
    after torch.distributed starts, with one collective every run takes: every rank raises
    the same :class:`ConfigError`, naming the ranks and the files.

    Args:
        extra_args_provider: adds a user model's flags to the parser.
        args_defaults: defaults set by the entry script.
        argv: flags (default: ``sys.argv[1:]``).
        family: model family (``gpt2``, ``t5``) whose flags and checks join the pass.

    Returns:
        The frozen run configuration (also available as ``megatron.get_args()``).
    """
    reset_globals()
    startup = StartupTimes()
    own = None
    try:
        cfg, tokenizer = build_run_config(argv, family, extra_args_provider, args_defaults)
    except RankFileProblems as exc:  # this rank's verdict on the files: agreed below
        cfg, tokenizer, own = SimpleNamespace(parallel=exc.parallel), None, exc
    init_distributed(cfg)
    _agree_on_files(own)  # before any other collective
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp,
                                  context_parallel_size=cfg.parallel.cp,
                                  expert_model_parallel_size=cfg.parallel.ep)
    set_random_seed(cfg.model.seed)
    with startup.phase("fused kernels"):
        _load_kernels(cfg)
    set_globals(args=cfg, tokenizer=tokenizer, timers=Timers(), startup_times=startup,
                tensorboard_writer=build_metrics_writer(cfg, _tensorboard_writer(cfg)))
    cp = f" x cp {cfg.parallel.cp}" if cfg.parallel.cp > 1 else ""
    if cfg.parallel.ep > 1:
        cp += f" (ep {cfg.parallel.ep} of dp x cp)"
    fp8 = cfg.precision.fp8
    print_rank_0(f"> initialized: world {cfg.parallel.world} = tp {cfg.parallel.tp}{cp}"
                 f" x pp {cfg.parallel.pp} x dp {cfg.parallel.dp}, "
                 f"backend {cfg.parallel.dist_backend}, compute dtype {cfg.precision.name}"
                 + (f", {fp8.describe()} in the transformer layers' linears" if fp8 else ""))
    if fp8 is not None and mpu.get_device().type == "cpu":
        print_rank_0("> FP8 on the CPU: torch._scaled_mm computes the float8 GEMMs in "
                     "software here, for their numerics, not for speed")
    return cfg
