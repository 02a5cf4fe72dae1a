"""The training log line: throughput, TFLOP/s per device and MFU, plus TensorBoard scalars.

The lines (and the evaluation lines) are printed by every node's first process, global rank 0
included, where people watch a run: the values a pipeline's loss stage alone computes reach
the other stages in one broadcast at the log interval (the loop's ``_shared``), never in a
step. The last rank writes the TensorBoard scalars.
"""
import math
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..common.utils import print_node_first
from ..config.run_config import RunConfig

#: Dense peaks (TFLOP/s per device) by GPU model: (bf16/fp16 tensor cores, TF32 tensor cores,
#: FP32 without tensor cores), from the vendors' data sheets (dense, not 2:4 sparse).
PEAKS = {
    "H100 SXM": (989.0, 494.0, 67.0), "H100 PCIe": (756.0, 378.0, 51.0),
    "H100 NVL": (835.0, 418.0, 60.0), "H200": (989.0, 494.0, 67.0),
    "H200 NVL": (835.0, 418.0, 60.0), "A100": (312.0, 156.0, 19.5),
    "L40S": (362.0, 183.0, 91.6), "A10": (125.0, 62.5, 31.2), "V100": (125.0, None, 15.7),
    "4090": (165.0, 82.6, 82.6), "3090": (71.0, 35.6, 35.6),
}
#: Dense FP8 tensor-core peaks (TFLOP/s per device, data sheets, not 2:4 sparse) of the GPUs
#: in :data:`PEAKS` that have FP8 (compute capability 8.9 and later).
FP8_PEAKS = {"H100 SXM": 1979.0, "H100 PCIe": 1513.0, "H100 NVL": 1671.0, "H200": 1979.0,
             "H200 NVL": 1671.0, "L40S": 733.0}
#: H100 NVL cards report 94 GB (the SXM and PCIe ones 80 GB) under a name without "NVL" on
#: some drivers: above this many bytes an H100 is taken for an NVL.
H100_NVL_MIN_BYTES = 90 * 2**30


def scalar_tag(split: str, name: str) -> str:
    """The TensorBoard / W&B tag of a scalar: ``<split>/<name>``, words joined by dashes
    (``train/lm-loss``, ``train/grad-norm``, ``validation/lm-loss``): one scheme for every
    scalar, whatever the log line calls it."""
    return f"{split}/{name.strip().lower().replace(' ', '-')}"


def model_flops_per_step(cfg: RunConfig) -> float:
    """GPT's count for one step (:func:`megatron.families.gpt2.flops_per_step`)."""
    from ..families.gpt2 import flops_per_step

    return flops_per_step(cfg)


def gpu_model(name: str, total_memory: int) -> Optional[str]:
    """The :data:`PEAKS` key of a CUDA device, or None when unknown.

    Args:
        name: ``torch.cuda.get_device_properties(...).name`` (e.g. "NVIDIA H100 PCIe").
        total_memory: its ``total_memory`` in bytes.
    """
    name = name.upper().replace("H800", "H100").replace("A800", "A100")
    if "H200" in name:
        return "H200 NVL" if "NVL" in name else "H200"
    if "H100" in name:
        if "PCIE" in name:
            return "H100 PCIe"
        nvl = "NVL" in name or total_memory > H100_NVL_MIN_BYTES
        return "H100 NVL" if nvl else "H100 SXM"
    return next((key for key in ("A100", "L40S", "A10", "V100", "4090", "3090")
                 if key in name), None)


def device_peak_tflops(name: str, total_memory: int, dtype: torch.dtype,
                       tf32: bool) -> Optional[float]:
    """Dense peak TFLOP/s of a device for a compute dtype; None for an unknown device.

    Args:
        name, total_memory: the device's properties (see :func:`gpu_model`).
        dtype: the run's compute dtype (bf16/fp16: tensor-core peak; fp32: TF32 or FP32).
        tf32: fp32 matmuls run on TF32 tensor cores (``torch.set_float32_matmul_precision``).
    """
    model = gpu_model(name, total_memory)
    if model is None:
        return None
    half, tf32_peak, fp32 = PEAKS[model]
    if dtype in (torch.float16, torch.bfloat16):
        return half
    return tf32_peak if tf32 and tf32_peak else fp32


def peak_tflops(cfg: RunConfig) -> Optional[float]:
    """Per-device peak: ``--peak-tflops``, else this GPU's for the run's precision (its name
    and memory as ``torch.cuda.get_device_properties`` reports); None on CPU or unknown GPUs."""
    if cfg.logging.peak_tflops:
        return cfg.logging.peak_tflops
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    # "high"/"medium" (or allow_tf32 = True): fp32 matmuls run on TF32 tensor cores
    tf32 = torch.get_float32_matmul_precision() != "highest"
    return device_peak_tflops(props.name, props.total_memory, cfg.precision.dtype, tf32)


def fp8_peak_tflops(cfg: RunConfig) -> Optional[float]:
    """The device's dense FP8 peak for an FP8 run (``--fp8-format``); None without FP8, on a
    CPU or on a GPU not in :data:`FP8_PEAKS`."""
    if cfg.precision.fp8 is None or not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return FP8_PEAKS.get(gpu_model(props.name, props.total_memory))


def peaks_line(cfg: RunConfig) -> Optional[str]:
    """The start-up line of an FP8 run saying which peaks its MFU figures divide by."""
    if cfg.precision.fp8 is None:
        return None
    peak, fp8 = peak_tflops(cfg), fp8_peak_tflops(cfg)
    if peak is None and fp8 is None:
        return "> MFU: n/a (no peak known for this device; --peak-tflops gives the bf16 one)"
    show = lambda p: f"{p:.0f} TFLOP/s" if p else "unknown"  # noqa: E731
    return (f"> MFU against the bf16 dense peak ({show(peak)}); 'MFU of FP8 peak' against "
            f"the FP8 dense peak ({show(fp8)})")


