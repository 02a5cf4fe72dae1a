"""Mixture of experts on mpu: router, balancing, capacity, grouped experts, expert-parallel
dispatch (Megatron-core's ``transformer/moe``); docs/moe.md.

    from megatron.mpu.moe import MoEConfig, MoELayer
    moe = MoELayer(MoEConfig(num_experts=8, topk=2, hidden_size=h, ffn_hidden_size=f),
                   layer_number=3)
    out = moe(hidden)                       # [s, b, h] -> [s, b, h], a dense FFN's place

The training step's side (the contract): expert parameters carry ``allreduce = False`` and
``expert_parallel = True`` (their gradients are reduced over
``mpu.get_expert_data_parallel_group()``); :func:`set_aux_loss_scale` once per step;
:func:`update_expert_bias` once per step (aux-loss-free balancing);
:func:`routing_statistics` at log time (then :func:`reduce_routing_statistics` over pp).
"""
from .aux_loss import (MoEAuxLossAutoScaler, attach_aux_loss, get_aux_loss_scale,
                       set_aux_loss_scale)
from .balancing import (sequence_load_balancing_loss, switch_load_balancing_loss,
                        z_loss)
from .capacity import drop_over_capacity, expert_capacity
from .config import MoEConfig, moe_config_problems
from .expert_bias import update_expert_bias
from .experts import GroupedExperts, is_expert_parameter, mark_expert_parameter
from .layer import MoELayer
from .router import Routing, TopKRouter
from .shared import SharedExpertMLP
from .statistics import LOSS_KINDS, reduce_routing_statistics, routing_statistics

__all__ = ["LOSS_KINDS", "MoEAuxLossAutoScaler", "MoEConfig", "MoELayer", "GroupedExperts",
           "Routing", "SharedExpertMLP", "TopKRouter", "attach_aux_loss", "drop_over_capacity",
           "expert_capacity", "get_aux_loss_scale", "is_expert_parameter",
           "mark_expert_parameter", "moe_config_problems", "reduce_routing_statistics",
           "routing_statistics", "sequence_load_balancing_loss", "set_aux_loss_scale",
           "switch_load_balancing_loss", "update_expert_bias", "z_loss"]
