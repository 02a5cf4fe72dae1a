"""Rank bodies of the context-parallelism tests (tests/test_context_parallel.py)."""
import torch
import torch.distributed as dist

EOD = 0


def megatron_document_mask(tokens, eod):
    """Reference: Megatron-LM's loop (get_ltor_masks_and_position_ids with
    reset_attention_mask and reset_position_ids): ``allowed [b, s, s]`` (True = attend) and
    the position ids, built element by element as Megatron builds them."""
    b, s = tokens.shape
    allowed = torch.tril(torch.ones(b, s, s, dtype=torch.bool))
    positions = torch.arange(s).repeat(b, 1)
    for row in range(b):
        prev = 0
        for i in (tokens[row] == eod).nonzero().flatten().tolist():
            allowed[row, i + 1:, :i + 1] = False
            positions[row, i + 1:] -= i + 1 - prev
            prev = i + 1
    return allowed, positions


def reference_attention(q, k, v, allowed, scale):
    """Plain PyTorch: ``softmax(q k^T * scale, masked) v`` on ``[s, b, heads, d]`` (keys and
    values repeated to the query heads), ``[s, b, heads * d]`` out."""
    heads = q.shape[2]
    k, v = (t.repeat_interleave(heads // t.shape[2], dim=2) for t in (k, v))
    scores = torch.einsum("ibhd,jbhd->bhij", q, k) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.einsum("bhij,jbhd->ibhd", torch.softmax(scores, dim=-1), v)
    return out.reshape(q.shape[0], q.shape[1], -1)


def _tokens(b, s, generator):
    tokens = torch.randint(1, 50, (b, s), generator=generator)
    for row in range(b):  # 0-3 documents ends per row, anywhere (the last token too)
        ends = torch.randint(0, s, (int(torch.randint(0, 4, (1,), generator=generator)),),
                             generator=generator)
        tokens[row, ends] = EOD
    return tokens


def attention_errors(seed, layouts, cases):
    """Rank body: context-parallel attention at each ``(cp, tp)`` of ``layouts`` (the tp
    ranks beside run their own groups) against :func:`reference_attention` of the whole
    sequence: ``{(cp, tp, case): (errors of the output and dq, dk, dv, their scale,
    positions equal Megatron's)}`` per case ``(comm_type, documents, kv_heads, tile_bytes)``
    (``tile_bytes`` None: the CPU's fused kernel per block; a number: the plain-PyTorch
    blocks with score tiles of that many bytes)."""
    from megatron import mpu

    out = {}
    for cp, tp in layouts:
        mpu.initialize_model_parallel(tp, 1, context_parallel_size=cp)
        for number, case in enumerate(cases):
            out[(cp, tp, case)] = _attention_case(seed + number, case)
        mpu.destroy_model_parallel()
    return out


def _attention_case(seed, case):
    """One case of :func:`attention_errors`: fresh ``q, k, v`` and output gradient, the
    reference on the whole sequence, ours on this rank's chunks, gathered back."""
    from megatron import mpu
    from megatron.mpu import attention_blocks

    comm, documents, kv_heads, tile = case
    generator = torch.Generator().manual_seed(seed)
    b, s, heads, d = 2, 32, 4, 8
    q = torch.randn(s, b, heads, d, generator=generator)
    k, v = (torch.randn(s, b, kv_heads, d, generator=generator) for _ in range(2))
    dout = torch.randn(s, b, heads * d, generator=generator)
    tokens = _tokens(b, s, generator)
    allowed, positions = megatron_document_mask(tokens, EOD) if documents else \
        (torch.tril(torch.ones(b, s, s, dtype=torch.bool)), None)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    reference = reference_attention(*full, allowed, 0.3)
    reference.backward(dout)
    starts = mpu.document_starts(tokens, EOD) if documents else None
    layout = None if starts is None else mpu.token_layout(
        torch.arange(s).expand(b, s) - starts, starts)
    local = [mpu.split_for_context_parallel(t.clone(), 0).requires_grad_()
             for t in (q, k, v)]
    local_layout = None if layout is None else mpu.split_for_context_parallel(layout, 2)
    saved = attention_blocks.TILE_BYTES, attention_blocks.USE_CPU_FLASH
    # tile None: the CPU's fused kernel per block; else the plain-PyTorch blocks in tiles
    attention_blocks.TILE_BYTES = tile or saved[0]
    attention_blocks.USE_CPU_FLASH = tile is None
    try:
        result = mpu.context_parallel_attention(*local, local_layout, scale=0.3,
                                                comm_type=comm)
        result.backward(mpu.split_for_context_parallel(dout, 0))
    finally:
        attention_blocks.TILE_BYTES, attention_blocks.USE_CPU_FLASH = saved
    gathered = [mpu.gather_from_context_parallel(t, 0)
                for t in (result.detach(), *(x.grad for x in local))]
    wanted = [reference.detach(), *(x.grad for x in full)]
    errors = [(g - w).abs().max().item() for g, w in zip(gathered, wanted)]
    scale = max(w.abs().max().item() for w in wanted)
    positions_ok = positions is None or torch.equal(positions, layout[0])
    return errors, scale, positions_ok


def compiled_layer_breaks(seed):
    """Rank body (2 ranks, cp 2): dynamo's graphs and breaks for one GPT-2 layer whose
    attention is context-parallel, the functions the breaks are in, and whether the compiled
    layer's output and input gradient equal the eager layer's."""
    from megatron import mpu
    from megatron.model.compile import prepare_for_compile
    from megatron.model.transformer import ParallelTransformerLayer, TransformerConfig

    mpu.initialize_model_parallel(1, 1, context_parallel_size=2)
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                               kv_channels=8, ffn_hidden_size=64, hidden_dropout=0.0,
                               attention_dropout=0.0, seed=seed, token_layout=True)
    layer = ParallelTransformerLayer(config, 1)
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(16, 2, 32, generator=generator)  # [s / cp, b, h]
    layout = mpu.split_for_context_parallel(mpu.token_layout(torch.arange(32).expand(2, 32)), 2)
    prepare_for_compile()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer.forward)(hidden, layout)
    reasons = {str(r.user_stack[-1].name) for r in explained.break_reasons}
    results = []
    for run in (layer.forward, torch.compile(layer.forward, backend="eager")):
        x = hidden.clone().requires_grad_()
        out = run(x, layout)
        out.sum().backward()
        results.append((out.detach(), x.grad))
    same = all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*results))
    mpu.destroy_model_parallel()
    return explained.graph_count, explained.graph_break_count, reasons, same
