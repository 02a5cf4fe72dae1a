"""Contiguous gradient buffers in buckets, reduced over the data-parallel group.

Megatron-LM's ``ParamAndGradBuffer``: the parameters that reduce over one group (the data x
context group, or the expert-data-parallel group for experts) get one flat fp32 gradient
buffer each; every parameter's ``.grad`` is a view into it, so autograd's accumulation (and
the zero-bubble weight pass's, :func:`megatron.mpu.weight_grad.accumulate_grad`) writes
there in place, and a step zeroes one tensor. The buffer is cut into buckets of about
``bucket_size`` elements in the order the backward produces the gradients (the parameters'
reverse order); a bucket is reduced with one collective:

- replicated optimizer: an all-reduce of the bucket (the average over the group);
- distributed optimizer (``shard=True``): a reduce-scatter, rank ``r`` keeping the ``r``-th
  of ``group size`` equal slices of each bucket (the bucket is padded to a multiple of the
  group size), and, after the optimizer stepped the slices, an all-gather of the updated
  parameters, which then live in a flat parameter buffer of the same layout (each
  parameter's ``.data`` a view into it).

Parameters reduced after the others get buckets of their own (``late``): a tied weight
alone (its slices must line up on both of its stages), the sequence-parallel ones together
(their tensor-parallel sum comes first). Collectives are launched with
``async_op=True``; :meth:`GradBuffer.finish` waits for them.
"""
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

DEFAULT_BUCKET_SIZE = 40_000_000
"""Elements per bucket (Megatron-LM's default ``--ddp-bucket-size`` is max(40M, 1M x dp))."""


@dataclass
class Bucket:
    """A slice ``[start, end)`` of a :class:`GradBuffer` reduced by one collective.

    Attributes:
        params: the parameters whose gradients lie in the slice, in buffer order.
        late: reduce it in :meth:`GradBuffer.finish` only, never from the backward's hooks
            (a tied or sequence-parallel weight whose gradient is completed after the
            backward: over the embedding group, or over tp).
    """

    index: int
    start: int
    end: int
    params: List[torch.nn.Parameter]
    late: bool = False
    ready: set = field(default_factory=set)
    work: Optional[object] = None
    gather: Optional[object] = None

    @property
    def numel(self) -> int:
        return self.end - self.start


