"""Rank bodies of tests/test_memory_peak.py: the real interleaved pipeline engine's
activations alive at once, counted per (chunk, micro-batch), next to the memory model's
per-rank figure (each chunk charged its own bytes)."""
import torch

from megatron import mpu
from memory_runs import gpt2_batch, run_config, setup


def _watch_interleaved(engine, module):
    """Count what each chunk forward saves for the backward (its own storages, parameters
    excluded) and keep the largest sum alive at once until the backward of that chunk and
    micro-batch."""
    step = engine.interleaved
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    state = {"alive": {}, "peak": 0}
    forward, backward = step.forward, step.backward

    def counted_forward(chunk, mb, inputs):
        seen = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward(chunk, mb, inputs)
        state["alive"][(chunk, mb)] = sum(seen.values())
        state["peak"] = max(state["peak"], sum(state["alive"].values()))
        return out

    def counted_backward(chunk, mb, output_grads):
        out = backward(chunk, mb, output_grads)
        state["alive"].pop((chunk, mb))
        return out

    step.forward, step.backward = counted_forward, counted_backward  # this engine only
    return state


def measure_interleaved(layouts, seed):
    """For each ``argv``: (measured, predicted) peak activation bytes on this rank during
    one real interleaved step."""
    from megatron.families import get_family
    from megatron.memory import predict, spec_from_run_config
    from megatron.training.backend_factory import build_backend

    fam = get_family("gpt2")
    out = []
    for argv in layouts:
        cfg = run_config("gpt2", argv)
        setup(cfg)
        gen = torch.Generator().manual_seed(seed)
        batches = iter([gpt2_batch(cfg, gen) for _ in range(cfg.batch.gas)])
        backend = build_backend(cfg, lambda pipeline: fam.build_model(cfg, pipeline),
                                batch_fn=lambda raw: raw)
        module = backend.module()
        state = _watch_interleaved(backend.model, module)
        backend.train()
        backend.train_step(fam.forward_step(lambda raw: raw), batches)
        spec = spec_from_run_config(cfg, device="cpu")
        stage = predict(spec)[mpu.get_pipeline_model_parallel_rank()]
        average = stage.activations_per_micro_batch * stage.in_flight  # the old figure
        out.append({"argv": " ".join(argv), "stage": stage.stage, "measured": state["peak"],
                    "predicted": stage.activations, "averaged": average})
    return out
