"""The device this process computes on (base layer: the kernels and mpu both ask;
``mpu.get_device`` is this function)."""
import contextlib
import os
from typing import Iterator, List

import torch

_OVERRIDES: List[torch.device] = []


def get_device() -> torch.device:
    """The device this process computes on: the current CUDA device, else the CPU.

    ``MEGATRON_DEVICE=cpu`` forces the CPU on a machine that has GPUs
    (used by the CPU test-suite); ``MEGATRON_DEVICE=cuda`` insists on CUDA. Inside
    :func:`device_override` it is that device.
    """
    if _OVERRIDES:
        return _OVERRIDES[-1]
    choice = os.environ.get("MEGATRON_DEVICE", "").lower()
    if choice == "cpu":
        return torch.device("cpu")
    if choice == "cuda" or torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def device_override(device) -> Iterator[None]:
    """:func:`get_device` answers ``device`` inside (e.g. ``"meta"``: a tool builds a model's
    layers for their shapes and sharding marks only, allocating nothing)."""
    _OVERRIDES.append(torch.device(device))
    try:
        yield
    finally:
        _OVERRIDES.pop()
