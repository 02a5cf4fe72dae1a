"""The ported tests' ``commons`` (Megatron v1.0's mpu/tests/commons.py, on the harness).

The harness (tests/harness.py) has already started torch.distributed (gloo, one process per
rank), so ``initialize_distributed`` only makes the tests' CUDA calls work where there is
no GPU: ``.cuda()`` leaves a tensor or module where it is and ``torch.cuda``'s generator,
seed and tensor-type functions act on the CPU's, which is the generator the mpu random
tracker forks without CUDA. Nothing is changed on a machine that computes on CUDA.
"""
import random

import numpy
import torch

from megatron.mpu import v1 as mpu
from megatron.mpu.utils import get_device


class IdentityLayer(torch.nn.Module):
    """A parameter of the given size (scaled normal), returned by forward."""

    def __init__(self, size, scale=1.0):
        super().__init__()
        self.weight = torch.nn.Parameter(scale * torch.randn(size))

    def forward(self):
        return self.weight


def set_random_seed(seed):
    """Seed Python, NumPy, torch and the model-parallel streams."""
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    mpu.model_parallel_cuda_manual_seed(seed)


def _emulate_cuda_on_the_cpu():
    if get_device().type == "cuda":
        return
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.nn.Module.cuda = lambda self, *args, **kwargs: self
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.initial_seed = torch.initial_seed
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, device="cuda": torch.set_rng_state(state)
    torch.cuda.FloatTensor = torch.FloatTensor
    torch.cuda.LongTensor = torch.LongTensor


def initialize_distributed(backend="nccl"):
    """torch.distributed is the harness's; see the module docstring."""
    if not torch.distributed.is_initialized():
        raise RuntimeError("run the ported v1 tests through tests/harness.py")
    _emulate_cuda_on_the_cpu()


def print_separator(message):
    """A banner from rank 0 between two barriers."""
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print(f"\n{'-' * 20} {message} {'-' * 20}", flush=True)
    torch.distributed.barrier()
