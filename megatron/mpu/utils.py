"""Small helpers shared by the tensor-parallel code: divisibility, splitting, vocab ranges, device."""
from typing import Tuple

import torch

from ..common.device import get_device  # noqa: F401  (mpu.get_device: its home is the base layer)


def ensure_divisibility(numerator: int, denominator: int, what: str = "value",
                        by: str = "divisor") -> None:
    """Raise ``ValueError`` unless ``denominator`` divides ``numerator``.

    Args:
        numerator: the size being split.
        denominator: the number of parts.
        what: name of the size, used in the message (e.g. ``"hidden size"``).
        by: name of the number of parts (e.g. ``"tensor-model-parallel size"``).
    """
    if denominator <= 0 or numerator % denominator != 0:
        raise ValueError(
            f"{what} ({numerator}) is not divisible by {by} ({denominator}); "
            f"choose sizes so that {numerator} % {denominator} == 0"
        )


def divide(numerator: int, denominator: int, what: str = "value", by: str = "divisor") -> int:
    """``numerator // denominator`` after checking that the division is exact."""
    ensure_divisibility(numerator, denominator, what, by)
    return numerator // denominator


def split_tensor_along_last_dim(tensor: torch.Tensor, num_partitions: int,
                                contiguous_split_chunks: bool = False) -> Tuple[torch.Tensor, ...]:
    """Split ``tensor`` into ``num_partitions`` equal views along its last dimension.

    Args:
        tensor: input tensor.
        num_partitions: number of chunks.
        contiguous_split_chunks: make each chunk contiguous (copies).
    """
    last_dim = tensor.dim() - 1
    last_dim_size = divide(tensor.size(last_dim), num_partitions, "last dimension", "partitions")
    chunks = torch.split(tensor, last_dim_size, dim=last_dim)
    if contiguous_split_chunks:
        return tuple(chunk.contiguous() for chunk in chunks)
    return chunks


class VocabUtility:
    """Which contiguous slice ``[first, last)`` of the vocabulary a tensor-parallel rank owns."""

    @staticmethod
    def vocab_range_from_per_partition_vocab_size(per_partition_vocab_size: int, rank: int,
                                                  world_size: int) -> Tuple[int, int]:
        first = rank * per_partition_vocab_size
        return first, first + per_partition_vocab_size

    @staticmethod
    def vocab_range_from_global_vocab_size(global_vocab_size: int, rank: int,
                                           world_size: int) -> Tuple[int, int]:
        per_partition = divide(global_vocab_size, world_size, "vocabulary size",
                               "tensor-model-parallel size")
        return VocabUtility.vocab_range_from_per_partition_vocab_size(per_partition, rank,
                                                                      world_size)


_V26_NAMES = ("tensor_model_parallel_size_", "pipeline_model_parallel_size_",
              "virtual_pipeline_model_parallel_size_", "pipeline_model_parallel_split_rank_")


def v26_arguments(values, v26_names):
    """``initialize_model_parallel``'s positional values with v2.6's trailing-underscore
    keywords merged in."""
    unknown = sorted(set(v26_names) - set(_V26_NAMES))
    if unknown:
        raise TypeError(f"initialize_model_parallel() got unexpected keyword(s) {unknown}; "
                        f"it takes tensor/pipeline/virtual-pipeline sizes and the split rank")
    values = list(values)
    for i, name in enumerate(_V26_NAMES):
        if name in v26_names:
            values[i] = v26_names[name]
    return values


def check_optional_size(value, name, minimum):
    """``value`` as an int >= ``minimum`` (None passes through); ValueError otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or int(value) != value or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} or None, got {value!r}")
    return int(value)


def autocast_linear_inputs(input_, weight, bias):
    """Cast to the autocast dtype as autocast's ``linear`` would (outside an autograd
    Function, so autograd casts the gradients back); returns the tensors and whether
    autocast was on."""
    device_type = input_.device.type
    if not torch.is_autocast_enabled(device_type):
        return input_, weight, bias, False
    dtype = torch.get_autocast_dtype(device_type)
    cast = [None if x is None else x.to(dtype) for x in (input_, weight, bias)]
    return cast[0], cast[1], cast[2], True
