"""Predicted time of one training step of a layout, term by term.

Every term is a roofline with stated constants (docs/memory.md, "Step time"):

- **GEMMs**: ``2 M N K`` FLOPs at ``peak x gemm_efficiency x sat(M) sat(N) sat(K)``, with
  ``sat(d) = d / (d + gemm_half)``: a thin dimension (few tokens in a micro-batch, a narrow
  tensor-parallel shard) leaves tensor cores idle; never faster than moving the operands
  through HBM, never shorter than ``kernel_floor``. Backward = 2 x forward (input and
  weight gradients).
- **Attention** (scores and context): ``4 b s^2 P / t`` FLOPs forward at
  ``attention_efficiency``; backward 2 x.
- **Elementwise** (norms, dropouts, residuals, GeLU, bias adds): bytes moved at HBM speed,
  this project's ops (or Megatron-LM's fused kernels, ``fused_elementwise``); the unfused
  attention path also moves its ``[b, a/t, s, s]`` scores and probabilities (written,
  softmax, dropout, read by the context bmm) through HBM, which SDPA does not. The backward
  moves them once more (each op reads its saved input and the incoming gradient and
  writes one gradient: about the forward's bytes; Korthikanti et al. 2022's Table 4
  layer times, docs/memory.md).
- **Recompute**: full runs the recomputed layers' forward once more (with its half of
  the tensor-parallel collectives); selective the attention core's forward (where it keeps
  ``s x s`` tensors).
- **Tensor parallel**: per layer 2 all-reduces forward and 2 backward (ring
  ``2 (t - 1) / t`` of ``s b h e``); under SP reduce-scatters and all-gathers of the same
  total plus the backward's re-gather of the QKV / fc1 input shards; not overlapped.
- **Context parallel** (``cp`` ranks, each ``s / cp`` tokens: every term above per rank,
  the attention ``4 b (s / cp) s P / t``, the causal work balanced over the ranks):
  ``p2p``: the ring's ``cp - 1`` key / value sends forward and ``cp - 1`` with the fp32
  ``dK, dV`` accumulators backward, each overlapped with one step's attention block
  (``1 / cp`` of the core), only what a send takes beyond its block counted, and the
  accumulators' last trip home; ``all_gather``: the keys and values all-gathered forward
  and again backward, their fp32 gradients reduce-scattered; ``a2a``: four all-to-alls
  forward (q, k, v, the output) and four backward; neither overlapped. The blocks are
  timed as a fused attention kernel (Megatron-core's and TransformerEngine's rings run
  one per block); this project's CUDA blocks are plain PyTorch in fp32 (docs/scale_out.md):
  slower than this on a GPU today, not measured.
- **Pipeline**: ``m x`` the slowest stage's micro-batch time + one pass of every other
  stage ``/ v`` (the bubble: Narayanan et al.'s ``(p - 1) / v`` stage passes interleaved;
  ``/ 3`` for ZB-H1 and ``/ 6`` for ZB-V, whose weight passes fill the rest: Qi et al.
  2024, with input and weight gradients each as long as the forward, as the GEMM terms
  here make them; tds's schedules reach these on the simulator), each micro-batch paying its
  p2p sends (ZB-V sends twice per stage pass, as v = 2).
- **Data parallel**: the gradient ring all-reduce over data x context ranks (ZeRO:
  reduce-scatter + all-gather, the same volume); with ``--overlap-grad-reduce`` (the
  planner's rows) the project's step hides it under the slowest stage's last micro-batch
  backward (of one chunk: ``/ v``), else it and DeepSpeed's engine run it after the
  backward.
- **MoE layers**: the router (fp32), each local expert's two GEMMs over its rows (``T k /
  E`` from each of the ``ep`` ranks under balanced routing) at the expert's width, the
  shared experts; the dispatch's two all-to-alls forward and two backward of the ``T k``
  rows over the expert-parallel group, not overlapped (:func:`ep_comm`).
- **Optimizer**: the Adam step's bytes (weights, gradients, moments, masters) at HBM speed.
"""
from dataclasses import dataclass
from typing import List, Tuple