class GradBuffer:
    """One flat gradient buffer (and, sharded, one flat parameter buffer) over ``params``.

    Args:
        params: parameters reduced over ``group`` (fp32 masters, all of one dtype and device).
        group: the process group the gradients are averaged over.
        shard: reduce-scatter the buckets and all-gather the parameters (distributed
            optimizer) instead of all-reducing.
        bucket_size: elements per bucket (None: one bucket).
        late: ``f(param) -> None`` (an ordinary parameter) or a key: the parameters of one
            key share a bucket of their own, reduced late (see :class:`Bucket`).
        average_over: the number of replicas the sum over ``group`` is divided by (default:
            the group's size; experts: the data x context size, whose tokens reached them).
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], group, shard: bool,
                 bucket_size: Optional[int], late: Callable = lambda p: None,
                 average_over: Optional[int] = None):
        self.group = group
        self.size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.average_over = average_over or self.size
        self.shard = shard
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise ValueError(f"GradBuffer: one dtype per buffer, got {sorted(map(str, dtypes))}")
        self.dtype, self.device = params[0].dtype, params[0].device
        self.buckets: List[Bucket] = []
        self.index = {}  # param -> (start, end) in the buffer
        self._layout(list(reversed(params)), bucket_size, late)
        total = self.buckets[-1].end if self.buckets else 0
        self.grad_data = torch.zeros(total, dtype=self.dtype, device=self.device)
        self.param_data = torch.zeros(total, dtype=self.dtype, device=self.device) \
            if shard else None
        for param, (start, end) in self.index.items():
            if self.param_data is not None:  # the parameter now lives in the flat buffer
                view = self.param_data[start:end].view_as(param)
                view.copy_(param.data)
                param.data = view
            param.grad = self.grad_data[start:end].view_as(param)
        self.bucket_of = {param: b for b in self.buckets for param in b.params}

    def _layout(self, params, bucket_size, late):
        """Buckets of about ``bucket_size`` elements, in the order given, then one late
        bucket per key of ``late``; each bucket padded to a multiple of the group size when
        sharded (every rank's slice of it equally long)."""
        offset, current, current_numel = 0, [], 0
        late_groups = {}

        def close(members, late=False):
            nonlocal offset
            start, numel = offset, sum(p.numel() for p in members)
            for p in members:
                self.index[p] = (offset, offset + p.numel())
                offset += p.numel()
            if self.shard:
                numel = -(-numel // self.size) * self.size
            offset = start + numel
            self.buckets.append(Bucket(len(self.buckets), start, offset, list(members), late))

        for param in params:
            key = late(param)
            if key is not None:
                late_groups.setdefault(key, []).append(param)
                continue
            current.append(param)
            current_numel += param.numel()
            if bucket_size is not None and current_numel >= bucket_size:
                close(current)
                current, current_numel = [], 0
        if current:
            close(current)
        for members in late_groups.values():
            close(members, late=True)

    # ------------------------------------------------------------ shards
    def shard_range(self, bucket: Bucket):
        """``[start, end)`` in the buffer of this rank's slice of ``bucket``."""
        if not self.shard:
            return bucket.start, bucket.end
        step = bucket.numel // self.size
        return bucket.start + self.rank * step, bucket.start + (self.rank + 1) * step

    def shard_pieces(self):
        """``(param, param_offset, buffer_start, buffer_end)`` for each part of a parameter
        that falls in this rank's slices (every parameter whole when not sharded)."""
        pieces = []
        for bucket in self.buckets:
            low, high = self.shard_range(bucket)
            for param in bucket.params:
                start, end = self.index[param]
                a, b = max(start, low), min(end, high)
                if a < b:
                    pieces.append((param, a - start, a, b))
        return pieces

    # ------------------------------------------------------------ gradients
    def zero(self) -> None:
        self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.ready.clear()
            bucket.work = None

    def mark_ready(self, param) -> None:
        """The backward finished ``param``'s gradient of the step: launch its bucket's
        reduction once every parameter of the bucket is done (a late bucket waits)."""
        bucket = self.bucket_of[param]
        if bucket.work is not None:
            raise RuntimeError(
                f"--overlap-grad-reduce: a {tuple(param.shape)} parameter received a gradient "
                f"after its bucket's reduction started (it is used twice in one backward, "
                f"e.g. through reentrant activation recompute); drop --overlap-grad-reduce")
        bucket.ready.add(param)
        if not bucket.late and len(bucket.ready) == len(bucket.params):
            self.start_reduce(bucket)

    def start_reduce(self, bucket: Bucket) -> None:
        """Launch the bucket's average over the group (asynchronously)."""
        if bucket.work is not None:
            return
        grads = self.grad_data[bucket.start:bucket.end]
        if self.average_over != 1:
            grads.div_(self.average_over)
        if self.size == 1:
            bucket.work = _Done()
            return
        if self.shard:
            low, high = self.shard_range(bucket)
            bucket.work = _reduce_scatter(self.grad_data[low:high], grads, group=self.group,
                                          async_op=True)
        else:
            bucket.work = dist.all_reduce(grads, group=self.group, async_op=True)

    def finish(self, before_late: Callable = lambda buckets: None) -> None:
        """Launch every bucket not launched yet and wait for all of them.

        Args:
            before_late: called with the late buckets before they are launched (the tp sum
                of sequence-parallel gradients goes there).
        """
        late = [b for b in self.buckets if b.late and b.work is None]
        for bucket in self.buckets:
            if not bucket.late:
                self.start_reduce(bucket)
        before_late(late)
        for bucket in late:
            self.start_reduce(bucket)
        for bucket in self.buckets:
            bucket.work.wait()

    # ------------------------------------------------------------ parameters (sharded)
    def start_param_gather(self) -> None:
        """All-gather every bucket's updated slices into the parameter buffer (async)."""
        if not self.shard or self.size == 1:
            return
        for bucket in self.buckets:
            low, high = self.shard_range(bucket)
            bucket.gather = _all_gather(self.param_data[bucket.start:bucket.end],
                                        self.param_data[low:high], group=self.group,
                                        async_op=True)

    def finish_param_gather(self, bucket: Optional[Bucket] = None) -> None:
        """Wait for the parameter all-gather of ``bucket`` (None: of every bucket)."""
        for b in [bucket] if bucket is not None else self.buckets:
            if b.gather is not None:
                b.gather.wait()
                b.gather = None


class _Done:
    """The work of a collective over one rank: nothing to wait for."""

    @staticmethod
    def wait():
        return True
