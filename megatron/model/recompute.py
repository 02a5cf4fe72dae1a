"""Selective and block recompute in the models (megatron/config/recompute.py has the flags).

- :func:`core_attention`: the attention core (scores, softmax, dropout, context) run under
  :func:`megatron.mpu.checkpoint` when selective recompute is on and the core keeps
  ``s x s`` tensors (Korthikanti et al. 2022, Section 4.2: Megatron-LM's
  ``_checkpointed_attention_forward``): the layer keeps q, k, v and the context, and the
  backward recomputes the rest. The RNG states are replayed, so attention dropout draws
  the same mask.
- :func:`apply_block_recompute`: full recompute, ``block`` method, in a pipeline module:
  the first ``n`` transformer layers of each of the rank's chunks keep only their input
  (each one checkpointed alone) and the others keep everything (Megatron-LM's
  ``recompute_method == 'block'``). The serial models do the same over their layer list
  (:func:`block_count`).
"""
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Tuple

import torch

from .. import mpu

if TYPE_CHECKING:  # transformer.py imports this module
    from .transformer import ModelRunOptions


def core_keeps_scores(attention_backend: str, device_type: str, attention_dropout: float,
                      mask_needs_grad: bool = False) -> bool:
    """Whether the attention core keeps ``s x s`` tensors for the backward, so that selective
    recompute has something to recompute: the unfused path always; SDPA only where PyTorch
    runs its math path (on the CPU with attention dropout, or with a mask that needs a
    gradient, as T5's relative bias).

    Args:
        attention_backend: ``sdpa`` or ``unfused`` (resolved).
        device_type: ``cuda`` or ``cpu``.
        attention_dropout: the attention dropout probability.
        mask_needs_grad: the additive mask carries a gradient (T5's bias).
    """
    if attention_backend == "unfused":
        return True
    return device_type == "cpu" and (attention_dropout > 0 or mask_needs_grad)


def recompute_core(config: "ModelRunOptions", mask_needs_grad: bool = False) -> bool:
    """Whether selective recompute applies to this model's attention core (selective asked,
    and the core keeps ``s x s`` tensors on this device).

    Args:
        config: a model config (``recompute_granularity``, ``attention_backend``,
            ``attention_dropout``).
        mask_needs_grad: the additive mask carries a gradient (T5's relative bias).
    """
    from .attention import resolve_attention_backend

    if config.recompute_granularity != "selective":
        return False
    return core_keeps_scores(resolve_attention_backend(config.attention_backend),
                             mpu.get_device().type, config.attention_dropout, mask_needs_grad)


def core_attention(run: Callable, recompute: bool, training: bool, *args):
    """``run(*args)`` (the attention core), under :func:`megatron.mpu.checkpoint` when
    ``recompute`` and ``training`` and gradients are being recorded.

    Args:
        run: the core, ``run(q, k, v, ...) -> context``.
        recompute: selective recompute applies (:func:`recompute_core`).
        training: the module's training flag (no recompute in evaluation or generation).
        args: the core's arguments (q, k, v first; non-tensors are kept as they are).
    """
    if recompute and training and torch.is_grad_enabled():
        return mpu.checkpoint(run, *args)
    return run(*args)


def block_count(config: "ModelRunOptions") -> int:
    """Layers at the start of each stage (or chunk) that full ``block`` recompute
    checkpoints: ``recompute_num_layers`` under block, else 0."""
    if config.recompute_granularity == "full" and config.recompute_method == "block":
        return config.recompute_num_layers
    return 0


class _Recomputed:
    """A pipeline layer that keeps only its input while training (its forward runs again in
    the backward); plain otherwise. Stands in for the layer in the pipeline module's list
    of forward functions (the layer stays registered where it was)."""

    def __init__(self, layer: torch.nn.Module):
        self.layer = layer

    def __call__(self, inputs):
        if not (self.layer.training and torch.is_grad_enabled()):
            return self.layer(inputs)
        if isinstance(inputs, tuple):
            return mpu.checkpoint(lambda *xs: self.layer(xs), *inputs)
        return mpu.checkpoint(self.layer, inputs)


def apply_block_recompute(module: Any, count: int, layer_types: Tuple[type, ...]) -> int:
    """Make the first ``count`` layers of ``layer_types`` in each of a pipeline module's
    local chunks recompute themselves (block method); returns how many were.

    Args:
        module: a tds ``PipelineModule`` (built, with ``activation_checkpoint_interval`` 0).
        count: layers per chunk (``recompute_num_layers``).
        layer_types: the transformer layer classes.
    """
    chunks = getattr(module, "chunk_funcs", None) or [module.forward_funcs]
    marked = 0
    for funcs in chunks:
        seen = 0
        for i, func in enumerate(funcs):
            if isinstance(func, layer_types) and seen < count:
                funcs[i] = _Recomputed(func)
                seen += 1
        marked += seen
    if getattr(module, "num_virtual_stages", 1) > 1:
        module._select_chunk(0)  # forward_funcs points at chunk 0's (now changed) list
    return marked


def run_layers(layers: Sequence[torch.nn.Module], count: int, training: bool,
               hidden, *args, call: Optional[Callable] = None):
    """Run ``layers`` in turn on ``hidden`` (other arguments passed to each), the first
    ``count`` of them checkpointed alone when ``training`` (block recompute in a serial
    model).

    Args:
        layers: the layers.
        count: layers recomputed (:func:`block_count`).
        training: the model's training flag.
        hidden: the first input; each layer's output replaces it.
        args: further arguments of every layer.
        call: ``call(layer, hidden, *args)`` (default: ``layer(hidden, *args)``).
    """
    call = call or (lambda layer, x, *rest: layer(x, *rest))
    for i, layer in enumerate(layers):
        if i < count and training and torch.is_grad_enabled():
            hidden = mpu.checkpoint(lambda x, *rest, layer=layer: call(layer, x, *rest),
                                    hidden, *args)
        else:
            hidden = call(layer, hidden, *args)
    return hidden
