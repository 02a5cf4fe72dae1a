"""Context parallelism's data side: which tokens a rank holds, and the loss over the group.

With context-parallel size ``c`` each sequence of ``s`` tokens is cut into ``2c`` chunks of
``m = s / 2c``; rank ``r`` holds chunks ``r`` and ``2c - 1 - r`` (Megatron-core's and
torchtitan's load-balanced causal order: under a causal mask every rank then has the same
attention work). A rank's tensors are ``[2m, ...]`` along the sequence: chunk ``r`` first.

The token layout
----------------
Under context parallelism (and with document masking at any cp) decoders pass their
attention a *token layout* in place of the ``[1, 1, s, s]`` bool mask: an int64 tensor
``[1 or 2, b, s_local]`` whose row 0 is each local token's position id (the rotary angle's
position; it restarts per document under ``--reset-position-ids``) and whose row 1, present
with ``--reset-attention-mask``, is the index in the full sequence of the first token of the
token's document. A query at global index ``i`` sees key ``j`` iff ``j <= i`` and, with row 1,
``j >= row1[i]``. The layout is ``O(s)`` where the mask was ``O(s^2)``, and every tensor of it
belongs to a token, so it is cut by :func:`split_for_context_parallel` like the tokens.
:func:`is_token_layout` tells the two kinds apart by dtype (a static property: no sync).

The loss
--------
:func:`reduce_loss_over_context_parallel` sums the masked loss and the token count over the
group, so every rank reports the loss of the whole sequence; its backward scales the
gradient by ``c``, because the gradients are then averaged over data x context ranks
(``get_data_parallel_group(with_context_parallel=True)``) where they are a sum over the
context-parallel ranks' parts.
"""
from typing import Optional

import torch
import torch.distributed as dist

from . import parallel_state as ps

#: dtype of a token layout (a bool tensor in the same place is an attention mask).
LAYOUT_DTYPE = torch.int64


def _group_or_default(group):
    return ps.get_context_parallel_group() if group is None else group


def context_parallel_size_and_rank(group=None):
    """``(cp size, cp rank)`` of ``group`` (default: this rank's context-parallel group)."""
    group = _group_or_default(group)
    return dist.get_world_size(group), dist.get_rank(group)


