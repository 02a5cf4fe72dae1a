"""Rank bodies of tests/test_memory_peak_cp.py: the whole peak of a real training step per
layout (tests/memory_peak_runs.py's method), each layout with its own family."""
from memory_peak_runs import measure_peak


def measure_layouts(layouts, vocab, seed):
    """:func:`~memory_peak_runs.measure_peak` of each ``(family, argv)`` of ``layouts``."""
    return [measure_peak(argv, vocab, seed, family) for family, argv in layouts]


def attention_peaks(cases, seed):
    """Per ``(comm, dtype, heads, kv_heads, seq)`` case: what the context-parallel attention
    of this rank saves (its inputs q, k, v, views of one fused projection's output, not
    counted), and the most bytes it holds beyond what it saves, its inputs and the output's
    gradient, in its forward and in its backward: tests/peak_tracker.py on fresh random
    inputs (the context-parallel group: every rank)."""
    import gc

    import torch
    import torch.distributed as dist

    from megatron import mpu
    from peak_tracker import LivePeak

    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(1, 1, context_parallel_size=dist.get_world_size())
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    out = []
    for comm, dtype, heads, kv_heads, seq in cases:
        d, local, dt = 16, seq // dist.get_world_size(), getattr(torch, dtype)
        mixed = torch.randn(local, 1, (heads + 2 * kv_heads) * d, generator=gen).to(dt)
        mixed.requires_grad_()
        dout = torch.randn(local, 1, heads * d, generator=gen).to(dt)
        q, k, v = mixed.view(local, 1, heads + 2 * kv_heads, d).split(
            [heads, kv_heads, kv_heads], dim=2)
        inputs = {mixed.untyped_storage().data_ptr()}
        saved = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in inputs:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        dist.barrier()
        gc.collect()  # no earlier case's garbage cycle freed (or not) in the middle
        gc.disable()
        with LivePeak() as tracker:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                result = mpu.context_parallel_attention(q, k, v, None, comm_type=comm)
            forward = tracker.peak - tracker.baseline
            # the output too: the layer's next linear keeps it (p2p: the kept one itself)
            saved[result.untyped_storage().data_ptr()] = result.untyped_storage().nbytes()
            tracker.peak = start = tracker.now  # the backward's own peak from here
            result.backward(dout)
            backward = tracker.peak - start
        out.append({"saved": sum(saved.values()), "forward": forward - sum(saved.values()),
                    "backward": backward})
        gc.enable()
        del result
    return out
