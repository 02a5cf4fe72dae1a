"""Typed point-to-point transfers across a pipeline boundary, optionally split across tp.

A position marked ``partitioned`` travels as 1/tp of its flattened elements from each
tensor-parallel rank to the same tp rank of the neighbour stage, which all-gathers the
pieces inside its tensor-parallel group: the inter-stage volume drops by the tp size and
the (fast, intra-node) all-gather restores the full tensor.
"""
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class StageLink:
    """Sends and receives tuples of tensors for one rank of a pipeline stage.

    Args:
        tp_group: this rank's tensor-parallel group.
        device: where received tensors are allocated.
    """

    def __init__(self, tp_group: Optional[dist.ProcessGroup], device: torch.device) -> None:
        self.tp_group = tp_group
        self.tp_size = dist.get_world_size(tp_group)
        self.tp_rank = dist.get_rank(tp_group)
        self.device = device
        self.bytes_sent = 0
        """Bytes this rank has sent to neighbour stages (for tests and logs)."""

    def _my_part(self, flat):
        chunk = flat.numel() // self.tp_size
        return flat.narrow(0, self.tp_rank * chunk, chunk)

    def send(self, tensor: torch.Tensor, dst: int, partitioned: bool) -> None:
        """Send ``tensor`` (or this rank's part of it) to global rank ``dst``."""
        flat = tensor.detach().contiguous().view(-1)
        payload = self._my_part(flat) if partitioned and self.tp_size > 1 else flat
        dist.send(payload, dst)
        self.bytes_sent += payload.numel() * payload.element_size()

    def recv(self, shape: Sequence[int], dtype: torch.dtype, src: int,
             partitioned: bool) -> torch.Tensor:
        """Receive a ``shape``/``dtype`` tensor from global rank ``src`` (gathering parts)."""
        full = torch.empty(shape, dtype=dtype, device=self.device)
        if not (partitioned and self.tp_size > 1):
            dist.recv(full, src)
            return full
        part = torch.empty(full.numel() // self.tp_size, dtype=dtype, device=self.device)
        dist.recv(part, src)
        _all_gather_single(full.view(-1), part, group=self.tp_group)
        return full

    def send_op(self, tensor: torch.Tensor, dst: int, partitioned: bool) -> dist.P2POp:
        """The ``dist.P2POp`` sending ``tensor`` (or this rank's part) to ``dst``, for
        ``dist.batch_isend_irecv``; the payload must stay alive until the op completes."""
        flat = tensor.detach().contiguous().view(-1)
        payload = self._my_part(flat) if partitioned and self.tp_size > 1 else flat
        self.bytes_sent += payload.numel() * payload.element_size()
        return dist.P2POp(dist.isend, payload, dst)

    def recv_op(self, shape: Sequence[int], dtype: torch.dtype, src: int,
                partitioned: bool) -> Tuple[dist.P2POp, Callable[[], torch.Tensor]]:
        """``(op, finish)``: the ``dist.P2POp`` receiving a ``shape``/``dtype`` tensor from
        ``src``, and a function to call once it completed that returns the full tensor
        (all-gathering the tensor-parallel parts, in the same order on every tp rank)."""
        full = torch.empty(shape, dtype=dtype, device=self.device)
        if not (partitioned and self.tp_size > 1):
            return dist.P2POp(dist.irecv, full, src), lambda: full
        part = torch.empty(full.numel() // self.tp_size, dtype=dtype, device=self.device)

        def finish():
            _all_gather_single(full.view(-1), part, group=self.tp_group)
            return full

        return dist.P2POp(dist.irecv, part, src), finish
