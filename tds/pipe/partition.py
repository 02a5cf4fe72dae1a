"""How a ``PipelineModule``'s layer specs are cut into stages (or chunks): DeepSpeed's
``partition_method`` semantics ("uniform", "parameters", "type:<regex>") computed here, so
that tds's chunks (virtual stages) and the planner's predictions cut exactly where
DeepSpeed's own partition would (tests/test_planner_fast.py checks both functions against
DeepSpeed's), whatever the DeepSpeed version."""
from typing import List, Sequence

import regex
import torch


def partition_uniform(num_items: int, num_parts: int) -> List[int]:
    """``num_parts + 1`` boundaries of ``num_items`` split as evenly as possible, the first
    parts one larger (DeepSpeed's ``partition_uniform``)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    return [p * size + min(p, extra) for p in range(num_parts + 1)]


def partition_balanced(weights: Sequence[int], num_parts: int) -> List[int]:
    """DeepSpeed's ``partition_balanced`` (the linear-partition dynamic programme its
    ``PipelineModule`` runs for ``partition_method='type:...'`` and ``'parameters'``), the
    same boundaries, ties broken the same way (the last split of the least cost), with each
    step's candidates on arrays: milliseconds where DeepSpeed's loops take a second at 128
    stages.

    Args:
        weights: per layer spec.
        num_parts: parts.
    """
    import numpy as np

    n, m = len(weights), num_parts
    if n <= m:
        return partition_uniform(n, m)
    inf = np.inf
    dp_max, dp_min, dp_cost = (np.full((n + 1, m + 1), inf) for _ in range(3))
    position = np.zeros((n + 1, m + 1), dtype=int)
    prefix = np.zeros(n + 1)
    prefix[1:] = np.cumsum(weights)
    dp_max[0, 0] = dp_cost[0, 0] = 0
    rows, ks = np.arange(n + 1)[:, None], np.arange(n)[None, :]
    span = prefix[:, None] - prefix[None, :n]  # [i, k]: weight of layers k..i-1
    for j in range(1, m + 1):
        top = np.maximum(dp_max[:n, j - 1][None, :], span)
        low = np.minimum(dp_min[:n, j - 1][None, :], span)
        cost = np.where(ks < rows, top - low, np.nan)
        best = np.nanmin(np.where(ks < rows, cost, inf), axis=1)
        hit = (cost == best[:, None]) & (ks < rows)
        k = n - 1 - np.argmax(hit[:, ::-1], axis=1)  # the last k of the least cost
        i = np.arange(j, n + 1)  # DeepSpeed fills j <= min(i, m)
        dp_cost[i, j], position[i, j] = best[i], k[i]
        dp_max[i, j], dp_min[i, j] = top[i, k[i]], low[i, k[i]]
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(int(position[parts[-1], j]))
    parts.reverse()
    return parts


def _name(spec) -> str:
    typename = getattr(spec, "typename", None)  # a LayerSpec
    if typename is not None:
        return typename.__name__
    if isinstance(spec, torch.nn.Module):
        return type(spec).__name__
    return getattr(spec, "__name__", "")


def _trainable(spec) -> int:
    layer = spec.build() if hasattr(spec, "typename") and hasattr(spec, "build") else spec
    if not isinstance(layer, torch.nn.Module):
        return 0
    return sum(p.numel() for p in layer.parameters() if p.requires_grad)


def partition_specs(specs: Sequence, method: str, num_parts: int) -> List[int]:
    """Boundaries of ``num_parts`` parts of ``specs`` by DeepSpeed's ``partition_method``.

    Raises:
        ValueError: an unknown method, or a ``type:`` regex that matches no layer.
    """
    method = method.lower()
    if method == "uniform":
        return partition_uniform(len(specs), num_parts)
    if method == "parameters":  # builds each layer spec once, as DeepSpeed does
        return partition_balanced([_trainable(s) for s in specs], num_parts)
    if method.startswith("type:"):
        pattern = regex.compile(method.split(":", 1)[1], regex.IGNORECASE)
        weights = [1 if pattern.search(_name(s)) else 0 for s in specs]
        if not any(weights):
            raise ValueError(f"PipelineModule: partition_method {method!r} matches no layer")
        return partition_balanced(weights, num_parts)
    raise ValueError(f"PipelineModule: partition_method {method!r} is not one of 'uniform', "
                     f"'parameters', 'type:<regex>'")