def throughput(cfg: RunConfig, seconds_per_step: float, flops_per_step: Optional[float] = None
               ) -> Tuple[float, float, Optional[float]]:
    """Tokens/s, TFLOP/s per device and MFU (None where it has no meaning).

    Args:
        cfg: run configuration (batch, sequence, world size, ``--peak-tflops``).
        seconds_per_step: wall time of one step.
        flops_per_step: the model's FLOPs per step (default: the GPT count).
    """
    tokens = cfg.batch.global_batch_size * cfg.batch.seq_length / seconds_per_step
    flops = flops_per_step or model_flops_per_step(cfg)
    tflops = flops / seconds_per_step / cfg.parallel.world / 1e12
    peak = peak_tflops(cfg)
    return tokens, tflops, (tflops / peak if peak else None)


def compile_seconds(cfg: RunConfig, spans: List[Tuple[float, float]]) -> float:
    """The wall seconds of a log interval in which some rank compiled (the union of every
    rank's compile spans, :func:`megatron.observability.compile_watch.union_seconds`): one gather of
    those spans at the log interval under ``--compile``, none between.

    Args:
        cfg: the run configuration.
        spans: this rank's compile spans in the interval
            (:func:`megatron.observability.compile_watch.take_spans`).
    """
    from .compile_watch import union_seconds

    if not cfg.kernels.compile or not dist.is_initialized() or dist.get_world_size() == 1:
        return union_seconds(spans)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, spans)
    return union_seconds([span for rank in every for span in rank])


def log_training_step(cfg: RunConfig, state: Any, stats: Dict[str, float], interval_s: float,
                      writer: Optional[Any], compile_s: float = 0.0) -> None:
    """Print the progress line for the last ``cfg.logging.log_interval`` steps and write scalars.

    Args:
        cfg: the run configuration.
        state: TrainState (iteration, consumed samples, skipped steps, current lr/scale,
            ``flops_per_step``: 0 when the model gave none, and TFLOP/s and MFU say n/a).
        stats: dict name -> average over the interval (loss, grad norm).
        interval_s: wall time of the interval's steps (compile time left out).
        writer: TensorBoard SummaryWriter or None.
        compile_s: seconds the interval spent in ``torch.compile`` (said apart).
    """
    steps = max(state.steps_in_interval, 1)
    seconds = interval_s / steps
    tokens_s, tflops, mfu = throughput(cfg, seconds, state.flops_per_step or 1.0)
    fp8_peak = fp8_peak_tflops(cfg)
    mfu_fp8 = tflops / fp8_peak if fp8_peak else None
    if not state.flops_per_step:  # a model that gave no count: no made-up figure
        tflops = mfu = mfu_fp8 = None
    parts = [f"iteration {state.iteration:8d}/{cfg.batch.train_iters:8d}",
             f"consumed samples: {state.consumed_train_samples:10d}",
             f"elapsed time per iteration (ms): {seconds * 1000:.1f}",
             f"learning rate: {state.lr:.3E}"]
    parts += [f"{name}: {value:.6E}" for name, value in stats.items()]
    if cfg.precision.fp16:
        parts.append(f"loss scale: {state.loss_scale:.1f}")
    parts += [f"skipped iterations: {state.skipped_in_interval:3d}",
              f"tokens/s: {tokens_s:.0f}",
              f"TFLOP/s/device: {tflops:.3g}" if tflops is not None else "TFLOP/s/device: n/a",
              f"MFU: {mfu * 100:.1f}%" if mfu is not None else "MFU: n/a"]
    if cfg.precision.fp8 is not None:  # the bf16 peak's MFU above, FP8's here
        parts.append(f"MFU of FP8 peak: {mfu_fp8 * 100:.1f}%" if mfu_fp8 is not None
                     else "MFU of FP8 peak: n/a")
    if compile_s >= 0.05:
        parts.append(f"compile (not in the step time): {compile_s:.1f} s")
    print_node_first(cfg, " | ".join(parts))
    if writer is not None:
        it = state.iteration
        for name, value in stats.items():
            writer.add_scalar(scalar_tag("train", name), value, it)
        writer.add_scalar("train/learning-rate", state.lr, it)
        writer.add_scalar("train/tokens-per-second", tokens_s, it)
        if tflops is not None:
            writer.add_scalar("train/tflops-per-device", tflops, it)
        if mfu is not None:
            writer.add_scalar("train/mfu", mfu, it)
        if mfu_fp8 is not None:
            writer.add_scalar("train/mfu-of-fp8-peak", mfu_fp8, it)
        if cfg.precision.fp16:
            writer.add_scalar("train/loss-scale", state.loss_scale, it)
        writer.add_scalar("train/skipped-iterations", state.skipped_in_interval, it)


def log_evaluation(cfg: RunConfig, iteration: int, prefix: str, loss: float,
                   writer: Optional[Any]) -> None:
    """``validation loss at iteration N | lm loss: x | lm loss PPL: y`` (every rank has the
    loss: a pipeline's evaluation shares it from the stage that computes it)."""
    ppl = math.exp(min(20.0, loss))
    line = f"{prefix} loss at iteration {iteration} | lm loss: {loss:.6E} | lm loss PPL: {ppl:.6E}"
    print_node_first(cfg, "-" * len(line) + "\n" + line + "\n" + "-" * len(line))
    if writer is not None:
        writer.add_scalar(scalar_tag(prefix, "lm loss"), loss, iteration)
        writer.add_scalar(scalar_tag(prefix, "lm loss ppl"), ppl, iteration)