from .activations import selective
from .spec import MemorySpec


@dataclass(frozen=True)
class Device:
    """One GPU and its links: the constants of the roofline."""

    peak_tflops: float = 989.0
    """Dense 16-bit tensor-core peak (H100 SXM; A100: 312)."""
    hbm_gbps: float = 3350.0
    """HBM bandwidth, GB/s (H100 SXM; A100 80GB: 2039)."""
    gemm_efficiency: float = 0.75
    """Share of the peak a large GEMM reaches."""
    gemm_half: int = 64
    """A GEMM dimension of this size runs at half speed (one tensor-core tile)."""
    attention_efficiency: float = 0.5
    hbm_efficiency: float = 0.8
    kernel_floor_s: float = 5e-6
    """Shortest kernel (launch latency)."""
    intra_gbps: float = 450.0
    """Collective bus bandwidth inside a node, GB/s (NVLink 4)."""
    inter_gbps: float = 50.0
    """Per GPU across nodes, GB/s (400 Gb/s InfiniBand)."""
    latency_s: float = 10e-6
    """Fixed cost of one collective or p2p message."""


#: NVIDIA H100 SXM on NDR InfiniBand (the :class:`Device` defaults).
H100 = Device()
#: NVIDIA A100 SXM 80GB in a DGX A100 (Selene): 312 TFLOP/s dense fp16/bf16, HBM2e 2039 GB/s,
#: NVLink 3 600 GB/s bidirectional (300 per direction), one 200 Gb/s HDR InfiniBand adapter
#: per GPU (25 GB/s per direction). Only hardware facts differ from :data:`H100`.
A100 = Device(peak_tflops=312.0, hbm_gbps=2039.0, intra_gbps=300.0, inter_gbps=25.0)


def _sat(d: float, half: int) -> float:
    return d / (d + half)


def gemm_time(m: int, n: int, k: int, e: int, dev: Device) -> float:
    """Seconds of one ``[m, k] x [k, n]`` GEMM, forward only.

    Args:
        m, n, k: the GEMM's sizes.
        e: bytes per element.
        dev: the device constants.
    """
    eff = dev.gemm_efficiency * _sat(m, dev.gemm_half) * _sat(n, dev.gemm_half) \
        * _sat(k, dev.gemm_half)
    compute = 2.0 * m * n * k / (dev.peak_tflops * 1e12 * eff)
    memory = (m * k + k * n + m * n) * e / (dev.hbm_gbps * 1e9 * dev.hbm_efficiency)
    return max(compute, memory, dev.kernel_floor_s)


def _collective(bytes_: float, n: int, bw_gbps: float, dev: Device, ring: float) -> float:
    """One collective over ``n`` ranks moving ``ring x bytes`` per rank."""
    if n <= 1:
        return 0.0
    return ring * (n - 1) / n * bytes_ / (bw_gbps * 1e9) + dev.latency_s


def _bw(span: int, per_node: int, dev: Device) -> float:
    return dev.intra_gbps if span <= per_node else dev.inter_gbps


