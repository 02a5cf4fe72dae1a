"""The training log line: throughput, TFLOP/s per device and MFU, plus TensorBoard scalars."""
import math

import torch

from ..utils import print_rank_last

#: Dense fp16/bf16 tensor-core peaks (TFLOP/s per device), by a substring of the GPU name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0,
               "L40S": 362.0, "A10": 125.0, "V100": 125.0, "4090": 165.0, "3090": 71.0}


def model_flops_per_step(cfg):
    """Megatron's GPT count for one step (:func:`megatron.families.gpt2.flops_per_step`)."""
    from ..families.gpt2 import flops_per_step

    return flops_per_step(cfg)


def peak_tflops(cfg):
    """Per-device peak from ``--peak-tflops`` or the GPU name; None on CPU or unknown GPUs."""
    if cfg.logging.peak_tflops:
        return cfg.logging.peak_tflops
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def throughput(cfg, seconds_per_step, flops_per_step=None):
    """Tokens/s, TFLOP/s per device and MFU (None where it has no meaning).

    Args:
        cfg: run configuration (batch, sequence, world size, ``--peak-tflops``).
        seconds_per_step: wall time of one step.
        flops_per_step: the model's FLOPs per step (default: Megatron's GPT count).
    """
    tokens = cfg.batch.global_batch_size * cfg.batch.seq_length / seconds_per_step
    flops = flops_per_step or model_flops_per_step(cfg)
    tflops = flops / seconds_per_step / cfg.parallel.world / 1e12
    peak = peak_tflops(cfg)
    return tokens, tflops, (tflops / peak if peak else None)


def log_training_step(cfg, state, stats, interval_s, writer):
    """Print the progress line for the last ``cfg.logging.log_interval`` steps and write scalars.

    Args:
        cfg: the run configuration.
        state: TrainState (iteration, consumed samples, skipped steps, current lr/scale).
        stats: dict name -> average over the interval (loss, grad norm).
        interval_s: wall time of the interval.
        writer: TensorBoard SummaryWriter or None.
    """
    steps = max(state.steps_in_interval, 1)
    seconds = interval_s / steps
    tokens_s, tflops, mfu = throughput(cfg, seconds, state.flops_per_step)
    parts = [f"iteration {state.iteration:8d}/{cfg.batch.train_iters:8d}",
             f"consumed samples: {state.consumed_train_samples:10d}",
             f"elapsed time per iteration (ms): {seconds * 1000:.1f}",
             f"learning rate: {state.lr:.3E}"]
    parts += [f"{name}: {value:.6E}" for name, value in stats.items()]
    if cfg.precision.fp16:
        parts.append(f"loss scale: {state.loss_scale:.1f}")
    parts += [f"skipped iterations: {state.skipped_in_interval:3d}",
              f"tokens/s: {tokens_s:.0f}", f"TFLOP/s/device: {tflops:.3g}",
              f"MFU: {mfu * 100:.1f}%" if mfu is not None else "MFU: n/a"]
    print_rank_last(" | ".join(parts))
    if writer is not None:
        it = state.iteration
        for name, value in stats.items():
            writer.add_scalar(f"train/{name}", value, it)
        writer.add_scalar("train/learning-rate", state.lr, it)
        writer.add_scalar("train/tokens-per-second", tokens_s, it)
        writer.add_scalar("train/tflops-per-device", tflops, it)
        if mfu is not None:
            writer.add_scalar("train/mfu", mfu, it)
        if cfg.precision.fp16:
            writer.add_scalar("train/loss-scale", state.loss_scale, it)
        writer.add_scalar("train/skipped-iterations", state.skipped_in_interval, it)


def log_evaluation(cfg, iteration, prefix, loss, writer):
    """``validation loss at iteration N | lm loss: x | lm loss PPL: y``."""
    ppl = math.exp(min(20.0, loss))
    line = f"{prefix} loss at iteration {iteration} | lm loss: {loss:.6E} | lm loss PPL: {ppl:.6E}"
    print_rank_last("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
    if writer is not None:
        writer.add_scalar(f"{prefix}/lm-loss", loss, iteration)
        writer.add_scalar(f"{prefix}/lm-loss-ppl", ppl, iteration)
