"""AdamW with Megatron's parameter groups, loss scaling, overflow skipping and clipping:
the one optimizer step of every layout (:mod:`.optimizer`), replicated or distributed over
the data-parallel ranks (:mod:`.distributed`)."""
from .distributed import DistributedOptimizer, Piece, build_optimizer
from .grad_scaler import ConstantGradScaler, DynamicGradScaler, build_grad_scaler
from .optimizer import MegatronOptimizer


def get_param_groups(modules, weight_decay):
    """Two groups: matrices and embeddings decay; biases and norm weights (1-D) do not."""
    decay, no_decay = [], []
    for module in modules:
        for param in module.parameters():
            if param.requires_grad:
                (decay if param.dim() > 1 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


__all__ = ["ConstantGradScaler", "DistributedOptimizer", "DynamicGradScaler",
           "MegatronOptimizer", "Piece", "build_grad_scaler", "build_optimizer",
           "get_param_groups"]
