"""Every (tp, cp, ep, pp, dp, micro-batch, recompute, ZeRO, SP) layout that fits, ranked by
predicted tokens per second per GPU at the global batch the user gives.

Memory per stage from :func:`~megatron.memory.report.predict`, held against the GPU's
memory less a reserve (CUDA context, NCCL, allocator fragmentation). Step time from
:mod:`.step_time`: shape-dependent GEMM efficiency, attention, elementwise traffic,
tensor-parallel collectives, the pipeline's bubble and p2p, the data-parallel gradient
reduction and the optimizer step, each a roofline with stated constants.

Context parallelism (cp) is a candidate dimension where the run allows it (a decoder, the
sequence cut into ``2 cp`` chunks, no attention dropout; docs/scale_out.md): its ranks sit
between tensor and data parallelism in the grid, so tp x cp <= a node's GPUs is preferred
by the links' speeds, not required. The ring (p2p) always; Ulysses (a2a) where each
context-parallel rank gets whole heads.

Expert parallelism (ep) is a candidate dimension of a model with MoE layers: every divisor
of dp x cp that divides the experts (the expert-parallel group is carved out of the data x
context ranks, so ep adds no GPUs: it trades the experts' memory for the dispatch's
all-to-alls); such a model is planned without sequence parallelism, ZeRO-2 and the
zero-bubble schedules (the run refuses the first two; the experts' deferred weight pass is
not described).
"""
import itertools
from dataclasses import replace
from typing import Callable, Iterator, List, Optional

from .plans import Hardware, Plan, plan_of
from .ranking import fitting_plans
from .report import predict
from .spec import MemorySpec


