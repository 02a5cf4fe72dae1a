"""What the planner gives back: the cluster a plan is for (:class:`Hardware`) and one
layout's predictions (:class:`Plan`), from its stage memory and its step time."""
from dataclasses import dataclass
from typing import List

from .report import StageMemory
from .spec import MemorySpec
from .stages import stage_layers
from .step_time import Device, StepTime, step_time


@dataclass(frozen=True)
class Hardware:
    """The cluster the plan is for."""

    gpus: int
    gpu_memory: int
    """Bytes per GPU."""
    nodes: int = 1
    peak_tflops: float = 989.0
    """Per-GPU dense 16-bit peak (H100 SXM)."""
    efficiency: float = 0.75
    """Share of the peak a large GEMM reaches (:class:`~.step_time.Device`)."""
    intra_gbps: float = 450.0
    """Intra-node collective bandwidth per GPU, GB/s (NVLink 4)."""
    inter_gbps: float = 50.0
    """Inter-node bandwidth per GPU, GB/s (400 Gb/s InfiniBand)."""
    hbm_gbps: float = 3350.0
    """HBM bandwidth, GB/s (H100 SXM)."""
    reserve: int = 0
    """Bytes of each GPU not available to tensors (CUDA context, NCCL, fragmentation)."""

    @property
    def per_node(self) -> int:
        return self.gpus // self.nodes

    @property
    def usable(self) -> int:
        """Bytes the predicted peak must stay under."""
        return self.gpu_memory - self.reserve

    def device(self) -> Device:
        return Device(peak_tflops=self.peak_tflops, hbm_gbps=self.hbm_gbps,
                      gemm_efficiency=self.efficiency, intra_gbps=self.intra_gbps,
                      inter_gbps=self.inter_gbps)

    @classmethod
    def of(cls, dev: Device, gpus: int, gpu_memory: int, nodes: int = 1,
           reserve: int = 0) -> "Hardware":
        """A cluster of ``dev`` GPUs (e.g. :data:`~.step_time.A100`). :meth:`device` gives
        back ``dev``: a ``dev`` whose other constants are not the defaults is refused.

        Args:
            dev: the GPU and link constants.
            gpus: GPUs in all.
            gpu_memory: bytes per GPU.
            nodes: nodes (GPUs per node = gpus / nodes).
            reserve: bytes of each GPU tensors cannot use.
        """
        hw = cls(gpus=gpus, gpu_memory=gpu_memory, nodes=nodes, peak_tflops=dev.peak_tflops,
                 efficiency=dev.gemm_efficiency, intra_gbps=dev.intra_gbps,
                 inter_gbps=dev.inter_gbps, hbm_gbps=dev.hbm_gbps, reserve=reserve)
        if hw.device() != dev:
            raise ValueError(f"Hardware carries the peak, HBM, link speeds and GEMM efficiency "
                             f"of a Device, the other constants are the defaults: {dev}")
        return hw


