"""Every (tp, pp, dp, micro-batch, recompute, ZeRO, SP) layout that fits, ranked by a
predicted step time.

Step time = the step's model FLOPs (the family's count; x 4/3 with full recompute) / (GPUs
x peak x efficiency), stretched by the pipeline bubble ``(p - 1) / m``, plus communication
at the given bandwidths, not overlapped (a conservative bound): tensor-parallel
all-reduces (4 per layer per micro-batch, ring volume ``2 (t - 1) / t``), the
data-parallel gradient all-reduce (ZeRO's reduce-scatter + all-gather moves the same), and
pipeline sends (activation forward, gradient back, per micro-batch and boundary). A group
inside one node uses the intra-node bandwidth, one that spans nodes the inter-node one.
"""
from dataclasses import dataclass, replace
from typing import Callable, Iterator, List, Optional

from .report import StageMemory, predict
from .schedule import bubble_fraction
from .spec import MemorySpec


@dataclass(frozen=True)
class Hardware:
    """The cluster the plan is for."""

    gpus: int
    gpu_memory: int
    """Bytes per GPU."""
    nodes: int = 1
    peak_tflops: float = 989.0
    """Per-GPU dense peak (H100 SXM bf16)."""
    efficiency: float = 0.4
    """Share of the peak the matmuls reach."""
    intra_gbps: float = 450.0
    """Intra-node bandwidth per GPU, GB/s (NVLink 4)."""
    inter_gbps: float = 50.0
    """Inter-node bandwidth per GPU, GB/s (400 Gb/s InfiniBand)."""

    @property
    def per_node(self) -> int:
        return self.gpus // self.nodes


@dataclass(frozen=True)
class Plan:
    """One layout and its predictions."""

    spec: MemorySpec
    stages: List[StageMemory]
    step_time: float
    """Seconds."""
    compute_time: float
    comm_time: float
    comm_bytes: int
    """Bytes one rank sends per step (all groups)."""
    bubble: float

    @property
    def peak(self) -> int:
        return max(s.peak for s in self.stages)

    def fits(self, gpu_memory: int) -> bool:
        return self.peak <= gpu_memory

    def layout(self) -> str:
        s = self.spec
        return (f"tp={s.tp} pp={s.pp} dp={s.dp} mb={s.micro_batch} m={s.num_micro_batches} "
                f"recompute={s.recompute} zero={s.zero_stage} sp={int(s.sequence_parallel)}")

    def to_dict(self) -> dict:
        s = self.spec
        return {"tp": s.tp, "pp": s.pp, "dp": s.dp, "micro_batch": s.micro_batch,
                "num_micro_batches": s.num_micro_batches, "recompute": s.recompute,
                "zero_stage": s.zero_stage, "sequence_parallel": s.sequence_parallel,
                "peak_bytes": self.peak, "stage_peak_bytes": [x.peak for x in self.stages],
                "step_time_s": self.step_time, "compute_time_s": self.compute_time,
                "comm_time_s": self.comm_time, "comm_bytes": self.comm_bytes,
                "bubble": self.bubble}


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _ring(bytes_: float, n: int) -> float:
    return 2 * (n - 1) / n * bytes_ if n > 1 else 0.0


def _comm(spec: MemorySpec, hw: Hardware, stages: List[StageMemory]):
    """(bytes sent per rank per step, seconds) for tp, dp and pp traffic."""
    tokens = spec.micro_batch * (spec.seq + spec.dec_seq)
    act = tokens * spec.hidden * spec.e
    layers = spec.num_layers * (2 if spec.family == "t5" else 1) / spec.pp
    tp_bytes = _ring(act, spec.tp) * 4 * layers * spec.num_micro_batches
    grad_bytes = max(s.states.params for s in stages) * (4 if spec.backend == "ddp" else spec.e)
    dp_bytes = _ring(grad_bytes, spec.dp)
    pp_bytes = 2 * act / spec.tp * spec.num_micro_batches if spec.pp > 1 else 0

    def bw(span: int) -> float:
        return (hw.intra_gbps if span <= hw.per_node else hw.inter_gbps) * 1e9

    seconds = (tp_bytes / bw(spec.tp) + dp_bytes / bw(spec.tp * spec.dp)
               + pp_bytes / bw(spec.world if spec.pp > 1 else 1))
    return int(tp_bytes + dp_bytes + pp_bytes), seconds


def evaluate(spec: MemorySpec, hw: Hardware, step_flops: float) -> Plan:
    """Predicted memory and step time of one layout.

    Args:
        spec: the layout.
        hw: the cluster.
        step_flops: model FLOPs of one step (the family's count for the global batch).
    """
    stages = predict(spec)
    flops = step_flops * (4 / 3 if spec.recompute == "full" else 1)
    compute = flops / (hw.gpus * hw.peak_tflops * 1e12 * hw.efficiency)
    bubble = bubble_fraction(spec.pp, spec.num_micro_batches, spec.vpp)
    compute /= 1 - bubble
    comm_bytes, comm_time = _comm(spec, hw, stages)
    return Plan(spec, stages, compute + comm_time, compute, comm_time, comm_bytes, bubble)


def layouts(base: MemorySpec, hw: Hardware, global_batch: int) -> Iterator[MemorySpec]:
    """Every layout of ``base``'s model on ``hw.gpus`` GPUs at ``global_batch`` samples.

    Args:
        base: the configured run.
        hw: the cluster (GPU count, GPUs per node).
        global_batch: samples per step.
    """
    stacks = 2 if base.family == "t5" else 1
    for tp in _divisors(hw.gpus):
        if tp > min(8, hw.per_node) or base.heads % tp or base.vocab % tp:
            continue
        for pp in _divisors(hw.gpus // tp):
            if pp > base.num_layers * stacks:
                continue
            dp = hw.gpus // (tp * pp)
            if global_batch % dp:
                continue
            for mb in (1, 2, 4, 8, 16, 32):
                if (global_batch // dp) % mb:
                    continue
                yield from _variants(base, tp, pp, dp, mb, global_batch // (dp * mb))


def _variants(base, tp, pp, dp, mb, m):
    for recompute in ("none", "full"):
        for zero in (0, 1) if pp > 1 else (0, 1, 2):
            for sp in (False, True) if tp > 1 else (False,):
                if zero and dp == 1:
                    continue
                backend = "engine" if pp > 1 or zero or base.backend == "engine" else "ddp"
                yield replace(base, tp=tp, pp=pp, dp=dp, micro_batch=mb, num_micro_batches=m,
                              recompute=recompute, zero_stage=zero, sequence_parallel=sp,
                              backend=backend, vpp=1)


def plan(base: MemorySpec, hw: Hardware, global_batch: int, step_flops: float,
         keep: Optional[Callable[[MemorySpec], bool]] = None) -> List[Plan]:
    """Layouts that fit in ``hw.gpu_memory``, fastest first.

    Args:
        base: the configured run (sizes, precision, dropout, attention backend).
        hw: the cluster.
        global_batch: samples per step (kept fixed across layouts).
        step_flops: the family's model FLOPs of one step.
        keep: optional filter on the candidate layouts.
    """
    plans = [evaluate(s, hw, step_flops) for s in layouts(base, hw, global_batch)
             if keep is None or keep(s)]
    # equal times (ZeRO-1 moves as many bytes as DDP): the smaller peak first
    return sorted((p for p in plans if p.fits(hw.gpu_memory)),
                  key=lambda p: (p.step_time, p.peak))
