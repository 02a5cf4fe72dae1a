"""Rank bodies of tests/test_memory_peak.py: one real pipeline step (1F1B or interleaved)
per layout; its activations alive at once (per micro-batch, or per (chunk, micro-batch)),
its weights, gradients and optimizer tensors, next to the memory model's per-stage figures
(each chunk charged its own bytes)."""
import torch

from megatron import mpu
from memory_runs import (_reachable_tensors, _storages, _watch_engine, gpt2_batch, run_config,
                         setup)


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


def _states(backend, module, grads):
    """Bytes of this rank's parameters, gradients and optimizer tensors after a step."""
    params = _storages(module.parameters(), ())
    held = _storages([p.grad for p in module.parameters() if p.grad is not None], ())
    optim = _storages(_reachable_tensors(backend.optimizer), set(params) | set(held))
    return sum(params.values()) + sum(grads.values()) + sum(optim.values())


def measure_peaks(layouts, seed):
    """For each ``argv``: this rank's measured activation peak during one real step and
    its model states after it, with the model's stage figures."""
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
        grads = {}
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(lambda p: grads.update(_storages([p.grad], ())))
        watch = _watch_interleaved if cfg.parallel.vpp > 1 else _watch_engine
        state = watch(backend.model if cfg.parallel.vpp > 1 else backend, module)
        backend.train()
        backend.train_step(fam.forward_step(lambda raw: raw), batches)
        stage = predict(spec_from_run_config(cfg, device="cpu"))[
            mpu.get_pipeline_model_parallel_rank()]
        out.append({"argv": " ".join(argv), "stage": stage.stage,
                    "activations": state["peak"], "states": _states(backend, module, grads),
                    "predicted": stage.to_dict(),
                    "averaged": stage.activations_per_micro_batch * stage.in_flight})
    return out