@dataclass(frozen=True)
class Plan:
    """One layout and its predictions."""

    spec: MemorySpec
    stages: List[StageMemory]
    time: StepTime
    comm_bytes: int
    """Bytes one rank sends per step (all groups)."""
    step_flops: float
    """Model FLOPs of the step (no recompute)."""
    gpus: int

    @property
    def step_time(self) -> float:
        """Seconds."""
        return self.time.total

    @property
    def bubble(self) -> float:
        return self.time.bubble

    @property
    def tokens_per_gpu_s(self) -> float:
        s = self.spec
        tokens = s.micro_batch * s.num_micro_batches * s.dp * s.seq
        return tokens / self.step_time / self.gpus

    @property
    def tflops_per_gpu(self) -> float:
        """Model TFLOP/s per GPU (recompute not counted)."""
        return self.step_flops / self.step_time / self.gpus / 1e12

    @property
    def peak(self) -> int:
        return max(s.peak for s in self.stages)

    def fits(self, usable: int) -> bool:
        return self.peak <= usable

    def layout(self) -> str:
        s = self.spec
        schedule = f" {s.pipeline_schedule}" if s.pp > 1 else ""
        if s.pipeline_schedule == "interleaved" and s.pp > 1:
            schedule += f"/v{s.vpp}"
        recompute = s.recompute
        if s.recompute == "full" and (s.recompute_method, s.recompute_num_layers) != \
                ("uniform", 1):
            recompute += f"/{s.recompute_method}{s.recompute_num_layers}"
        cp = f" cp={s.cp}" + (f"/{s.cp_comm}" if s.cp_comm != "p2p" else "") \
            if s.cp > 1 else ""
        ep = f" ep={s.ep}" if s.num_experts else ""
        return (f"tp={s.tp}{cp}{ep} pp={s.pp}{schedule} dp={s.dp} mb={s.micro_batch} "
                f"m={s.num_micro_batches} recompute={recompute} zero={s.zero_stage} "
                f"sp={int(s.sequence_parallel)}")

    def to_dict(self) -> dict:
        s, t = self.spec, self.time
        return {"tp": s.tp, "pp": s.pp, "dp": s.dp, "cp": s.cp, "ep": s.ep,
                "cp_comm_type": s.cp_comm if s.cp > 1 else None,
                "micro_batch": s.micro_batch,
                "pipeline_schedule": s.pipeline_schedule if s.pp > 1 else None, "vpp": s.vpp,
                "num_micro_batches": s.num_micro_batches, "recompute": s.recompute,
                "recompute_method": s.recompute_method if s.recompute == "full" else None,
                "recompute_num_layers": s.recompute_num_layers if s.recompute == "full"
                else None,
                "zero_stage": s.zero_stage, "sequence_parallel": s.sequence_parallel,
                "backend": "deepspeed" if s.backend == "engine" else "megatron",
                "overlap_grad_reduce": s.overlap_grad_reduce,
                "peak_bytes": self.peak, "stage_peak_bytes": [x.peak for x in self.stages],
                "step_time_s": t.total, "tokens_per_gpu_s": self.tokens_per_gpu_s,
                "model_tflops_per_gpu": self.tflops_per_gpu,
                "compute_time_s": t.compute, "tp_comm_time_s": t.tp_comm,
                "cp_comm_time_s": t.cp_comm, "ep_comm_time_s": t.ep_comm,
                "pipeline_time_s": t.pp, "dp_comm_time_s": t.dp_comm,
                "optimizer_time_s": t.optimizer, "comm_bytes": self.comm_bytes,
                "bubble": t.bubble}


def _ring(bytes_: float, n: int) -> float:
    return 2 * (n - 1) / n * bytes_ if n > 1 else 0.0


def _comm_bytes(spec: MemorySpec, stages: List[StageMemory]) -> int:
    """Bytes one rank sends per step: tp collectives, dp x cp gradient reduction, pp
    sends, the context-parallel exchange (p2p: ``cp - 1`` key / value blocks forward, as
    many again with their fp32 gradients backward; all_gather and a2a: their
    collectives' ring bytes)."""
    tokens = spec.micro_batch * (spec.seq_local + spec.dec_seq)
    act = tokens * spec.hidden * spec.e
    layers = spec.num_layers * (2 if spec.family == "t5" else 1) / spec.pp
    per_layer = 4 + (1 if spec.sequence_parallel else 0)  # SP: the backward's re-gathers
    tp_bytes = _ring(act, spec.tp) * per_layer * layers * spec.num_micro_batches
    grad_bytes = max(s.states.params for s in stages) * (4 if spec.backend == "ddp" else spec.e)
    dp_bytes = _ring(grad_bytes, spec.grad_ranks)
    pp_bytes = 2 * act / spec.tp * spec.num_micro_batches if spec.pp > 1 else 0
    return int(tp_bytes + dp_bytes + pp_bytes +
               _cp_bytes(spec, tokens) * layers * spec.num_micro_batches)


def _cp_bytes(spec: MemorySpec, tokens: int) -> float:
    """Bytes one rank sends in one layer's context-parallel attention, forward + backward,
    for ``tokens`` local tokens."""
    cp = spec.cp
    if cp == 1:
        return 0.0
    kv = 2 * tokens * spec.kv_proj / spec.tp * spec.e
    if spec.cp_comm != "a2a":  # all_gather's ring moves as many bytes as p2p's sends
        return (cp - 1) * (2 * kv + kv * 4 / spec.e)
    q = tokens * spec.heads * spec.kv_channels / spec.tp * spec.e
    return 2 * (cp - 1) / cp * (2 * q + kv)


def plan_of(spec: MemorySpec, stages: List[StageMemory], hw: Hardware,
            step_flops: float) -> Plan:
    """The :class:`Plan` of a layout whose stage memory is known: its step time added."""
    parts = [(x.encoder_layers, x.decoder_layers, x.head, x.moe_layers)
             for x in stage_layers(spec)]
    params = max(s.states.params for s in stages)
    time = step_time(spec, hw.device(), hw.per_node, parts, params)
    return Plan(spec, stages, time, _comm_bytes(spec, stages), step_flops, spec.world)
