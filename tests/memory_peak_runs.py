"""Rank bodies of tests/test_memory_peak.py: two real training steps per layout (tds's
pipeline engine, 1F1B or interleaved, or DeepSpeed's engine without a pipeline); the second
runs under :class:`~peak_tracker.LivePeak`, which measures the most bytes this rank holds in
tensor storages at once during the whole step (every micro-batch's forward and backward,
the tied and data-parallel gradient reductions, the optimizer step), and the peak of the
step's reduction and update on their own; next to it, the memory model's stage figures."""
import gc

import torch
import torch.distributed as dist

from megatron import mpu
from memory_runs import _reachable_tensors, _storages, gpt2_batch, run_config, setup
from peak_tracker import LivePeak, Preexisting


def _states(backend, module):
    """Bytes of this rank's parameters, gradients and optimizer tensors between steps."""
    params = _storages(module.parameters(), ())
    grads = _storages([p.grad for p in module.parameters() if p.grad is not None], params)
    optim = _storages(_reachable_tensors(backend.optimizer), set(params) | set(grads))
    return {"weights": sum(params.values()), "grads": sum(grads.values()),
            "optimizer": sum(optim.values())}


def _labels(module, backend):
    """Storage address -> "weights" / "optimizer" for what is alive between steps (the
    peak's breakdown names everything else by the op that made it)."""
    out = {}
    for p in module.parameters():
        out[p.untyped_storage()._cdata] = "weights"
    for t in _reachable_tensors(backend.optimizer):
        out.setdefault(t.untyped_storage()._cdata, "optimizer")
    return out