def _layer_forward(spec: MemorySpec, dev: Device, tokens: int, s_kv: int,
                   cross: bool, moe: bool = False) -> Tuple[float, float]:
    """``(matmul, memory)`` seconds of one layer's forward on one rank (one micro-batch): the
    GEMMs and the attention core's FLOPs, and the HBM-bound elementwise work (norms,
    dropouts, residuals, GeLU; the unfused attention's scores); ``moe``: an MoE layer
    (:func:`_moe_forward` in the dense MLP's place)."""
    h, t, e, f = spec.hidden, spec.tp, spec.e, spec.ffn
    proj = spec.heads * spec.kv_channels
    gated = 2 if spec.gated else 1
    b = spec.micro_batch
    time = gemm_time(tokens, spec.qkv_width // t, h, e, dev) + \
        gemm_time(tokens, h, proj // t, e, dev)
    if moe:
        moe_matmul, moe_bytes = _moe_forward(spec, dev, tokens)
        time += moe_matmul
    else:
        time += gemm_time(tokens, gated * f // t, h, e, dev) + \
            gemm_time(tokens, h, f // t, e, dev)
    if cross:  # decoder: cross-attention's projections (its core: _core_forward)
        enc = s_kv * b
        time += gemm_time(tokens, proj // t, h, e, dev) + gemm_time(enc, 2 * proj // t, h, e, dev)
        time += gemm_time(tokens, h, proj // t, e, dev)
    c = t if spec.sequence_parallel else 1
    # norms, dropouts, residuals, GeLU: this project's ops read and write each once;
    # Megatron-LM's fused bias-dropout-add (1-byte mask) and bias-GeLU kernels less
    elementwise = tokens * (e * 10 * h + 2 * h) / c + tokens * e * 2 * f / t \
        if spec.fused_elementwise else tokens * e * (16 * h / c + 4 * f / t)
    if moe:  # the experts' activation instead of the dense one's
        elementwise += moe_bytes - (tokens * e * 2 * f / t if spec.fused_elementwise else
                                    tokens * e * 4 * f / t)
    core_matmul, core_memory = _core_forward(spec, dev, tokens, s_kv, cross)
    return time + core_matmul, \
        elementwise / (dev.hbm_gbps * 1e9 * dev.hbm_efficiency) + core_memory


def _moe_forward(spec: MemorySpec, dev: Device, tokens: int) -> Tuple[float, float]:
    """``(matmul seconds, HBM bytes)`` of one MoE block's forward on one rank: the fp32
    router, each local expert's two GEMMs over its ``T k / E x ep`` rows (balanced routing;
    capacity mode: its ``C x ep`` padded rows) at the expert width split over tp, the
    shared experts; the bytes of the experts' activation, the sort and the combine."""
    from .moe import expert_ffn, expert_rows, local_experts

    h, t, e = spec.hidden, spec.tp, spec.e
    gated = 2 if spec.gated else 1
    f, local = expert_ffn(spec), local_experts(spec)
    n = expert_rows(spec, tokens)
    rows = max(1, n // local)  # each local expert's
    time = gemm_time(tokens, spec.num_experts, h, 4, dev)  # the router, fp32
    time += local * (gemm_time(rows, gated * f // t, h, e, dev) +
                     gemm_time(rows, h, f // t, e, dev))
    if spec.moe_shared_ffn:
        sf = spec.moe_shared_ffn
        time += gemm_time(tokens, gated * sf // t, h, e, dev) + \
            gemm_time(tokens, h, sf // t, e, dev)
    moved = n * e * 4 * f / t + tokens * spec.moe_topk * h * (3 * e + 8)  # sort, combine
    return time, moved


def ep_comm(spec: MemorySpec, dev: Device, tokens: int, per_node: int) -> float:
    """Forward + backward expert-parallel dispatch of one MoE layer and one micro-batch:
    ``alltoall``: two all-to-alls forward (the rows out, the outputs back) and two backward,
    each of the ``T k`` rows (``(ep - 1) / ep`` of them leave the rank; capacity mode:
    the ``E C`` rows of the buffers), at the speed of the link the ep group spans (its ranks
    are tp apart: ``tp x ep`` consecutive ranks); ``allgather``: the tokens all-gathered
    and the fp32 outputs reduce-scattered, forward and backward."""
    ep = spec.ep
    if ep == 1:
        return 0.0
    from .moe import expert_rows

    bw = _bw(spec.tp * ep, per_node, dev)
    if spec.moe_dispatcher == "allgather":
        gather = _collective(tokens * ep * spec.hidden * spec.e, ep, bw, dev, ring=1.0)
        scatter = _collective(tokens * ep * spec.hidden * 4, ep, bw, dev, ring=1.0)
        return 2 * (gather + scatter)
    rows = expert_rows(spec, tokens) if spec.capacity_factor else tokens * spec.moe_topk
    one = (ep - 1) / ep * rows * spec.hidden * spec.e / (bw * 1e9) + dev.latency_s
    return 4 * one


def _core_forward(spec: MemorySpec, dev: Device, tokens: int, s_kv: int,
                  cross: bool) -> Tuple[float, float]:
    """``(matmul, memory)`` seconds of one layer's attention core forward (scores, softmax,
    dropout, context; the decoder's cross-attention core too): what selective recompute
    runs again."""
    b, proj, t = spec.micro_batch, spec.heads * spec.kv_channels, spec.tp
    sq = tokens // b
    attn = 4.0 * b * sq * sq * spec.cp * proj / t  # cp: the rank's queries, every key
    scores = _score_bytes(spec, sq, sq)
    if cross:
        attn += 4.0 * b * sq * s_kv * proj / t
        scores += _score_bytes(spec, sq, s_kv)
    return attn / (dev.peak_tflops * 1e12 * dev.attention_efficiency), \
        scores / (dev.hbm_gbps * 1e9 * dev.hbm_efficiency)


def _score_bytes(spec: MemorySpec, sq: int, skv: int) -> float:
    """HBM bytes of the unfused attention's ``[b, a/t, sq, skv]`` tensors, forward: the
    scores written, the fused softmax's read and write, attention dropout's read, write and
    1-byte mask, the context bmm's read. SDPA keeps them in on-chip memory: none."""
    if spec.attention != "unfused" or spec.ring:  # cp: fused blocks (no s x s in HBM)
        return 0.0
    e = spec.e
    per = e + 2 * e + e + (2 * e + 1 if spec.attention_dropout > 0 else 0)
    return spec.micro_batch * spec.heads / spec.tp * sq * skv * per


def _tp_comm(spec: MemorySpec, dev: Device, tokens: int, per_node: int) -> float:
    """Forward + backward tensor-parallel communication of one layer, one micro-batch."""
    act = tokens * spec.hidden * spec.e
    bw = _bw(spec.tp, per_node, dev)
    one = _collective(act, spec.tp, bw, dev, ring=2.0)  # an all-reduce (= RS + AG)
    total = 4 * one
    if spec.sequence_parallel:  # the backward all-gathers the QKV and fc1 input shards
        total += 2 * _collective(act, spec.tp, bw, dev, ring=1.0)
    return total


def _cp_comm(spec: MemorySpec, dev: Device, tokens: int, per_node: int,
             core: float) -> Tuple[float, float]:
    """``(forward + backward, forward)`` exposed seconds of one layer's context-parallel
    communication for one micro-batch (module docstring), ``core`` the seconds of its
    attention core's forward on this rank."""
    cp = spec.cp
    if cp == 1:
        return 0.0, 0.0
    bw = _bw(spec.tp * cp, per_node, dev)  # a context-parallel group spans tp x cp ranks
    kv = 2.0 * tokens * spec.kv_proj / spec.tp * spec.e  # this rank's keys and values
    if spec.cp_comm == "p2p":
        send = kv / (bw * 1e9) + dev.latency_s
        grads = kv * 4 / spec.e / (bw * 1e9) + dev.latency_s  # the fp32 accumulators
        forward = (cp - 1) * max(0.0, send - core / cp)
        backward = (cp - 1) * max(0.0, send + grads - 2 * core / cp) + grads
        return forward + backward, forward
    if spec.cp_comm == "all_gather":
        gather = _collective(kv * cp, cp, bw, dev, ring=1.0)
        return 2 * gather + _collective(kv * cp * 4 / spec.e, cp, bw, dev, ring=1.0), gather
    q = tokens * spec.heads * spec.kv_channels / spec.tp * spec.e
    heads_per_rank = (spec.kv_heads or spec.heads) // spec.tp
    kv_sent = kv if heads_per_rank % cp == 0 else 2 * q  # repeated to every query head
    forward = 2 * _collective(q, cp, bw, dev, ring=1.0) + \
        2 * _collective(kv_sent / 2, cp, bw, dev, ring=1.0)
    return 2 * forward, forward


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one step and its parts."""

    total: float
    compute: float
    """The slowest stage's forward + backward (+ recompute) of all its micro-batches."""
    tp_comm: float
    pp: float
    """Bubble and p2p on top of the steady state."""
    dp_comm: float
    optimizer: float
    bubble: float
    """Idle share of the pipeline part."""
    cp_comm: float = 0.0
    """The slowest stage's exposed context-parallel communication (in ``total``, not in
    ``tp_comm``)."""
    ep_comm: float = 0.0
    """The slowest stage's expert-parallel dispatch (in ``total``, not overlapped)."""


def _per_layer(spec: MemorySpec, dev: Device, per_node: int, decoder: bool,
               moe: bool = False):
    """``(compute, (tp comm, cp comm, ep comm), forward, (its forward parts))``
    seconds of one layer (a T5 decoder layer when ``decoder``) and one micro-batch: forward
    and backward (two GEMMs per forward GEMM, the elementwise bytes once more: each op
    reads its saved input and the gradient and writes one gradient), selective recompute's
    attention core; what full recompute would run again is the forward and its share of
    the communication; ``moe``: an MoE layer (its dispatch: :func:`ep_comm`)."""
    b = spec.micro_batch
    tokens = (spec.dec_seq if decoder else spec.seq_local) * b
    matmul, memory = _layer_forward(spec, dev, tokens, spec.seq, decoder, moe)
    forward = matmul + memory
    tp = _tp_comm(spec, dev, tokens, per_node)
    core = sum(_core_forward(spec, dev, tokens, spec.seq, decoder))
    cp, cp_forward = _cp_comm(spec, dev, tokens, per_node, core)
    compute = forward + 2 * matmul + memory
    if selective(spec):  # the attention core once more (where it keeps s x s)
        compute += core
    ep = ep_comm(spec, dev, tokens, per_node) if moe else 0.0
    return compute, (tp, cp, ep), forward, (tp / 2, cp_forward, ep / 2)


def _stage_times(spec: MemorySpec, dev: Device, layers_per_stage: List[tuple],
                 per_node: int):
    """Per stage: (compute, tp comm, cp comm, ep comm) seconds of one micro-batch, forward +
    backward (a stage's 4th entry, where given: how many of its layers are MoE)."""
    kinds = [_per_layer(spec, dev, per_node, decoder) if any(
        stage[decoder] for stage in layers_per_stage) else None for decoder in (0, 1)]
    moe = _per_layer(spec, dev, per_node, False, True) if spec.num_experts else None
    tokens = (spec.dec_seq if spec.family == "t5" else spec.seq_local) * spec.micro_batch
    head_time = 3 * gemm_time(tokens, spec.vocab // spec.tp, spec.hidden, spec.e, dev)
    out = []
    for stage in layers_per_stage:
        comp = comm = cp = ep = 0.0
        moe_layers = stage[3] if len(stage) > 3 else 0
        for kind, n in ((kinds[0], stage[0] - moe_layers), (kinds[1], stage[1]),
                        (moe, moe_layers)):
            if n:
                compute, (tp, cp_, ep_), forward, (forward_tp, forward_cp, forward_ep) = kind
                again = recomputed_layers(spec, n, stage[0] + stage[1])
                comp += n * compute + again * forward
                comm += n * tp + again * forward_tp
                cp += n * cp_ + again * forward_cp
                ep += n * ep_ + again * forward_ep
        if stage[2]:
            comp += head_time
        out.append((comp, comm, cp, ep))
    return out


def layer_times(spec: MemorySpec, dev: Device, per_node: int) -> Tuple[float, float]:
    """``(forward, backward)`` seconds of one GPT layer and one micro-batch with its
    tensor-parallel collectives, the backward with what recompute runs again (every layer
    recomputed under full recompute): the terms :func:`step_time` adds up.

    Args:
        spec: the layout.
        dev: device and link constants.
        per_node: GPUs per node.
    """
    tokens = spec.seq * spec.micro_batch
    matmul, memory = _layer_forward(spec, dev, tokens, spec.seq, False)
    act = tokens * spec.hidden * spec.e
    bw = _bw(spec.tp, per_node, dev)
    forward_comm = 2 * _collective(act, spec.tp, bw, dev, ring=2.0)
    backward_comm = _tp_comm(spec, dev, tokens, per_node) - forward_comm
    forward = matmul + memory + forward_comm
    backward = 2 * matmul + memory + backward_comm
    if selective(spec):
        backward += sum(_core_forward(spec, dev, tokens, spec.seq, False))
    elif spec.recompute == "full":
        backward += forward
    return forward, backward


def recompute_fraction(spec: MemorySpec, stage_layers: int) -> float:
    """Share of a stage's ``stage_layers`` transformer layers that full recompute runs
    again: all (uniform); block: ``recompute_num_layers`` of each of the stage's ``vpp``
    chunks (equal chunks assumed)."""
    if spec.recompute != "full" or not stage_layers:
        return 0.0
    if spec.recompute_method == "uniform":
        return 1.0
    per_chunk = stage_layers / spec.vpp
    return min(spec.recompute_num_layers, per_chunk) / per_chunk


def recomputed_layers(spec: MemorySpec, n: int, stage_layers: int) -> float:
    """Of ``n`` layers of one kind on a stage of ``stage_layers``, how many full recompute
    runs again (:func:`recompute_fraction`)."""
    return n * recompute_fraction(spec, stage_layers)


def step_time(spec: MemorySpec, dev: Device, per_node: int, layers_per_stage: List[tuple],
              params_per_rank: int) -> StepTime:
    """Predicted seconds of one step of ``spec`` (see the module docstring).

    Args:
        spec: the layout.
        dev: device and link constants.
        per_node: GPUs per node.
        layers_per_stage: per pipeline stage ``(encoder layers, decoder layers, has head)``
            and optionally the MoE layers among the encoder layers.
        params_per_rank: parameters the most loaded rank holds (gradients and optimizer).
    """
    m, p, v = spec.num_micro_batches, spec.pp, spec.vpp
    stages = _stage_times(spec, dev, layers_per_stage, per_node)
    per_mb = [sum(parts) for parts in stages]
    p2p = 0.0
    if p > 1:
        act = spec.micro_batch * (spec.seq_local + spec.dec_seq) * spec.hidden * spec.e / \
            spec.tp
        span = spec.world // p + 1  # neighbouring stages are tp x cp x dp ranks apart
        p2p = 2 * v * (act / (_bw(span, per_node, dev) * 1e9) + dev.latency_s)
    slowest = max(per_mb) + p2p
    # m passes of the slowest stage + the fill and drain: the other stages once, in chunks
    # of 1/v (interleaved: (p - 1) / v of a stage; 1F1B, v = 1: (m - 1) slowest + all)
    fill = {"zb-h1": 3, "zbv": 6}.get(spec.pipeline_schedule, v)
    pipeline = m * slowest + (sum(per_mb) + p * p2p - slowest) / fill
    bubble = 1 - m * slowest / pipeline if pipeline else 0.0
    grad_bytes = params_per_rank * (4 if spec.backend == "ddp" else spec.e)
    dp_bw = _bw(spec.world // p, per_node, dev)  # the gradients' ring: dp x cp ranks
    dp = _collective(grad_bytes, spec.grad_ranks, dp_bw, dev, ring=2.0)
    idx = per_mb.index(max(per_mb))
    if spec.overlap_grad_reduce:  # buckets reduce under the last micro-batch's backward
        # (of the slowest stage's last chunk: a chunk's buckets wait for its last pass)
        share = 2 / (3 + recompute_fraction(spec, spec.num_layers // p))
        dp = max(0.0, dp - stages[idx][0] * share / v)
    adam_bytes = 16 + 12 if spec.e == 4 else 2 + 16 + 12 + 2  # read p g m v, write p m v
    shard = spec.grad_ranks if spec.zero_stage else 1
    opt = params_per_rank * adam_bytes / shard / (dev.hbm_gbps * 1e9 * dev.hbm_efficiency)
    return StepTime(pipeline + dp + opt, m * stages[idx][0], m * stages[idx][1],
                    pipeline - m * per_mb[idx], dp, opt, bubble, m * stages[idx][2],
                    m * stages[idx][3])
