"""Small helpers used across the training code: rank-aware printing, unwrapping models
(agreeing on errors is :mod:`megatron.resilience.agreement`)."""
import sys
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:  # megatron.config sits above this module
    from ..config.run_config import RunConfig


def print_rank_0(message):
    """Print on global rank 0 only (or always, before torch.distributed starts)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def print_rank_last(message):
    """Print on the last rank (it holds the loss when the last pipeline stage is there)."""
    if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
        print(message, flush=True)


def print_node_first(cfg: "RunConfig", message):
    """Print on each node's first process (local rank 0: global rank 0 on node 0), where a
    person watches the node's terminal (or always, before torch.distributed starts).

    Args:
        cfg: the run configuration (``cfg.parallel.local_rank``).
        message: the line(s).
    """
    if not dist.is_initialized() or cfg.parallel.local_rank == 0:
        print(message, flush=True)


def warn_rank_0(message):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"WARNING: {message}", file=sys.stderr, flush=True)


def unwrap_model(model):
    """The module inside DDP / DeepSpeed / Float16 wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model
