"""Data parallelism over gradient buffers: the one gradient path of every layout.

:class:`DataParallel` wraps a model (a whole model at pp 1, a pipeline stage's
``PipelineModule`` at pp > 1) as Megatron-LM's ``DistributedDataParallel`` does: its
parameters' gradients live in :class:`~.grad_buffer.GradBuffer` buckets; the step reduces
them over the data x context group once per step, after the last micro-batch's backward
(:meth:`DataParallel.finish_grad_sync`), or, with ``overlap_grad_reduce``, bucket by bucket
as the last micro-batch's backward completes them (each parameter's post-accumulate-grad
hook, and the zero-bubble weight pass's accumulation, mark it ready). After the reduction
the step completes what the buckets cannot: the tensor-parallel sum of sequence-parallel
gradients (before their bucket is reduced) and the sum of tied weights over their stages
(after it), so every optimizer sees the gradients of the serial model.

With the distributed optimizer (``use_distributed_optimizer``) the buckets are
reduce-scattered instead and the parameters live in flat buffers that the optimizer's step
all-gathers (``overlap_param_gather``: asynchronously, waited for by each module's first use
in the next forward, or all at once before a compiled region).
"""
import contextlib
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import nn

from .. import mpu
from ..mpu.weight_grad import GRAD_READY_HOOK, weight_grad_store_of
from .grad_buffer import DEFAULT_BUCKET_SIZE, GradBuffer


@dataclass(frozen=True)
class DDPConfig:
    """How gradients are reduced (Megatron-LM's flags).

    Attributes:
        use_distributed_optimizer: reduce-scatter gradients and all-gather parameters
            (``--use-distributed-optimizer``; ZeRO-1 in DeepSpeed's words).
        overlap_grad_reduce: start each bucket's reduction from the backward
            (``--overlap-grad-reduce``).
        overlap_param_gather: all-gather the updated parameters asynchronously, each bucket
            waited for at its first use (``--overlap-param-gather``).
        bucket_size: elements per bucket (``--ddp-bucket-size``); None: Megatron's default
            max(40M, 1M x dp) when overlapping, one bucket otherwise.
    """

    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_size: Optional[int] = None


def is_expert(param: torch.Tensor) -> bool:
    """An expert parameter (Megatron-Core's ``allreduce = False``): reduced over the
    expert-data-parallel group, not the data x context group."""
    return getattr(param, "allreduce", True) is False


