"""DeepSpeed ZeRO-1/2 optimizer state by parameter name, to move it to another layout.

ZeRO keeps, per param group, one flat fp32 partition of the master weights on each
data-parallel rank and the Adam moments of that partition. Its state dict records where
each parameter's slice lies in the partition (``param_slice_mappings``: name ->
``fragment_address(start, numel)``). :func:`named_from_saved` reassembles, from every
data-parallel rank's saved state of one (tp, pp), each parameter's fp32 master weight,
``exp_avg`` and ``exp_avg_sq``; :func:`load_named` writes a named state into a live ZeRO
optimizer through each parameter's fragment mapping (``param._hp_mapping``), so the resume
at another layout (:mod:`.layout_change`) re-slices ZeRO state like the DDP backend's. Both read DeepSpeed's own records; the supported DeepSpeed range is pinned in
``tds`` (docs/tds.md).
"""
from typing import Any, Dict, List, Tuple

import torch

from ..common.errors import CheckpointError
from .manifest import check_file

#: What each parameter carries: the fp32 master weight and the two Adam moments.
KEYS = ("fp32", "exp_avg", "exp_avg_sq")


def is_zero_state(state: Dict[str, Any]) -> bool:
    """Whether a saved optimizer state is DeepSpeed ZeRO-1/2's."""
    return "base_optimizer_state" in state and "single_partition_of_fp32_groups" in state


def _group_state(base, group):
    """Adam state of one group's flat partition, in the elastic (list) or rigid format."""
    if isinstance(base, list):
        return base[group]
    return base["state"][group]  # rigid: torch's state dict, one flat parameter per group


def named_from_saved(shards: List[Dict[str, Any]], shapes: Dict[str, torch.Size],
                     where: str) -> Tuple[Dict[str, Dict[str, torch.Tensor]], Any]:
    """Every data-parallel rank's saved ZeRO state (rank order) -> named state.

    Args:
        shards: the saved state dicts of one (tp, pp), data-parallel rank order.
        shapes: ``{parameter name: shape}`` (from the saved model state dict).
        where: description for error messages.

    Returns:
        ``({name: {"fp32", "exp_avg", "exp_avg_sq": tensor of the parameter's shape}},
        step)``.
    """
    pieces, step = {}, None
    for rank, shard in enumerate(shards):
        mappings = shard.get("param_slice_mappings")
        if mappings is None:
            raise CheckpointError(f"{where}: DeepSpeed saved no param_slice_mappings, so its "
                                  f"ZeRO state cannot be named (data-parallel rank {rank})")
        base = shard["base_optimizer_state"]
        for group, mapping in enumerate(mappings):
            state = _group_state(base, group)
            flats = {"fp32": shard["single_partition_of_fp32_groups"][group],
                     "exp_avg": state.get("exp_avg"), "exp_avg_sq": state.get("exp_avg_sq")}
            if flats["exp_avg"] is None:
                raise CheckpointError(f"{where}: the ZeRO state has no Adam moments (saved "
                                      f"before the first step?)")
            step = state.get("step", step)
            for name, address in mapping.items():
                entry = pieces.setdefault(name, {k: [] for k in KEYS})
                for key, flat in flats.items():  # a parameter's slices come in rank order
                    entry[key].append(flat.narrow(0, address.start, address.numel))
    named = {}
    for name, entry in pieces.items():
        if name not in shapes:
            raise CheckpointError(f"{where}: ZeRO state names {name}, which the model lacks")
        named[name] = {k: torch.cat(v).view(shapes[name]).float() for k, v in entry.items()}
    return named, step


def _new_step(step, group, device):
    """A step counter as torch's AdamW creates it (on the device when fused/capturable)."""
    on_device = group.get("fused") or group.get("capturable")
    return torch.tensor(float(step), dtype=torch.float32, device=device if on_device else "cpu")


def load_named(zero: Any, module: torch.nn.Module, named: Dict[str, Dict[str, torch.Tensor]],
               step: Any) -> None:
    """Write a named state into the live ZeRO optimizer ``zero`` of ``module``.

    Args:
        zero: DeepSpeed's ``DeepSpeedZeroOptimizer`` (stage 1 or 2).
        module: the model the engine wraps (its parameter names key ``named``).
        named: ``{name: {"fp32", "exp_avg", "exp_avg_sq"}}`` for this rank's parameters.
        step: the optimizer step count.
    """
    names = {id(p): n for n, p in module.named_parameters()}
    base = zero.optimizer
    for group, (params, flat) in enumerate(zip(zero.bit16_groups,
                                              zero.single_partition_of_fp32_groups)):
        state = base.state[flat]
        moments = {k: torch.zeros_like(flat) for k in KEYS[1:]}
        for param in params:
            mapping = getattr(param, "_hp_mapping", None)
            if mapping is None:  # no slice of it on this rank
                continue
            name = names.get(id(param))
            if name not in named:
                raise CheckpointError(f"the checkpoint has no optimizer state for {name}")
            low, high = mapping.lp_fragment_address, mapping.hp_fragment_address
            for key, dst in (("fp32", flat.data), *moments.items()):
                src = named[name][key].reshape(-1).narrow(0, low.start, low.numel)
                dst.narrow(0, high.start, high.numel).copy_(src)
        state.clear()
        state.update(step=_new_step(step, base.param_groups[group], flat.device), **moments)
    zero._hp_optimizer_states_linked = False  # DeepSpeed re-links fragments to the new state


def load_engine_optimizer_file(path: str) -> Dict[str, Any]:
    """weights_only load that also admits DeepSpeed's plain records in optimizer states.

    ZeRO and bf16 optimizer states pickle a few DeepSpeed objects: the loss scaler and
    fragment addresses. They are plain attribute holders (no ``__setstate__``, no
    ``__reduce__``), so allowing exactly these classes still executes no pickled code. The
    file is verified against its checkpoint's manifest first (:func:`.manifest.check_file`).
    """
    check_file(path)
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    records = [fragment_address, LossScaler, DynamicLossScaler, ZeroStageEnum]
    try:
        with torch.serialization.safe_globals(records):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read optimizer shard {path}: {exc}") from None
