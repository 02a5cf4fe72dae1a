"""Make DeepSpeed's communication backend ready when torch.distributed already is.

DeepSpeed refuses to build a ``PipelineModule`` ("DeepSpeed backend not set") until
``deepspeed.init_distributed()`` has run, even when the process group exists; DeepSpeed 0.3,
which CPM-Pretrain was written for, read torch.distributed directly. CPM's order of calls
(``torch.distributed.init_process_group``, mpu, the model, ``deepspeed.initialize``) keeps
working because the calls that come before a model ready the backend over the existing
group: tds's ``PipelineModule``, ``tds.initialize`` and megatron's CPM-1 mpu
(``megatron.mpu.cpm.initialize_model_parallel``). With an initialised torch.distributed this
only wraps the existing group (no new process group, no communication).
"""
import torch.distributed as torch_dist
from deepspeed import comm as ds_comm


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
