"""Mixture-of-experts layers in the memory model (megatron/mpu/moe: router, dispatcher,
grouped or looped experts, combine).

An MoE layer keeps the dense layer's attention, norms and residual dropouts; its MLP is
replaced by a replicated ``[E, h]`` router (a dense parameter), this rank's ``E / ep``
experts, each expert's FFN split over tp like a dense one (no biases), and optional
shared experts (a dense MLP without biases). Per MoE layer and micro-batch of ``T`` local
tokens the step keeps, counted tensor by tensor as the dense terms are:

- the router's fp32 input ``[T, h]`` (its GEMM runs in fp32), the top-k indices
  ``[T, k]`` int64 and the combine weights ``[T, k]`` fp32; with a balancing loss the
  ``[T, E]`` scores (and the routed mask), with the z-loss the logits;
- dropless: the sort order, the received rows' regrouping and their inverses (int64
  indices of the ``T k`` dispatched rows and the ``N`` received ones), each expert's input
  ``[N, h]``, its activation's input and output ``[N, f / t]`` (SwiGLU: four such), and the
  combine's fp32 ``[T k, h]`` rows. ``N``, the rows this rank's experts receive, is ``T k``
  under **balanced routing** (every expert gets ``T k / E`` rows from every rank): the
  assumption of every dropless figure; a skewed routing adds rows on the busy ranks
  (``MemorySpec.moe_rows_factor`` scales ``N`` for headroom, or for a measured routing);
- capacity mode: the static ``[E, C, h]`` buffers (``C = ceil(T k / E x factor)``),
  the experts' ``[E C, f / t]`` activations, the slot indices and the combine's rows;
- under autocast the experts' weights are cast in every forward (the loop's per-expert
  views and grouped GEMM's explicit cast are outside autocast's weight cache) and the GEMMs
  keep the casts: a 16-bit copy of the local experts per micro-batch and MoE layer.

The dispatch buffers (the sorted rows, what the all-to-all sends and receives) live only
inside the forward and the backward: the backward's (the rows' gradients going back through
the combine and the dispatch) are in the MoE block's backward working set
(:func:`moe_backward_parts`); the forward's, smaller than that, are not counted apart.
"""
from typing import TYPE_CHECKING, List

if TYPE_CHECKING:  # spec.py calls into this module: the type only, no import circle
    from ..config.run_config import RunConfig
    from .spec import MemorySpec


def moe_fields(cfg: "RunConfig") -> dict:
    """The MoE fields of :class:`MemorySpec` from a run configuration (none without
    ``--num-experts``).

    Args:
        cfg: a validated :class:`~megatron.config.RunConfig`.
    """
    moe = cfg.moe
    if moe is None or not moe.enabled:
        return {}
    return dict(
        num_experts=moe.num_experts, moe_topk=moe.moe_router_topk,
        moe_ffn=moe.moe_ffn_hidden_size or 0,
        moe_layers=tuple(bool(x) for x in moe.layers(cfg.model.num_layers)),
        moe_shared_ffn=moe.moe_shared_expert_intermediate_size or 0, ep=cfg.parallel.ep,
        capacity_factor=moe.moe_expert_capacity_factor or 0.0,
        moe_dispatcher=moe.moe_token_dispatcher_type, moe_grouped=bool(moe.moe_grouped_gemm),
        moe_aux_loss=moe.moe_router_load_balancing_type != "none" and
        moe.moe_aux_loss_coeff > 0,
        moe_z_loss=bool(moe.moe_z_loss_coeff))


