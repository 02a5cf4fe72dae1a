"""An independent mixture-of-experts for the tests: every token through every expert (no
sorting, no dispatch), the routing written from the papers' definitions, capacity by a plain
loop over the tokens (the Switch Transformer's, Fedus et al. 2021, Sec. 2.2).

It reads a serial MoELayer's full weights (router [E, h], experts [E, F1, h] / [E, h, f])
and computes in float64 so a float32 layer is compared with something more exact.
"""
import math

import torch
import torch.nn.functional as F


def full_weights(layer):
    """The serial layer's weights as float64 tensors (a dict)."""
    w = {"router": layer.router.weight.detach().double(),
         "w1": layer.experts.weight1.detach().double(),
         "w2": layer.experts.weight2.detach().double()}
    if layer.shared_experts is not None:
        w["s1"] = layer.shared_experts.fc1.weight.detach().double()
        w["s2"] = layer.shared_experts.fc2.weight.detach().double()
    if layer.router.expert_bias is not None:
        w["bias"] = layer.router.expert_bias.detach().double()
    return w


def activation(name, x):
    gelu = lambda t: F.gelu(t, approximate="tanh")  # noqa: E731
    if name in ("swiglu", "geglu"):
        gate, up = x.chunk(2, dim=-1)
        return (F.silu(gate) if name == "swiglu" else gelu(gate)) * up
    return gelu(x) if name == "gelu" else F.relu(x)


def route(logits, cfg, bias=None):
    """``(weights [T, k], experts [T, k])`` by the score function's definition."""
    if cfg.score_function == "sigmoid":
        scores = torch.sigmoid(logits)
    elif cfg.pre_softmax:
        scores = torch.softmax(logits, dim=-1)
    else:
        scores = logits
    choose = scores if bias is None else scores + bias
    experts = choose.topk(cfg.topk, dim=-1).indices
    picked = scores.gather(1, experts)
    if cfg.score_function == "softmax" and not cfg.pre_softmax:
        picked = torch.softmax(picked, dim=-1)
    elif cfg.score_function == "sigmoid" and cfg.topk > 1:
        picked = picked / picked.sum(-1, keepdim=True)
    return picked, experts


def switch_capacity_keep(weights, experts, num_experts, capacity, policy):
    """Which choices survive, by a loop: ``position`` takes tokens in order until an expert
    holds ``capacity``; ``probs`` keeps each expert's ``capacity`` highest weights."""
    t, k = experts.shape
    keep = torch.zeros(t, k, dtype=torch.bool)
    if policy == "position":
        used = [0] * num_experts
        for i in range(t):
            for j in range(k):
                e = int(experts[i, j])
                if used[e] < capacity:
                    used[e] += 1
                    keep[i, j] = True
        return keep
    for e in range(num_experts):
        mine = [(float(weights[i, j]), i, j) for i in range(t) for j in range(k)
                if int(experts[i, j]) == e]
        for _, i, j in sorted(mine, reverse=True)[:capacity]:
            keep[i, j] = True
    return keep


def capacity_of(tokens, num_experts, topk, factor):
    """The Switch paper's expert capacity, ``tokens / experts x capacity factor`` (x k)."""
    return min(tokens, math.ceil(tokens / num_experts * factor * topk))


def balancing_losses(logits, experts, cfg, batch):
    """``{kind: value}``: the Switch aux loss / per-sequence loss and the z-loss."""
    t, e = logits.shape
    out = {}
    if cfg.load_balancing_type != "none" and cfg.aux_loss_coeff > 0:
        if cfg.score_function == "softmax":
            p = torch.softmax(logits, dim=-1)
        else:
            p = torch.sigmoid(logits)
            p = p / p.sum(-1, keepdim=True)
        chosen = torch.zeros(t, e, dtype=logits.dtype).scatter_(1, experts, 1.0)
        if cfg.load_balancing_type == "aux_loss":
            f = chosen.sum(0) / (t * cfg.topk)  # fraction of the choices per expert
            out["load_balancing_loss"] = cfg.aux_loss_coeff * e * (f * p.mean(0)).sum()
        else:
            s = t // batch
            f = chosen.view(s, batch, e).sum(0) / (s * cfg.topk)  # [b, E]
            per_seq = (f * p.view(s, batch, e).mean(0)).sum(1)
            out["load_balancing_loss"] = cfg.aux_loss_coeff * e * per_seq.mean()
    if cfg.z_loss_coeff > 0:
        out["z_loss"] = cfg.z_loss_coeff * torch.logsumexp(logits, -1).square().mean()
    return out


def moe_forward(x, w, cfg, batch, capacity_factor=None):
    """``x [T, h]`` (float64) -> ``(out [T, h], losses, keep [T, k], experts [T, k])``."""
    logits = x @ w["router"].t()
    weights, experts = route(logits, cfg, w.get("bias"))
    losses = balancing_losses(logits, experts, cfg, batch)
    keep = torch.ones_like(experts, dtype=torch.bool)
    if capacity_factor is not None:
        cap = capacity_of(x.shape[0], cfg.num_experts, cfg.topk, capacity_factor)
        keep = switch_capacity_keep(weights.detach(), experts, cfg.num_experts, cap,
                                    cfg.token_drop_policy)
    every = torch.stack([activation(cfg.activation, x @ w["w1"][e].t()) @ w["w2"][e].t()
                         for e in range(cfg.num_experts)])  # [E, T, h]: every token, every expert
    rows = torch.arange(x.shape[0])
    out = sum(every[experts[:, j], rows] * (weights[:, j] * keep[:, j]).unsqueeze(-1)
              for j in range(cfg.topk))
    if "s1" in w:
        out = out + activation(cfg.activation, x @ w["s1"].t()) @ w["s2"].t()
    return out, losses, keep, experts