def evaluate(spec: MemorySpec, hw: Hardware, step_flops: float,
             reference: bool = False) -> Plan:
    """Predicted memory and step time of one layout.

    Args:
        spec: the layout.
        hw: the cluster.
        step_flops: model FLOPs of one step (the family's count for the global batch).
        reference: walk tds's lowered action lists (:func:`~.report.predict`).
    """
    return plan_of(spec, predict(spec, reference), hw, step_flops)


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(base: MemorySpec, hw: Hardware, global_batch: int) -> Iterator[MemorySpec]:
    """Every layout of ``base``'s model on ``hw.gpus`` GPUs at ``global_batch`` samples.

    Args:
        base: the configured run.
        hw: the cluster (GPU count, GPUs per node).
        global_batch: samples per step.
    """
    stacks = 2 if base.family == "t5" else 1
    for tp in _divisors(hw.gpus):
        if tp > min(8, hw.per_node) or base.heads % tp or base.vocab % tp or \
                (base.kv_heads or base.heads) % tp:
            continue
        for cp, comm in _context_parallel(base, tp, hw.gpus // tp):
            for pp in _divisors(hw.gpus // (tp * cp)):
                if pp > base.num_layers * stacks:
                    continue
                dp = hw.gpus // (tp * cp * pp)
                if global_batch % dp:
                    continue
                for mb in (1, 2, 4, 8, 16, 32):
                    if (global_batch // dp) % mb:
                        continue
                    yield from _variants(replace(base, cp=cp, cp_comm=comm), tp, pp, dp, mb,
                                         global_batch // (dp * mb))


def _context_parallel(base: MemorySpec, tp: int, gpus: int):
    """``(cp, comm)`` candidates on ``gpus`` GPUs per tensor-parallel group: cp 1; each
    ``cp`` dividing them that the run allows (:meth:`MemorySpec.check`'s rules) with the
    ring, and with Ulysses' all-to-all where the heads split."""
    out = [(1, "p2p")]
    for cp in _divisors(gpus)[1:]:
        for comm in ("p2p", "a2a"):
            spec = replace(base, tp=tp, cp=cp, cp_comm=comm, sequence_parallel=False)
            if not spec.cp_problems():
                out.append((cp, comm))
    return out


def _schedules(base, pp):
    """``(schedule, vpp)`` candidates: none without a pipeline; 1F1B and ZB-H1; interleaved
    with every v that divides the layers per stage; ZB-V where the layers split into 2 pp
    equal chunks."""
    if pp == 1:
        return [("", 1)]
    layers = base.num_layers * (2 if base.family == "t5" else 1)
    per_stage = layers // pp if layers % pp == 0 else 0
    interleaved = [("interleaved", v) for v in range(2, per_stage + 1) if per_stage % v == 0]
    zbv = [("zbv", 2)] if layers % (2 * pp) == 0 else []
    if base.num_experts:  # the experts' deferred weight pass is not described
        return [("1f1b", 1)] + interleaved
    return [("1f1b", 1), ("zb-h1", 1)] + interleaved + zbv


def _recomputes(base):
    """none and full; selective where it recomputes something (the attention core keeps
    ``s x s`` tensors; the model describes it for GPT-2)."""
    from .activations import selective

    keeps = base.family == "gpt2" and selective(replace(base, recompute="selective"))
    return ("none", "full", "selective") if keeps else ("none", "full")


def _expert_parallel(base, dp):
    """ep candidates: 1 for a dense model; with MoE layers every divisor of dp x cp that
    divides the experts (the expert-parallel group is carved out of those ranks)."""
    if not base.num_experts:
        return (1,)
    return tuple(ep for ep in _divisors(dp * base.cp) if base.num_experts % ep == 0)


def _variants(base, tp, pp, dp, mb, m):
    moe = bool(base.num_experts)
    for (schedule, vpp), recompute, ep in itertools.product(
            _schedules(base, pp), _recomputes(base), _expert_parallel(base, dp)):
        # MoE: no sequence parallelism, not DeepSpeed's engine (both refused by the run)
        for zero in (0, 1) if pp > 1 or moe else (0, 1, 2):
            for sp in (False, True) if tp > 1 and not moe else (False,):
                if zero and dp * base.cp == 1 or sp and base.seq_local % tp:
                    continue
                # ZeRO-2 is DeepSpeed's engine's (pp 1); stage 1 is the project's distributed
                # optimizer, every layout; the project's step is planned with its buckets
                # reduced under the backward (the run line passes --overlap-grad-reduce)
                backend = "engine" if zero == 2 or base.backend == "engine" else "ddp"
                yield replace(base, tp=tp, pp=pp, dp=dp, micro_batch=mb, num_micro_batches=m,
                              recompute=recompute, recompute_method="uniform",
                              recompute_num_layers=1, zero_stage=zero, sequence_parallel=sp,
                              backend=backend, vpp=vpp, schedule=schedule,
                              overlap_grad_reduce=backend == "ddp", ep=ep)


def plan(base: MemorySpec, hw: Hardware, global_batch: int, step_flops: float,
         keep: Optional[Callable[[MemorySpec], bool]] = None,
         reference: bool = False) -> List[Plan]:
    """Layouts whose peak fits in ``hw.usable``, most tokens per second per GPU first.

    Args:
        base: the configured run (sizes, precision, dropout, attention backend).
        hw: the cluster.
        global_batch: samples per step (kept fixed across layouts).
        step_flops: the family's model FLOPs of one step.
        keep: optional filter on the candidate layouts.
        reference: the slow path: every candidate evaluated in full, one by one, on tds's
            lowered action lists (what the fast ranking, :mod:`.ranking`, is checked
            against).
    """
    candidates = [s for s in layouts(base, hw, global_batch) if keep is None or keep(s)]
    return rank(candidates, hw, step_flops, reference)


def rank(candidates: List[MemorySpec], hw: Hardware, step_flops: float,
         reference: bool = False) -> List[Plan]:
    """The layouts of ``candidates`` that fit in ``hw.usable``, most tokens per second per
    GPU first (:func:`plan`'s ranking, for candidates already listed).

    Args:
        candidates: layouts (:func:`layouts`).
        hw: the cluster.
        step_flops: the family's model FLOPs of one step.
        reference: the slow path (see :func:`plan`).
    """
    if reference:
        plans = [p for p in (evaluate(s, hw, step_flops, reference=True) for s in candidates)
                 if p.fits(hw.usable)]
    else:
        plans = fitting_plans(candidates, hw, step_flops)
    return sort_plans(plans)


def sort_plans(plans: List[Plan]) -> List[Plan]:
    """Most tokens per second per GPU first; equal throughput (ZeRO-1 moves as many bytes
    as DDP): the shorter step, then the smaller peak."""
    return sorted(plans, key=lambda p: (-p.tokens_per_gpu_s, p.step_time, p.peak))


__all__ = ["Hardware", "Plan", "evaluate", "layouts", "plan", "plan_of", "rank", "sort_plans"]
