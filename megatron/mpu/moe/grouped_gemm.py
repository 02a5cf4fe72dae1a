"""One GEMM per expert over rows grouped by expert: ``torch._grouped_mm`` where it runs, and
the per-expert loop it is tested against (Megatron-core's ``SequentialMLP``).

``torch._grouped_mm(x [N, k], w [G, k, n], offs)`` multiplies rows ``offs[g-1]:offs[g]`` by
``w[g]`` in one call, the group sizes read on the device (no host read). It runs on CUDA
(sm90+, bf16) and, in torch 2.13, on the CPU (bf16 and fp32), for rows whose strides are
multiples of 16 bytes (bf16: widths divisible by 8); where it does not, the first call finds
out (:func:`grouped_mm_runs`, one warning) and the loop is used, as it is for other widths.
"""
import warnings
from typing import List

import torch
import torch.nn.functional as F

_GROUPED_MM = getattr(torch, "_grouped_mm", None)


_RUNS = {}


def _probe(device_type: str, dtype: torch.dtype) -> bool:
    if _GROUPED_MM is None:
        return False
    try:
        x = torch.ones(4, 8, dtype=dtype, device=device_type, requires_grad=True)
        w = torch.ones(2, 16, 8, dtype=dtype, device=device_type, requires_grad=True)
        offs = torch.tensor([1, 4], dtype=torch.int32, device=device_type)
        y = _GROUPED_MM(x, w.transpose(-2, -1), offs=offs)
        y.backward(torch.ones_like(y))
        return True
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        warnings.warn(f"torch._grouped_mm does not run for {dtype} on {device_type} "
                      f"({str(exc).splitlines()[0][:120]}); --moe-grouped-gemm uses the "
                      f"per-expert loop there")
        return False


def grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs forward and backward for ``dtype`` on the device
    (tried once per pair, eagerly: compiled code reads the answer of the eager first call)."""
    key = (device_type, dtype)
    if key not in _RUNS:
        if torch.compiler.is_compiling():
            return _GROUPED_MM is not None
        _RUNS[key] = _probe(device_type, dtype)
    return _RUNS[key]


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear layer computes in here: autocast's when it is on, else x's."""
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return x.dtype


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``x [N, in]`` rows grouped by expert times each expert's ``weight [G, out, in]``^T.

    Args:
        x: rows, expert 0's first.
        weight: stacked ``[G, out, in]`` (nn.Linear's layout per expert).
        offsets: ``[G]`` int32, the end row of each group (``cumsum`` of the group sizes).
    """
    dtype = compute_dtype(x)
    return _GROUPED_MM(x.to(dtype), weight.to(dtype).transpose(-2, -1), offs=offsets)


def looped_linear(x: torch.Tensor, weight: torch.Tensor, sizes: List[int]) -> torch.Tensor:
    """The reference: ``F.linear`` per expert on its rows (``sizes`` read on the host).

    Args:
        x: rows, expert 0's first.
        weight: stacked ``[G, out, in]``.
        sizes: rows per expert.
    """
    parts = [F.linear(rows, weight[g]) for g, rows in enumerate(torch.split(x, sizes))]
    if not parts:
        return x.new_zeros(0, weight.shape[1])
    return torch.cat(parts)


def padded_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [G, M, in]`` (each expert's rows padded to M) times ``weight [G, out, in]``^T."""
    return torch.bmm(x, weight.transpose(1, 2))


def expert_offsets(sizes: torch.Tensor) -> torch.Tensor:
    """``[G]`` int32 end rows of the groups from their sizes (on the device)."""
    return torch.cumsum(sizes, 0).to(torch.int32)


def use_grouped(x: torch.Tensor, requested: bool, *weights: torch.Tensor) -> bool:
    """Grouped when asked, when it runs for the compute dtype and when every width of
    ``x`` and the ``[G, out, in]`` weights is a multiple of 16 bytes; else the loop."""
    if not requested:
        return False
    dtype = compute_dtype(x)
    size = torch.empty((), dtype=dtype).element_size()
    widths = [x.shape[-1]] + [d for w in weights for d in w.shape[1:]]
    if any((width * size) % 16 for width in widths):
        return False
    if torch.compiler.is_compiling() and dtype != torch.bfloat16:
        return False  # the operator's meta function (what compiling traces) takes bf16 only
    return grouped_mm_runs(x.device.type, dtype)