def moe_problems(spec: "MemorySpec") -> List[str]:
    """What the MoE description does not cover, or a layout the run would refuse."""
    problems = []
    if spec.family != "gpt2":
        problems.append("MoE layers are described for decoder stacks (GPT-2, Llama); T5 "
                        "with MoE has no prediction")
    if spec.ep < 1 or spec.num_experts % spec.ep or spec.grad_ranks % spec.ep:
        problems.append(f"ep={spec.ep} must divide the {spec.num_experts} experts and "
                        f"dp x cp = {spec.grad_ranks}")
    if not 1 <= spec.moe_topk <= spec.num_experts:
        problems.append(f"top-k {spec.moe_topk} must be in 1..{spec.num_experts}")
    if expert_ffn(spec) % spec.tp:
        problems.append(f"expert FFN {expert_ffn(spec)} does not split over tp={spec.tp}")
    if spec.moe_layers and len(spec.moe_layers) != spec.num_layers:
        problems.append(f"{len(spec.moe_layers)} MoE layer flags for {spec.num_layers} layers")
    if spec.capacity_factor < 0:
        problems.append(f"capacity factor {spec.capacity_factor} must be > 0")
    if spec.moe_dispatcher not in ("alltoall", "allgather"):
        problems.append(f"dispatcher {spec.moe_dispatcher!r}: choose alltoall or allgather")
    if spec.sequence_parallel:
        problems.append("sequence parallelism with MoE layers (the run refuses it)")
    if spec.backend == "engine":
        problems.append("MoE layers under DeepSpeed's engine (the run refuses it)")
    if spec.pp > 1 and spec.pipeline_schedule in ("zb-h1", "zbv"):
        problems.append(f"MoE layers under {spec.pipeline_schedule}: the experts' deferred "
                        f"weight pass is not described")
    return problems


def expert_ffn(spec: "MemorySpec") -> int:
    """Each expert's feed-forward width."""
    return spec.moe_ffn or spec.ffn


def is_moe(spec: "MemorySpec", layer: int) -> bool:
    """Whether 0-based ``layer`` has an MoE block."""
    if not spec.num_experts:
        return False
    return bool(spec.moe_layers[layer]) if spec.moe_layers else True


def moe_layer_count(spec: "MemorySpec", first: int, count: int) -> int:
    """MoE layers among ``count`` layers from 0-based ``first``."""
    return sum(is_moe(spec, i) for i in range(first, first + count))


def local_experts(spec: "MemorySpec") -> int:
    return spec.num_experts // spec.ep


def expert_params(spec: "MemorySpec") -> int:
    """Expert parameter elements of one MoE layer on one rank (``E / ep`` experts, each
    FFN split over tp)."""
    f = expert_ffn(spec)
    return local_experts(spec) * (3 if spec.gated else 2) * f * spec.hidden // spec.tp


def dense_moe_params(spec: "MemorySpec") -> int:
    """Dense parameters of one MoE block: the replicated router and the shared experts."""
    shared = (3 if spec.gated else 2) * spec.moe_shared_ffn * spec.hidden // spec.tp
    return spec.num_experts * spec.hidden + shared


def dense_mlp_params(spec: "MemorySpec") -> int:
    """The dense MLP's parameters an MoE layer does not have (fc1, fc2, their biases)."""
    h, f, t = spec.hidden, spec.ffn, spec.tp
    mlp_in = (2 if spec.gated else 1) * f
    return (mlp_in * h + f * h) // t + ((mlp_in // t + h) if spec.bias else 0)


def expert_grad_ranks(spec: "MemorySpec") -> int:
    """The expert-data-parallel group: ``dp x cp / ep`` ranks (the distributed optimizer
    shards the expert buffer over them)."""
    return spec.grad_ranks // spec.ep


def capacity(spec: "MemorySpec", tokens: int) -> int:
    """Rows each expert takes from this rank in capacity mode (megatron/mpu/moe/capacity.py)."""
    import math

    return min(tokens, math.ceil(tokens * spec.moe_topk / spec.num_experts *
                                 spec.capacity_factor))


def expert_rows(spec: "MemorySpec", tokens: int) -> int:
    """Rows this rank's experts compute for ``tokens`` local tokens: dropless ``T k``
    (balanced routing), capacity mode ``E C`` (padded buffers); the all-gather dispatcher
    computes the rows of the whole expert-parallel group's tokens chosen for its experts
    (the same number, balanced)."""
    if spec.capacity_factor:
        return spec.num_experts * capacity(spec, tokens)
    return int(tokens * spec.moe_topk * spec.moe_rows_factor)