class DataParallel(nn.Module):
    """``module`` with its gradients in buckets reduced over the data-parallel ranks.

    Args:
        module: the model or pipeline stage (its parameters become buffer views).
        config: a :class:`DDPConfig`.
        tied: ``(weight, group)`` pairs of weights held by several pipeline stages
            (DeepSpeed's ``PipelineModule.get_tied_weights_and_groups()``): their gradients
            are summed over ``group`` after the data-parallel reduction.
        sequence_parallel: parameters whose gradients are partial sums over the
            tensor-parallel group (:func:`megatron.mpu.defer_sequence_parallel_grads`),
            summed before their data-parallel reduction.
        group: the data-parallel group (default: mpu's data x context group).
    """

    def __init__(self, module: nn.Module, config: DDPConfig,
                 tied: Sequence[Tuple[torch.Tensor, object]] = (),
                 sequence_parallel: Sequence[torch.Tensor] = (), group=None):
        super().__init__()
        self.module = module
        self.config = config
        self.tied = [(w, g) for w, g in tied if w.requires_grad]
        self.sequence_parallel = {id(p) for p in sequence_parallel}
        self._sync = True
        dense_group = group if group is not None else \
            mpu.get_data_parallel_group(with_context_parallel=True)
        tied = {id(w) for w, _ in self.tied}

        def late(param):  # a tied weight alone, the sequence-parallel ones together
            return ("tied", id(param)) if id(param) in tied else \
                "sequence parallel" if id(param) in self.sequence_parallel else None

        params = [p for p in module.parameters() if p.requires_grad]
        self.buffers: List[GradBuffer] = []
        by_group: Dict[str, List[torch.Tensor]] = {}
        for param in params:
            by_group.setdefault("expert" if is_expert(param) else "dense", []).append(param)
        size = config.bucket_size
        if size is None and config.overlap_grad_reduce:
            size = max(DEFAULT_BUCKET_SIZE,
                       1_000_000 * mpu.get_data_parallel_world_size(with_context_parallel=True))
        replicas = dist.get_world_size(dense_group) if dist.is_initialized() else 1
        for kind, members in by_group.items():
            # an expert's gradient sums the tokens of every data x context replica that
            # reached it (its dispatch): the mean divides by all of them, not its group's
            reduce_group = dense_group if kind == "dense" else _expert_data_parallel_group()
            for dtype in sorted({p.dtype for p in members}, key=str):
                same = [p for p in members if p.dtype == dtype]
                self.buffers.append(GradBuffer(same, reduce_group,
                                               config.use_distributed_optimizer, size, late,
                                               average_over=replicas))
        self.buffer_of = {p: b for b in self.buffers for p in b.index}
        if config.overlap_grad_reduce:
            for param in params:
                param.register_post_accumulate_grad_hook(self._grad_ready)
                setattr(param, GRAD_READY_HOOK, self._grad_ready)
        self._gather_hooks = []
        if config.use_distributed_optimizer and config.overlap_param_gather:
            self._register_gather_hooks()

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    # ------------------------------------------------------------ gradient sync
    @contextlib.contextmanager
    def grad_sync(self, enabled: bool) -> Iterator[None]:
        """Backward passes inside reduce (``enabled``: the step's last micro-batch) or only
        accumulate (earlier micro-batches)."""
        previous, self._sync = self._sync, enabled
        try:
            yield
        finally:
            self._sync = previous

    def no_sync(self):
        """torch DDP's name for ``grad_sync(False)``."""
        return self.grad_sync(False)

    @contextlib.contextmanager
    def backward_region(self, last: bool, dtype: torch.dtype = torch.float32) -> Iterator[None]:
        """Around one backward of a step whose forwards run in one ``autocast(dtype)`` region
        (:func:`autocast_region`): autocast off (a backward runs in the dtypes its forward
        chose), and the gradient reduction on when ``last`` (the step's last micro-batch)."""
        off = torch.autocast(device_type=self._device_type(), enabled=False) \
            if dtype != torch.float32 else contextlib.nullcontext()
        with off, self.grad_sync(last):
            yield

    def _device_type(self) -> str:
        return self.buffers[0].device.type if self.buffers else "cpu"

    def _grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync:
            return
        store = weight_grad_store_of(param)
        if store is not None and store.recording_key is not None:
            return  # an input pass that deferred this weight's GEMM: autograd's hook fires
            # all the same; its gradient comes with the weight pass (accumulate_grad)
        self.buffer_of[param].mark_ready(param)

    def zero_grad(self) -> None:
        """Zero every gradient buffer (the parameters' ``.grad`` are views into them)."""
        for buffer in self.buffers:
            buffer.zero()

    def finish_grad_sync(self) -> None:
        """The step's gradient reduction: every bucket reduced (the sequence-parallel ones
        after their tp sum), then tied weights summed over their stages."""
        for buffer in self.buffers:
            buffer.finish(before_late=self._sum_sequence_parallel)
        for weight, group in self.tied:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(self._reduced_part(weight), group=group)

    def _sum_sequence_parallel(self, late_buckets) -> None:
        params = [p for b in late_buckets for p in b.params if id(p) in self.sequence_parallel]
        if params:
            mpu.allreduce_sequence_parallel_grads(params)

    def _reduced_part(self, param: torch.Tensor) -> torch.Tensor:
        """The part of ``param``'s gradient this rank holds reduced: all of it, or its
        slice of the parameter's own bucket under the distributed optimizer."""
        buffer = self.buffer_of[param]
        low, high = buffer.shard_range(buffer.bucket_of[param])
        start, end = buffer.index[param]
        return buffer.grad_data[max(low, start):min(high, end)]

    # ------------------------------------------------------------ parameter sync (sharded)
    def start_param_sync(self) -> None:
        """After the optimizer stepped its slices: all-gather the parameters (async with
        ``overlap_param_gather``, else waited for here)."""
        for buffer in self.buffers:
            buffer.start_param_gather()
        if not self.config.overlap_param_gather:
            self.finish_param_sync()

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather still in flight."""
        for buffer in self.buffers:
            buffer.finish_param_gather()

    def _register_gather_hooks(self) -> None:
        """Before a module's first use in the forward, its parameters' buckets are waited
        for (eager code; a compiled region is preceded by :meth:`finish_param_sync`)."""
        def wait(module, _inputs):
            if torch.compiler.is_compiling():
                return
            for param in module.parameters(recurse=False):
                buffer = self.buffer_of.get(param)
                if buffer is not None:
                    buffer.finish_param_gather(buffer.bucket_of[param])

        for module in self.module.modules():
            if any(True for _ in module.parameters(recurse=False)):
                self._gather_hooks.append(module.register_forward_pre_hook(wait))

    # ------------------------------------------------------------ for the optimizer
    def shard_pieces(self) -> List[Tuple[torch.Tensor, int, torch.Tensor, torch.Tensor]]:
        """``(param, offset, data, grad)``: each part of a parameter this rank updates: the
        whole parameter (replicated optimizer) or its parts in this rank's bucket slices
        (distributed optimizer); ``data`` / ``grad`` are flat views of the parameter and its
        reduced gradient from element ``offset`` of the parameter on."""
        pieces = []
        for buffer in self.buffers:
            for param, offset, start, end in buffer.shard_pieces():
                data = buffer.param_data[start:end] if buffer.param_data is not None else \
                    param.data.view(-1)[offset:offset + end - start]
                pieces.append((param, offset, data, buffer.grad_data[start:end]))
        return pieces


def autocast_region(dtype: torch.dtype, device_type: str):
    """``torch.autocast`` to ``dtype`` (a no-op in fp32), opened once around all of a step's
    micro-batches: each weight is cast to ``dtype`` once per step (autocast's weight cache
    lives until the outermost region closes), and a pipeline's micro-batches in flight
    share that one copy."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def _expert_data_parallel_group():
    getter = getattr(mpu, "get_expert_data_parallel_group", None)
    if getter is None:
        raise ValueError("the model has expert parameters (allreduce = False) but megatron.mpu "
                         "has no expert-data-parallel group")
    return getter()


def tied_weights_of(module: nn.Module) -> List[Tuple[torch.Tensor, object]]:
    """The ``(weight, group)`` pairs a DeepSpeed ``PipelineModule`` ties across stages (its
    public ``get_tied_weights_and_groups``); none for any other module."""
    getter: Optional[Callable] = getattr(module, "get_tied_weights_and_groups", None)
    return list(getter()) if callable(getter) else []
