"""Make DeepSpeed's communication backend ready when torch.distributed already is.

DeepSpeed 0.19 refuses to build a ``PipelineModule`` ("DeepSpeed backend not set") until
``deepspeed.init_distributed()`` has run, even when the process group exists; DeepSpeed 0.3,
which CPM-Pretrain was written for, read torch.distributed directly. CPM's order of calls
(``torch.distributed.init_process_group``, mpu, the model, ``deepspeed.initialize``) is kept
working by readying the backend at the first ``PipelineModule`` (DeepSpeed's class, which
CPM's models subclass, and tds's) and in ``tds.initialize``: with an initialised
torch.distributed this only wraps the existing group (no new process group, no
communication). Without one, the error says which call to add.
"""
import functools

import torch.distributed as torch_dist
from deepspeed import comm as ds_comm
from deepspeed.runtime.pipe import module as ds_pipe_module


def ensure_backend() -> None:
    """Ready DeepSpeed's backend over the existing torch.distributed process group.

    Raises:
        RuntimeError: neither DeepSpeed's backend nor torch.distributed is initialised.
    """
    if ds_comm.is_initialized():
        return
    if not torch_dist.is_initialized():
        raise RuntimeError("a PipelineModule needs the process group: call "
                           "torch.distributed.init_process_group() (or "
                           "deepspeed.init_distributed()) before building the model")
    ds_comm.init_distributed(dist_backend=torch_dist.get_backend(), dist_init_required=False,
                             verbose=False)


def install() -> None:
    """Ready the backend before every ``PipelineModule`` is built (idempotent)."""
    cls = ds_pipe_module.PipelineModule
    if getattr(cls.__init__, "_tds_ensures_backend", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        ensure_backend()
        original(self, *args, **kwargs)

    __init__._tds_ensures_backend = True
    cls.__init__ = __init__