def chunk_ids(cp_rank: int, cp_size: int):
    """The two sequence chunks (of ``2 cp_size``) a rank holds, in its local order."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def load_balanced_indices(seq_length: int, cp_rank: int, cp_size: int,
                          device=None) -> torch.Tensor:
    """Global token indices of a rank's local tokens, in local order (``[s / cp]`` int64).

    Args:
        seq_length: tokens of the whole sequence (divisible by ``2 cp_size``).
        cp_rank, cp_size: the rank and the context-parallel size.
        device: where the indices live.
    """
    if seq_length % (2 * cp_size):
        raise ValueError(f"a sequence of {seq_length} tokens does not cut into 2 x "
                         f"{cp_size} equal chunks (context parallelism); use a multiple of "
                         f"{2 * cp_size}")
    m = seq_length // (2 * cp_size)
    return torch.cat([torch.arange(c * m, (c + 1) * m, device=device)
                      for c in chunk_ids(cp_rank, cp_size)])


def split_for_context_parallel(tensor: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """This rank's two chunks of ``tensor`` along ``dim`` (the whole sequence there), in
    the load-balanced order; ``tensor`` itself without context parallelism.

    Args:
        tensor: every token of the sequence along ``dim`` (e.g. ``[b, s]`` ids, dim 1).
        dim: the sequence dimension.
        group: the context-parallel group (default: this rank's).
    """
    cp, rank = context_parallel_size_and_rank(group)
    if cp == 1:
        return tensor
    dim = dim % tensor.dim()
    s = tensor.shape[dim]
    if s % (2 * cp):
        raise ValueError(f"split_for_context_parallel: {s} tokens along dim {dim} do not cut "
                         f"into 2 x {cp} equal chunks")
    m = s // (2 * cp)
    # two slices and one copy: no index tensor made from host data (no transfer in a step)
    return torch.cat([tensor.narrow(dim, c * m, m) for c in chunk_ids(rank, cp)], dim=dim)


def gather_from_context_parallel(tensor: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """The whole sequence in natural order from each rank's local part (not differentiable:
    tests, generation and evaluation read results with it).

    Args:
        tensor: this rank's ``[..., s / cp, ...]`` (load-balanced order) along ``dim``.
        dim: the sequence dimension.
        group: the context-parallel group (default: this rank's).
    """
    group = _group_or_default(group)
    cp, _ = context_parallel_size_and_rank(group)
    if cp == 1:
        return tensor
    dim = dim % tensor.dim()
    parts = [torch.empty_like(tensor) for _ in range(cp)]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    local = tensor.shape[dim]
    order = torch.cat([load_balanced_indices(local * cp, r, cp, tensor.device)
                       for r in range(cp)])  # global index of each gathered position
    return torch.cat(parts, dim=dim).index_select(dim, torch.argsort(order))


# ---------------------------------------------------------------- the token layout
def is_token_layout(mask: Optional[torch.Tensor]) -> bool:
    """Whether a decoder's mask slot carries a token layout (int64) rather than a bool
    ``[.., s, s]`` mask (see the module docstring)."""
    return mask is not None and mask.dtype == LAYOUT_DTYPE


def document_starts(tokens: torch.Tensor, eod_token: int) -> torch.Tensor:
    """``[b, s]``: for each token the index of the first token of its document (a document
    ends with its end-of-document token, which belongs to it; Megatron's rule).

    Args:
        tokens: ``[b, s]`` input ids.
        eod_token: the end-of-document id.
    """
    b, s = tokens.shape
    idx = torch.arange(s, device=tokens.device).expand(b, s)
    after_eod = torch.where(tokens == eod_token, idx + 1, torch.zeros_like(idx))  # [b, s]
    # a document starts after the last end-of-document token strictly before the token
    starts = torch.cummax(after_eod, dim=1).values
    return torch.cat([torch.zeros_like(starts[:, :1]), starts[:, :-1]], dim=1)


def token_layout(position_ids: torch.Tensor,
                 doc_starts: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The token layout ``[1 or 2, b, s]`` (module docstring) of position ids ``[b, s]`` and,
    for document masking, :func:`document_starts` ``[b, s]``."""
    rows = [position_ids] if doc_starts is None else [position_ids, doc_starts]
    return torch.stack([r.to(LAYOUT_DTYPE) for r in rows])


def layout_positions(layout: torch.Tensor) -> torch.Tensor:
    """The position ids ``[b, s_local]`` of a token layout."""
    return layout[0]


def layout_doc_starts(layout: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The document starts ``[b, s_local]`` of a token layout, or None (causal only)."""
    if layout is None or layout.shape[0] < 2:
        return None
    return layout[1]


def dense_attention_mask(layout: torch.Tensor) -> torch.Tensor:
    """The bool ``[b, 1, s, s]`` mask (True = masked, Megatron's convention) of a whole
    sequence's token layout (cp 1): causal, and within documents when it has them."""
    s = layout.shape[-1]
    idx = torch.arange(s, device=layout.device)
    allowed = idx[None, :] <= idx[:, None]  # [s, s]: key <= query
    doc = layout_doc_starts(layout)
    if doc is None:
        return ~allowed[None, None].expand(layout.shape[1], 1, s, s)
    return ~(allowed[None] & (idx[None, None, :] >= doc[:, :, None]))[:, None]


# ---------------------------------------------------------------- the loss
class _SumOverContextParallel(torch.autograd.Function):
    """Sum over the context-parallel group forward; the gradient times the group size
    backward (the data x context average of the gradients then gives the sum)."""

    @staticmethod
    def forward(ctx, partial, group):
        ctx.cp = dist.get_world_size(group)
        total = partial.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.cp, None


def sum_over_context_parallel(partial: torch.Tensor, group) -> torch.Tensor:
    """``partial`` summed over ``group`` (the ranks sharing each sequence), its gradient
    times the group's size: what a sum over whole sequences needs under the data x context
    gradient average (the loss here, MoE's balancing terms)."""
    return _SumOverContextParallel.apply(partial, group)


def reduce_loss_over_context_parallel(loss_sum: torch.Tensor, count: torch.Tensor,
                                      group=None) -> torch.Tensor:
    """The mean loss of the whole sequences from each rank's part: ``sum(loss_sum) /
    sum(count)`` over the context-parallel group (one all-reduce of two numbers).

    Args:
        loss_sum: this rank's summed (masked) token losses, a scalar.
        count: this rank's counted tokens (the loss mask's sum), a scalar.
        group: the context-parallel group (default: this rank's).
    """
    group = _group_or_default(group)
    if dist.get_world_size(group) == 1:
        return loss_sum / count
    both = _SumOverContextParallel.apply(
        torch.stack([loss_sum.float(), count.float().detach()]), group)  # [2]
    return both[0] / both[1]