def router_saved(spec: "MemorySpec", tokens: int) -> int:
    """What the router keeps: its fp32 input, the top-k indices and weights, the
    balancing losses' scores (and routed mask) and the z-loss's logits."""
    k, e_count = spec.moe_topk, spec.num_experts
    total = tokens * spec.hidden * 4 + tokens * k * (8 + 4)
    if spec.moe_aux_loss:
        total += tokens * e_count * (4 + 1)
    if spec.moe_z_loss:
        total += tokens * e_count * 4 + tokens * 4
    return total


def moe_mlp_saved(spec: "MemorySpec", tokens: int) -> int:
    """Bytes one MoE block keeps for the backward of one micro-batch (``tokens`` local
    tokens), the router and the shared experts included (see the module docstring).

    Args:
        spec: the run.
        tokens: sequence x micro-batch on this rank.
    """
    e, t, h, k = spec.e, spec.tp, spec.hidden, spec.moe_topk
    f = expert_ffn(spec)
    n = expert_rows(spec, tokens)
    total = router_saved(spec, tokens)
    if spec.capacity_factor:
        total += 8 * tokens * k  # the slot of every choice
    else:
        # the sort order and its inverse; ep > 1: the received rows' regrouping, inverse
        total += 16 * tokens * k + (16 * n if spec.ep > 1 else 0)
    total += n * h * e + (4 if spec.gated else 2) * n * f * e // t  # the experts
    total += tokens * k * h * 4  # the combine's fp32 rows
    if spec.autocast:  # each expert's weight cast in every forward (a view or an explicit
        total += expert_params(spec) * e  # .to: autocast's cache keeps neither), kept
    if spec.moe_shared_ffn:
        sf = spec.moe_shared_ffn
        total += tokens * h * e + (4 if spec.gated else 2) * tokens * sf * e // t
    return total


def dense_mlp_saved(spec: "MemorySpec", tokens: int) -> int:
    """What a dense layer's MLP keeps (fc1's input, the activation's input and output):
    the part of :func:`~megatron.memory.activations.gpt2_layer` an MoE layer replaces."""
    copies = 1 + (spec.gated if spec.autocast and spec.separate_projections else 0)
    h_part = copies * tokens * spec.hidden * spec.e
    return h_part + (4 if spec.gated else 2) * tokens * spec.ffn * spec.e // spec.tp


def moe_backward_parts(spec: "MemorySpec", tokens: int, wg: int):
    """``(working set, saved bytes it frees, held)`` rows of an MoE block's backward in
    :func:`~megatron.memory.backward.layer_backward`'s order (the combine and the dispatch
    back, fc2, the activation, fc1 and the dispatch forth), replacing the dense MLP's.

    The per-expert loop's weight gradient reaches the stacked parameter through one
    ``select`` per expert: each makes a zero-filled gradient of the whole stacked weight,
    which autograd adds to the sum so far out of place (the sum, the new one and their
    sum: three at once, measured); grouped GEMM and the capacity path's batched GEMM make
    the stacked gradient once.

    Args:
        spec: the run.
        tokens: local tokens of one micro-batch.
        wg: bytes per element of a weight gradient as the backward makes it.
    """
    e, h, t = spec.e, spec.hidden, spec.tp
    f = expert_ffn(spec)
    n = expert_rows(spec, tokens)
    rows = tokens * spec.moe_topk
    inner = (2 if spec.gated else 1) * n * f * e // t
    looped = not (spec.moe_grouped or spec.capacity_factor) and local_experts(spec) > 1
    stacks = 3 if looped else 1
    w2 = local_experts(spec) * h * f // t * wg * stacks
    w1 = w2 * (2 if spec.gated else 1)
    combine = rows * h * 4 * 2 + rows * h * e  # the rows' gradient, its reorder, back
    return ((combine, rows * h * 4, 0),
            (n * h * e * 2 + n * f * e // t + w2, n * f * e // t, 0),  # fc2
            (2 * inner, inner, 0),  # the activation
            (inner + n * h * e * 2 + w1 + tokens * h * 4,
             n * h * e + router_saved(spec, tokens), 0))  # fc1, the dispatch back, router

