"""Adam state by parameter name, so it can move between layouts like the weights.

torch's optimizer state dict names parameters by position. A checkpoint records the names
(:func:`param_names`); :func:`named_adam_state` keys the moments (``exp_avg``,
``exp_avg_sq``) and step by them, and :func:`adam_state_dict` turns a named state back into
what a target optimizer loads. :mod:`.layout_change` merges and re-slices the named moments
with the weights' key tables in between.
"""
from typing import Any, Dict, List, Tuple

import torch

from ..common.errors import CheckpointError

MOMENTS = ("exp_avg", "exp_avg_sq")

#: Param-group settings a checkpoint carries over (the schedule rewrites lr each step).
HYPER_PARAMETERS = ("lr", "initial_lr", "betas", "eps", "weight_decay", "amsgrad")


def param_names(module: torch.nn.Module, optimizer: Any) -> List[str]:
    """Names of the optimizer's parameters, in its state-dict order.

    Args:
        module: the model whose ``named_parameters()`` the optimizer was built from.
        optimizer: a torch optimizer (or anything with ``param_groups``).
    """
    by_id = {id(p): name for name, p in module.named_parameters()}
    names = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in by_id:
                raise CheckpointError("an optimizer parameter is not a parameter of the model")
            names.append(by_id[id(param)])
    return names


def named_adam_state(state_dict: Dict[str, Any],
                     names: List[str]) -> Tuple[Dict[str, Dict[str, Any]], List[Dict[str, Any]]]:
    """``torch.optim.AdamW.state_dict()`` -> ``({name: {exp_avg, exp_avg_sq, step}}, groups)``.

    Args:
        state_dict: the optimizer's state dict (``state`` keyed by position).
        names: :func:`param_names` of the same optimizer.
    """
    positions = [i for group in state_dict["param_groups"] for i in group["params"]]
    if len(positions) != len(names):
        raise CheckpointError(f"optimizer holds {len(positions)} parameters, the model "
                              f"{len(names)}: the checkpoint belongs to another model")
    named = {names[k]: state_dict["state"][pos] for k, pos in enumerate(positions)
             if pos in state_dict["state"]}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in state_dict["param_groups"]]
    return named, groups


def adam_state_dict(named: Dict[str, Dict[str, Any]], groups: List[Dict[str, Any]],
                    names: List[str], template_groups: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Named state -> a state dict the target rank's optimizer loads.

    Args:
        named: ``{name: {exp_avg, exp_avg_sq, step}}`` for this rank's parameters.
        groups: hyper-parameters of each param group (from :func:`named_adam_state`).
        names: :func:`param_names` of the target optimizer (its order).
        template_groups: the target optimizer's ``state_dict()["param_groups"]`` (which
            positions belong to which group).
    """
    if len(groups) != len(template_groups):
        raise CheckpointError(f"the checkpoint has {len(groups)} optimizer param groups, the "
                              f"run {len(template_groups)}")
    state = {pos: named[name] for pos, name in enumerate(names) if name in named}
    # the training hyper-parameters come from the checkpoint; how the target steps (foreach,
    # fused, on which device) stays the target's
    param_groups = [dict(template, **{k: saved[k] for k in HYPER_PARAMETERS if k in saved},
                         params=list(template["params"]))
                    for saved, template in zip(groups, template_groups)]
    return {"state": state, "param_groups": param_groups}
