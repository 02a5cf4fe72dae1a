"""Aux-loss-free balancing (DeepSeek-V3, Wang et al. 2024 "Auxiliary-loss-free load balancing"):
after each step every router's per-expert bias moves by ``rate * sign(mean load - load)``, so
an overloaded expert is chosen less and an idle one more; no gradient is involved.

The loads are the tokens each expert took in the step's training forwards (every micro-batch,
recomputes not counted), summed over the data x context ranks: every rank then applies the
same update, and the bias (a checkpointed buffer) stays identical across replicas.
"""
import torch
import torch.distributed as dist
from torch import nn


def _routers(model):
    chunks = model if isinstance(model, (list, tuple)) else [model]
    return [m for chunk in chunks for m in chunk.modules()
            if getattr(m, "expert_bias", None) is not None
            and hasattr(m, "local_tokens_per_expert")]


@torch.no_grad()
def update_expert_bias(model: nn.Module, group=None) -> None:
    """Move every expert bias of ``model`` by its loads since the last call, then reset them.

    The training step calls it once per step, after the backward of the last micro-batch
    (before or after the optimizer: the bias has no gradient); every rank of ``group``
    calls it (one all-reduce for all layers; nothing read on the host).

    Args:
        model: the model, this rank's pipeline stage, or a list of its chunks.
        group: the ranks whose loads are summed (default: mpu's data x context group).
    """
    from .. import parallel_state as ps

    routers = _routers(model)
    if not routers:
        return
    loads = torch.cat([r.local_tokens_per_expert for r in routers])
    if group is None and ps.model_parallel_is_initialized():
        group = ps.get_data_parallel_group(with_context_parallel=True)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(loads, group=group)
    at = 0
    for router in routers:
        load = loads[at:at + router.expert_bias.numel()]
        at += load.numel()
        offset = load.mean() - load
        router.expert_bias.add_(torch.sign(offset) * router.config.bias_update_rate)
        router.local_tokens_per_expert.zero_()
