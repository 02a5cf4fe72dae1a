"""Rank bodies of tests/test_memory_model.py: build a tiny model at a layout, measure what
one micro-batch saves for the backward (saved-tensor hooks) and what a rank holds after a
real optimizer step, next to the memory model's prediction for the same configuration."""
import torch
import torch.distributed as dist

from megatron import mpu

VOCAB = 256  # padded rows (divisible by tp up to 4)


def run_config(family, argv, vocab=VOCAB):
    """A validated RunConfig of ``argv`` for this launch (no tokenizer files: the padded
    vocabulary, ``vocab`` rows, is set directly); ``family`` a name or an import path
    (``examples.llama.llama_model:LLAMA``)."""
    from megatron.config import build_run_config
    from megatron.families import load_family

    cfg, _ = build_run_config(argv, load_family(family), world_size=dist.get_world_size(),
                              rank=dist.get_rank(), check_files=False)
    return cfg.replace(padded_vocab_size=vocab, true_vocab_size=vocab - 3)


def setup(cfg):
    """mpu groups of ``cfg``'s layout (replacing the previous layout's), seeds, tds comm."""
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp,
                                  context_parallel_size=cfg.parallel.cp,
                                  expert_model_parallel_size=cfg.parallel.ep)
    torch.manual_seed(cfg.model.seed)
    mpu.model_parallel_cuda_manual_seed(cfg.model.seed)
    import tds

    tds.init_distributed(dist_backend="gloo")
    from megatron.fused_kernels import kernels_available

    # the kernel build agrees across ranks by a collective: run it on every rank here, not
    # inside a pipeline's first forward on rank 0 while the others wait for its activation
    kernels_available("cpu")


def gpt2_batch(cfg, gen):
    """Fresh random ``(inputs, labels)`` of one micro-batch, the same on every rank (under
    context parallelism: this rank's chunks, with the token layout in the mask slot, as
    the decoder's batch function cuts them)."""
    from megatron.families.base import uses_token_layout
    from megatron.families.decoder_lm import _layout_batch
    from megatron.model.utils import get_ltor_masks_and_position_ids

    b, s = cfg.batch.micro_batch_size, cfg.batch.seq_length
    text = torch.randint(0, cfg.model.true_vocab_size, (b, s + 1), generator=gen)
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    if uses_token_layout(cfg):
        return _layout_batch(cfg, tokens, labels, 0, False)
    mask, loss_mask, pos = get_ltor_masks_and_position_ids(tokens, 0, False)
    return (tokens, pos, mask), (labels, loss_mask)


def t5_batch(cfg, gen):
    """Fresh random T5 ``(inputs, labels)`` of one micro-batch (every position real)."""
    from megatron.model.t5_model import t5_attention_masks

    b, se, sd = cfg.batch.micro_batch_size, cfg.t5.enc_seq_length, cfg.t5.dec_seq_length
    enc = torch.randint(2, VOCAB - 3, (b, se), generator=gen)
    dec = torch.randint(2, VOCAB - 3, (b, sd), generator=gen)
    labels = torch.randint(2, VOCAB - 3, (b, sd), generator=gen)
    masks = t5_attention_masks(torch.ones(b, se, dtype=torch.bool),
                               torch.ones(b, sd, dtype=torch.bool))
    return (enc, dec, *masks), (labels, torch.ones(b, sd))


