"""Token dispatch: each token's rows to its experts' ranks, the experts' outputs back, and
the top-k outputs combined with their weights (Megatron-core's token dispatchers).

- ``alltoall`` (the default): the rows are sorted by expert and sent with one all-to-all over
  the expert-parallel group, regrouped by local expert, computed, and sent back the same way.
  Dropless, the splits depend on the routing: the per-rank counts are exchanged first
  (an all-to-all of ``ep x E/ep`` numbers) and read once on the host, as Megatron-core does.
- ``allgather``: every rank of the group gathers all its tokens and routings, computes the
  rows that its own experts were chosen for, and a reduce-scatter sums the partial outputs
  back to each token's rank (dropless: the local row count is read once on the host).

With a capacity factor both are static: each expert's rows from each rank sit in a buffer of
``C`` rows (zeros where unused), the all-to-all has equal splits and nothing is read on the
host (the form that compiles whole). At ep 1 dropless with grouped GEMM reads nothing either.
"""
import torch
import torch.distributed as dist

from ..sequence_parallel import (gather_from_sequence_parallel_region,
                                 reduce_scatter_to_sequence_parallel_region)
from .comm import all_to_all, exchange_counts


def _inverse(perm: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(perm.numel(), device=perm.device)
    return inverse


def _regroup_index(counts: torch.Tensor, total: int) -> torch.Tensor:
    """Rows in chunks ``counts [A, B]`` (row-major: a's chunks first) -> the row index that
    puts them in ``(b, a)`` order (b's chunks first), without a host read."""
    flat = counts.flatten()
    starts = (torch.cumsum(flat, 0) - flat).view(counts.shape).t().flatten()
    sizes = counts.t().flatten()
    new_starts = torch.cumsum(sizes, 0) - sizes
    shift = torch.repeat_interleave(starts - new_starts, sizes, output_size=total)
    return shift + torch.arange(total, device=counts.device)


def _combine(rows: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """``rows [T k, h]`` in (token, choice) order -> ``[T, h]`` weighted sum over the k (fp32)."""
    t, k = probs.shape
    return (rows.float().view(t, k, -1) * probs.unsqueeze(-1)).sum(1)


def _size(group):
    return 1 if group is None else dist.get_world_size(group)


def alltoall_dropless(x, routing, experts, num_experts, group):
    """``x [T, h]`` -> ``[T, h]`` through the all-to-all dispatcher, no capacity."""
    t, k = routing.indices.shape
    ep = _size(group)
    flat = routing.indices.reshape(-1)  # [T k] in (token, choice) order
    order = torch.argsort(flat, stable=True)  # rows by expert, then token
    rows = x.index_select(0, order // k)  # [T k, h]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=x.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    if ep == 1:
        out = experts(rows, counts)
    else:
        send = counts.view(ep, -1)  # [ep, E/ep]: rows for each rank's experts
        recv = exchange_counts(send, group)  # [ep, E/ep]: rows from each rank
        host = torch.cat([send.sum(1), recv.sum(1), recv.sum(0)]).tolist()  # one host read
        sent, got, per_expert = host[:ep], host[ep:2 * ep], host[2 * ep:]
        received = all_to_all(rows, got, sent, group)  # [N, h] by (source, expert)
        regroup = _regroup_index(recv, sum(got))
        y = experts(received.index_select(0, regroup), recv.sum(0), per_expert)
        out = all_to_all(y.index_select(0, _inverse(regroup)), sent, got, group)
    return _combine(out.index_select(0, _inverse(order)), routing.probs)


def alltoall_capacity(x, routing, experts, num_experts, group):
    """The all-to-all dispatcher with capacity: ``[E, C, h]`` buffers, equal splits."""
    t, k = routing.indices.shape
    ep, c, h = _size(group), routing.capacity, x.shape[1]
    local = num_experts // ep
    slot = torch.where(routing.slots >= 0, routing.indices * c + routing.slots,
                       torch.full_like(routing.slots, num_experts * c)).reshape(-1)
    buffer = x.new_zeros(num_experts * c + 1, h).index_copy(
        0, slot, x.repeat_interleave(k, 0))[:-1]  # [E C, h]; the last row took the drops
    received = all_to_all(buffer, None, None, group).view(ep, local, c, h)
    y = experts.forward_padded(received.transpose(0, 1).reshape(local, ep * c, h))
    y = y.view(local, ep, c, h).transpose(0, 1).reshape(num_experts * c, h)
    back = all_to_all(y, None, None, group)  # [E C, h]
    back = torch.cat([back, back.new_zeros(1, h)])  # dropped choices read the zero row
    return _combine(back.index_select(0, slot), routing.probs)


def _gather_ids(t: torch.Tensor, group) -> torch.Tensor:
    out = t.new_empty((_size(group) * t.shape[0],) + tuple(t.shape[1:]))
    dist.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out


def _gathered(x, routing, group):
    """All ranks' tokens, weights (differentiable) and choices, when ep > 1."""
    if _size(group) == 1:
        return x, routing.probs, routing.indices, routing.slots
    xs = gather_from_sequence_parallel_region(x, True, group)
    probs = gather_from_sequence_parallel_region(routing.probs, True, group)
    slots = None if routing.slots is None else _gather_ids(routing.slots, group)
    return xs, probs, _gather_ids(routing.indices, group), slots


def _scatter_back(out, group):
    if _size(group) == 1:
        return out
    return reduce_scatter_to_sequence_parallel_region(out, group)


def allgather_dropless(x, routing, experts, num_experts, group):
    """``x [T, h]`` -> ``[T, h]`` through the all-gather dispatcher, no capacity."""
    ep, rank = _size(group), (0 if group is None else dist.get_rank(group))
    local = num_experts // ep
    xs, probs, indices, _ = _gathered(x, routing, group)  # [ep T, h], [ep T, k]
    k = indices.shape[1]
    mine = indices - rank * local
    flat = torch.where((mine >= 0) & (mine < local), mine,
                       torch.full_like(mine, local)).reshape(-1)  # `local`: another rank's
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(local + 1, dtype=torch.int64, device=x.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    host = counts.tolist()  # one host read: how many rows are this rank's
    n = sum(host[:local])
    token = (order // k)[:n]
    y = experts(xs.index_select(0, token), counts[:local], host[:local])
    weight = probs.reshape(-1).index_select(0, order[:n]).unsqueeze(-1)
    partial = torch.zeros(xs.shape, dtype=torch.float32, device=x.device)
    partial = partial.index_add(0, token, y.float() * weight)  # [ep T, h], own experts only
    return _scatter_back(partial, group)


def allgather_capacity(x, routing, experts, num_experts, group):
    """The all-gather dispatcher with capacity: ``[E/ep, ep C, h]`` buffers, no host read."""
    ep, rank = _size(group), (0 if group is None else dist.get_rank(group))
    local, c, h = num_experts // ep, routing.capacity, x.shape[1]
    xs, probs, indices, slots = _gathered(x, routing, group)
    k, t = indices.shape[1], x.shape[0]
    source = (torch.arange(xs.shape[0], device=x.device) // t).unsqueeze(1)  # [ep T, 1]
    mine = indices - rank * local
    use = (mine >= 0) & (mine < local) & (slots >= 0)
    slot = torch.where(use, mine * (ep * c) + source * c + slots,
                       torch.full_like(slots, local * ep * c)).reshape(-1)
    buffer = xs.new_zeros(local * ep * c + 1, h).index_copy(
        0, slot, xs.repeat_interleave(k, 0))[:-1]
    y = experts.forward_padded(buffer.view(local, ep * c, h)).reshape(local * ep * c, h)
    y = torch.cat([y, y.new_zeros(1, h)])
    return _scatter_back(_combine(y.index_select(0, slot), probs), group)


DISPATCH = {("alltoall", False): alltoall_dropless, ("alltoall", True): alltoall_capacity,
            ("allgather", False): allgather_dropless, ("allgather", True): allgather_capacity}
