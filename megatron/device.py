"""The device this process computes on (base layer: the kernels and mpu both ask;
``mpu.get_device`` is this function)."""
import os

import torch


def get_device() -> torch.device:
    """The device this process computes on: the current CUDA device, else the CPU.

    ``MEGATRON_DEVICE=cpu`` forces the CPU on a machine that has GPUs
    (used by the CPU test-suite); ``MEGATRON_DEVICE=cuda`` insists on CUDA.
    """
    choice = os.environ.get("MEGATRON_DEVICE", "").lower()
    if choice == "cpu":
        return torch.device("cpu")
    if choice == "cuda" or torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