def _stage_input(cfg, model, inputs, gen):
    """What this pipeline stage receives for one micro-batch: the batch on the first
    stage, fresh hidden states (and the batch's masks) elsewhere."""
    if mpu.is_pipeline_first_stage():
        return inputs
    h, tp = cfg.model.hidden_size, cfg.parallel.tp
    split = tp if cfg.parallel.sequence_parallel else 1
    b = cfg.batch.micro_batch_size

    def hidden(s):
        return torch.randn(s // split, b, h, generator=gen).requires_grad_()

    if cfg.family != "t5":  # a decoder's (hidden, mask)
        return hidden(cfg.batch.seq_length), inputs[2]
    enc, dec = hidden(cfg.t5.enc_seq_length), hidden(cfg.t5.dec_seq_length)
    return enc, inputs[2], dec, inputs[3], inputs[4]


def saved_bytes(cfg, model, inputs, labels, loss_fn, pipeline, gen):
    """Bytes one micro-batch's forward saves for the backward on this rank (every
    storage once, parameters excluded), then the backward runs (the graph is real)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    dtype = cfg.precision.dtype
    autocast = torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32)
    with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        if pipeline:
            out = model(_stage_input(cfg, model, inputs, gen))
            last = mpu.is_pipeline_last_stage()
            out = loss_fn(out, labels) if last else out
        else:
            out = loss_fn(model(*inputs), labels)
    first = out[0] if isinstance(out, tuple) else out
    first.float().sum().backward()
    return sum(seen.values())


def measure_activations(family, layouts, seed):
    """For each ``argv`` in ``layouts``: (measured, predicted) activation bytes of one
    micro-batch on this rank, and the stage's in-flight count."""
    from megatron.families import load_family
    from megatron.memory import predict, spec_from_run_config

    fam = load_family(family)
    out = []
    for argv in layouts:
        cfg = run_config(family, argv)
        setup(cfg)
        gen = torch.Generator().manual_seed(seed)
        inputs, labels = (t5_batch if family == "t5" else gpt2_batch)(cfg, gen)
        pipeline = cfg.parallel.pp > 1
        model = fam.build_model(cfg, pipeline)
        model.train()
        try:
            measured = saved_bytes(cfg, model, inputs, labels, fam.loss_fn, pipeline, gen)
        except Exception as exc:
            raise RuntimeError(f"at {argv}") from exc
        stages = predict(spec_from_run_config(cfg, device="cpu"))
        stage = stages[mpu.get_pipeline_model_parallel_rank()]
        # a micro-batch's saved tensors include autocast's weight copies, which the step's
        # micro-batches share (the model counts them once per rank)
        out.append({"argv": " ".join(argv), "measured": measured,
                    "predicted": stage.activations_per_micro_batch + stage.weight_copies,
                    "in_flight": stage.in_flight, "stage": stage.stage})
    return out


def _storages(tensors, skip):
    """``{data_ptr: nbytes}`` of the tensors' storages, those in ``skip`` left out."""
    out = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip and storage.nbytes():
            out[storage.data_ptr()] = storage.nbytes()
    return out


def _reachable_tensors(obj, depth=8, seen=None):
    """Tensors an optimizer holds: its state, its master copies and partitions, found
    through its attributes, lists and dicts (DeepSpeed's optimizers keep them there)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return []
    seen.add(id(obj))
    if torch.is_tensor(obj):
        return [obj]
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    elif isinstance(obj, torch.optim.Optimizer) or type(obj).__module__.startswith(
            ("deepspeed", "megatron", "tds")):
        items = list(vars(obj).values())
    else:
        return []
    return [t for item in items for t in _reachable_tensors(item, depth - 1, seen)]


def _watch_engine(backend, module):
    """Count what each of the pipeline engine's forward passes saves for the backward (its
    own (chunk, micro-batch)'s storages, parameters excluded) and the largest sum alive at
    once between a forward and its backward: the engine's real schedule, run by tds's
    runner through the pipeline schedule's callbacks (``backend.schedule``)."""
    step = backend.schedule
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


def measure_states(family, layouts, seed):
    """For each ``argv`` in ``layouts``: the bytes this rank holds for parameters, for
    gradients (every storage a gradient lands in during one real step) and for the
    optimizer (everything else its optimizer reaches after the step), next to the memory
    model's figures."""
    from megatron.families import get_family
    from megatron.memory import predict, spec_from_run_config
    from megatron.training.backend_factory import build_backend

    fam = get_family(family)
    out = []
    for argv in layouts:
        cfg = run_config(family, argv)
        setup(cfg)
        gen = torch.Generator().manual_seed(seed)
        make = gpt2_batch if family == "gpt2" else t5_batch
        batches = iter([make(cfg, gen) for _ in range(cfg.batch.gas)])
        backend = build_backend(cfg, lambda pipeline: fam.build_model(cfg, pipeline),
                                batch_fn=lambda raw: raw)
        module = backend.module()
        grads = {}

        def record(p):
            grads.update(_storages([p.grad], ()))

        for p in module.parameters():
            p.register_post_accumulate_grad_hook(record)
        alive = _watch_engine(backend, module) if cfg.parallel.pp > 1 else None
        backend.train()
        backend.train_step(fam.forward_step(lambda raw: raw), batches)
        params = _storages(module.parameters(), ())
        # a freed gradient's address may be reused: skip only the gradients still held
        held = _storages([p.grad for p in module.parameters() if p.grad is not None], ())
        optim = _storages(_reachable_tensors(backend.optimizer), set(params) | set(held))
        stage = predict(spec_from_run_config(cfg, device="cpu"))[
            mpu.get_pipeline_model_parallel_rank()]
        if alive is not None:  # the real engine's in-flight activations, at their peak
            out.append({"argv": " ".join(argv), "stage": stage.stage,
                        "measured": [alive["peak"]], "predicted": [stage.activations],
                        "what": ["in-flight activations"]})
        out.append({"argv": " ".join(argv), "stage": stage.stage,
                    "what": ["weights", "grads", "optimizer"],
                    "measured": [sum(params.values()), sum(grads.values()),
                                 sum(optim.values())],
                    "predicted": [stage.states.weight_bytes, stage.states.grad_bytes,
                                  stage.states.optimizer_bytes]})
    return out


def pretrain_stdout(argv):
    """Rank body: run pretrain_gpt2.main(argv) and return what it printed."""
    import contextlib
    import io

    import pretrain_gpt2

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        pretrain_gpt2.main(argv)
    return text.getvalue()
