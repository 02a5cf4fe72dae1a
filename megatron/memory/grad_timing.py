"""When in a step a rank's weight gradients exist, against its activations.

DeepSpeed's engine frees every ``.grad`` after the optimizer step (``zero_grad`` with
``set_to_none``; ZeRO-1 and the BF16_Optimizer keep their flat buffers, counted as optimizer
state), so a rank allocates its gradients again during its first backward of the next step.
A rank whose activations peak before that backward (1F1B's first stage when the step has no
more micro-batches than stages, an interleaved rank whose warm-up is all its forwards) never
holds both at their largest; interleaved, a chunk's gradients appear with its own first
backward, so the first chunks' come late; under a zero-bubble schedule the GEMM weights'
gradients appear with the chunk's first weight pass, the rest with its first input pass.
The walk that weighs this is :mod:`.walk`'s (its ``grads_*`` columns).
"""
from .spec import MemorySpec


def grads_freed_each_step(spec: MemorySpec) -> bool:
    """The engine sets every ``.grad`` to None after its step (no ZeRO, or ZeRO-1); ZeRO-2
    keeps a partitioned gradient buffer, and torch DDP's buckets are counted as buffers.

    Args:
        spec: the run.
    """
    return spec.backend == "engine" and spec.zero_stage <= 1
