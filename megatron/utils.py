"""Small helpers used across the training code: rank-aware printing, agreeing on errors."""
import sys

import torch
import torch.distributed as dist


def print_rank_0(message):
    """Print on global rank 0 only (or always, before torch.distributed starts)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, flush=True)


def print_rank_last(message):
    """Print on the last rank (it holds the loss when the last pipeline stage is there)."""
    if not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1:
        print(message, flush=True)


def warn_rank_0(message):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"WARNING: {message}", file=sys.stderr, flush=True)


def raise_if_any_rank_failed(error, error_type=RuntimeError, group=None):
    """Collective: every rank raises if any rank had an error (so none waits forever).

    Args:
        error: this rank's exception (or message) or None.
        error_type: the type to raise on ranks that did not fail themselves.
        group: process group (default: world).

    Raises:
        this rank's own error, or ``error_type`` naming the first failing rank.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error if isinstance(error, BaseException) else error_type(error)
        return
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    world = dist.get_world_size(group)
    # Lowest failing rank wins: encode as world - rank so MAX picks it.
    flag = torch.tensor([world - dist.get_rank(group) if error is not None else 0],
                        device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error if isinstance(error, BaseException) else error_type(error)
    if flag.item():
        raise error_type(f"rank {world - int(flag.item())} failed (see its message above)")


def unwrap_model(model):
    """The module inside DDP / DeepSpeed / Float16 wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model