def _tensors_in(value):
    """Tensors in ``value`` or one level of its lists, tuples and dicts."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for t in value if torch.is_tensor(t)]
    return []


def _kept_by_runner(backend, module):
    """What the pipeline runner keeps through the step by holding each last-chunk loss with
    its graph (``ScheduleRunner.results``, tds/pipe/runner.py): ``(input, grad)`` pairs of
    the graph's leaves that are not weights (each micro-batch's received input) and their
    gradients, and the tensors the graph's custom functions keep as attributes (a
    recomputed group's RNG states). Not memory the model describes (a detached loss would
    free them)."""
    runner = getattr(getattr(backend, "schedule", None), "runner", None)
    if runner is None:
        return [], []
    params = {id(p) for p in module.parameters()}
    nodes = [getattr(loss, "grad_fn", None) for loss in runner.results.values()]
    seen, pairs, attributes = set(), [], []
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        leaf = getattr(node, "variable", None)
        if leaf is not None and id(leaf) not in params and leaf.grad is not None:
            pairs.append((leaf, leaf.grad))
        for value in getattr(node, "__dict__", {}).values():  # a custom function's ctx
            attributes += [t for t in _tensors_in(value) if id(t) not in params]
        nodes.extend(n for n, _ in node.next_functions)
    return pairs, attributes


def _kept_bytes(kept, tracker):
    """Bytes of ``kept`` (:func:`_kept_by_runner`) alive at the whole step's peak and during
    the step's reduction and update (all of them). At a peak in the micro-batches' phase a
    pair counts once its backward made the gradient (before, the input is an activation)
    and the attributes are left in."""
    pairs, attributes = kept
    storages, at_peak = {}, {}
    for leaf, grad in pairs:
        for t in (leaf, grad):
            key, size = t.untyped_storage()._cdata, t.untyped_storage().nbytes()
            storages[key] = size
            if tracker.alive_at_peak(grad) and tracker.alive_at_peak(t):
                at_peak[key] = size
    storages.update({t.untyped_storage()._cdata: t.untyped_storage().nbytes()
                     for t in attributes})
    if tracker.peak_phase == "step":  # every backward has run: all of it is only kept
        return sum(storages.values()), sum(storages.values())
    return sum(at_peak.values()), sum(storages.values())


def _mark_step_phase(backend, tracker):
    """``tracker.phase``: "schedule" while the micro-batches run, "step" from the step's
    gradient reduction on (data-parallel and tied reductions, the optimizer step): the
    project's step's ``finish_grad_sync``, or DeepSpeed's engine's reduction (which its
    backward of the step's last micro-batch calls)."""
    engine = backend.model
    own = backend.name != "deepspeed"
    names = ["finish_grad_sync"] if own else ["allreduce_gradients", "_take_model_step"]

    def marked(method):
        def run(*args, **kwargs):
            # DeepSpeed calls its reduction after every micro-batch's backward; it reduces
            # at the step's last one
            if own or engine.is_gradient_accumulation_boundary():
                tracker.phase = "step"
            return method(*args, **kwargs)
        return run

    tracker.phase = "schedule"
    for name in names:  # instance attributes: this engine only
        setattr(engine, name, marked(getattr(engine, name)))


def _count_expert_rows(module):
    """Forward pre-hooks on the model's MoE experts (dropless) recording the rows each call
    computes: ``(rows list, hook handles)``; none for a dense model or in capacity mode."""
    from megatron.mpu.moe.experts import GroupedExperts

    rows, hooks = [], []
    for m in module.modules():
        if isinstance(m, GroupedExperts):
            hooks.append(m.register_forward_pre_hook(
                lambda _, args: rows.append(args[0].shape[0]) if len(args) > 1 else None))
    return rows, hooks


def _rows_factor(cfg, spec, rows):
    """The busiest micro-batch's expert rows on this rank over the balanced ``T k`` of every
    MoE layer (``rows``: one entry per layer and micro-batch, in order; pp 1, no
    recompute)."""
    layers = sum(cfg.moe.layers(cfg.model.num_layers))
    balanced = layers * spec.seq_local * spec.micro_batch * spec.moe_topk
    per_mb = [sum(rows[i:i + layers]) for i in range(0, len(rows), layers)]
    return max(per_mb) / balanced


def measure_peak(argv, vocab, seed, family="gpt2"):
    """This rank's measured peak during the second of two training steps at ``argv``, what
    was alive at that moment by kind, and the model's stage figures; ``family`` a decoder
    family's name or import path (its batch is GPT-2's)."""
    from megatron.families import load_family
    from megatron.memory import predict, spec_from_run_config
    from megatron.training.backend_factory import build_backend

    before = Preexisting()  # an earlier layout's engine, which Python does not free
    fam = load_family(family)
    cfg = run_config(family, argv, vocab)
    setup(cfg)
    gen = torch.Generator().manual_seed(seed)
    # made as they are read (a data loader's few batches, not the whole step's in a list)
    batches = (gpt2_batch(cfg, gen) for _ in range(2 * cfg.batch.gas))
    backend = build_backend(cfg, lambda pipeline: fam.build_model(cfg, pipeline),
                            batch_fn=lambda raw: raw)
    module = backend.module()
    backend.train()
    step = fam.forward_step(lambda raw: raw)
    backend.train_step(step, batches)  # the first step allocates the optimizer's state
    dist.barrier()
    labels = _labels(module, backend)
    tracker = LivePeak(label_fn=lambda key, origin: labels.get(key, str(origin)), ignore=before)
    _mark_step_phase(backend, tracker)
    rows, hooks = _count_expert_rows(module)
    with tracker:
        backend.train_step(step, batches)
    dist.barrier()
    for hook in hooks:
        hook.remove()
    spec = spec_from_run_config(cfg, device="cpu")
    balanced = None
    if rows:  # dropless MoE: the model's rows at this rank's measured routing
        from dataclasses import replace

        balanced = predict(spec)[mpu.get_pipeline_model_parallel_rank()].peak
        spec = replace(spec, moe_rows_factor=_rows_factor(cfg, spec, rows))
    stage = predict(spec)[mpu.get_pipeline_model_parallel_rank()]
    kept_at_peak, kept = _kept_bytes(_kept_by_runner(backend, module), tracker)
    out = {"argv": " ".join(argv), "stage": stage.stage, "peak": tracker.peak,
           "baseline": tracker.baseline, "at_peak": tracker.labelled(),
           "peak_op": str(tracker.peak_op), "phases": tracker.phase_peaks,
           "states": _states(backend, module),
           "kept_by_runner": {"peak": kept_at_peak, "step": kept},
           "predicted": stage.to_dict(), "balanced_peak": balanced,
           "rows_factor": spec.moe_rows_factor}
    del backend, module, batches, tracker
    gc.collect()
    return out


def measure_peaks(layouts, vocab, seed, family="gpt2"):
    """:func:`measure_peak` for each ``argv`` in ``layouts`` (one process per rank)."""
    return [measure_peak(argv, vocab, seed, family) for argv in layouts]
