"""The SDPA attention (default) against Megatron's bmm + fused softmax path.

Same module, same weights, same inputs: outputs and every gradient (weights, input, T5's
relative-position table) agree, at tensor-parallel sizes 1 and 2; with dropout both drop
the same share of the probability mass and both draw from the model-parallel RNG stream.
"""
import pytest
import torch

from harness import run_distributed

TOL = dict(rtol=1e-5, atol=1e-5)


def _run_both(module, inputs, forward, upstream):
    """Output and gradients of ``forward(module, *inputs)`` under each backend."""
    results = {}
    for backend in ("sdpa", "unfused"):
        for m in module.modules():
            if hasattr(m, "attention_backend"):
                m.attention_backend = backend
        module.zero_grad(set_to_none=True)
        leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
        out = forward(module, *leaves)
        (out * upstream).sum().backward()
        grads = {n: p.grad.clone() for n, p in module.named_parameters()}
        grads["input"] = leaves[0].grad.clone()
        results[backend] = (out.detach(), grads)
    return results


def _assert_same(results):
    (out_a, grads_a), (out_b, grads_b) = results["sdpa"], results["unfused"]
    torch.testing.assert_close(out_a, out_b, **TOL)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], **TOL, msg=name)


def _init_mpu(seed):
    from megatron import mpu

    if not mpu.model_parallel_is_initialized():
        mpu.initialize_model_parallel(torch.distributed.get_world_size(), 1)
        mpu.model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)


def _gpt2_attention(seed, per_sample_mask):
    from megatron.model.transformer import ParallelSelfAttention, TransformerConfig
    from megatron.model.utils import causal_attention_mask

    _init_mpu(seed)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                               kv_channels=8, ffn_hidden_size=64, attention_dropout=0.0)
    attn = ParallelSelfAttention(config, layer_number=1)
    g = torch.Generator().manual_seed(seed + 1)
    s, b = 9, 3
    hidden = torch.randn(s, b, 32, generator=g)
    mask = causal_attention_mask(s, "cpu")
    if per_sample_mask:  # e.g. document boundaries, on top of the triangle
        mask = mask | (torch.rand(b, 1, s, s, generator=g) < 0.3)
        mask[..., torch.arange(s), torch.arange(s)] = False  # no row fully masked
    upstream = torch.randn(s, b, 32, generator=g)
    results = _run_both(attn, [hidden, mask], lambda m, h, k: m(h, k), upstream)
    _assert_same(results)
    return results["sdpa"][0]


def _all_cases(seed):
    """Every comparison in one process group (rank start-up dominates on 2 cores)."""
    outputs = [_gpt2_attention(seed, per_sample) for per_sample in (False, True)]
    outputs += [_t5_attention(seed, cross) for cross in (False, True)]
    return outputs


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_sdpa_equals_megatron_path_gpt2_and_t5(seed, tp):
    """GPT-2 (causal, with and without a per-sample mask) and T5 (self and cross, with the
    relative-position bias's gradient): values and gradients."""
    outputs = run_distributed(_all_cases, tp, seed)
    for a, b in zip(outputs[0], outputs[-1]):
        torch.testing.assert_close(a, b, **TOL)  # tp ranks agree


def _t5_attention(seed, cross):
    from megatron.model.t5_layers import RelativePositionBias, T5Attention, T5TransformerConfig

    _init_mpu(seed)
    config = T5TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                 kv_channels=8, ffn_hidden_size=64, vocab_size=64,
                                 attention_dropout=0.0, num_buckets=8, max_distance=16)
    module = torch.nn.Module()
    module.attn = T5Attention(config, cross=cross)
    module.bias = RelativePositionBias(config, bidirectional=True)
    g = torch.Generator().manual_seed(seed + 1)
    b, sq, sk = 3, 7, (11 if cross else 7)
    hidden = torch.randn(sq, b, 32, generator=g)
    encoder_output = torch.randn(sk, b, 32, generator=g)
    real_q = torch.rand(b, sq, generator=g) < 0.8  # padding: some rows fully masked
    real_k = torch.rand(b, sk, generator=g) < 0.8
    real_k[:, 0] = True
    mask = ~(real_q[:, None, :, None] & real_k[:, None, None, :])  # [b, 1, sq, sk]
    # A fully masked (padded) query row passes no gradient on Megatron's path; in training
    # nothing reads a padded position, so its upstream gradient is 0 there too.
    upstream = torch.randn(sq, b, 32, generator=g) * real_q.t()[..., None]

    def forward(m, h, k, enc):
        bias = m.bias(sq, sk)  # [1, np, sq, sk], its table gets a gradient
        if cross:
            return m.attn(h, k, position_bias=bias, encoder_output=enc)
        return m.attn(h, k, position_bias=bias)

    results = _run_both(module, [hidden, mask, encoder_output], forward, upstream)
    _assert_same(results)
    assert results["sdpa"][1]["bias.weight"].abs().sum() > 0
    return results["sdpa"][0]


def _dropout_statistics(seed):
    from megatron import mpu

    mpu.initialize_model_parallel(1, 1)
    mpu.model_parallel_cuda_manual_seed(seed)
    return {(backend, p): _dropped_share(seed, backend, p)
            for backend in ("sdpa", "unfused") for p in (0.1, 0.4)}


def _dropped_share(seed, backend, p):
    """Share of the attention probability mass each backend's dropout removes.

    With ``v`` the identity (``hn == sk``) the context row *is* the dropped probability
    row, so the dropout mask can be read off either implementation.
    """
    from megatron.model.attention import bmm_attention, sdpa_attention
    from megatron.model.fused_softmax import AttnMaskType, FusedScaleMaskSoftmax
    from megatron.model.transformer import attention_mask_func

    g = torch.Generator().manual_seed(seed)
    s, b, np_ = 16, 8, 4
    q, k = torch.randn(s, b, np_, s, generator=g), torch.randn(s, b, np_, s, generator=g)
    v = torch.eye(s).expand(b, np_, s, s).permute(2, 0, 1, 3)  # [sk, b, np, hn = sk]
    softmax = FusedScaleMaskSoftmax(False, False, AttnMaskType.causal, True,
                                    attention_mask_func, True, 0.25)
    default_rng = torch.get_rng_state()
    shares, scaled_ok = [], True
    for _ in range(20):
        if backend == "sdpa":
            out = sdpa_attention(q, k, v, scale=0.25, dropout_p=p, causal=True)
        else:
            out = bmm_attention(q, k, v, softmax, torch.nn.Dropout(p))
        probs = sdpa_attention(q, k, v, scale=0.25, dropout_p=0.0, causal=True)
        kept = out != 0
        shares.append(1 - float(probs[kept].sum() / probs.sum()))
        scaled_ok &= torch.allclose(out[kept], probs[kept] / (1 - p), rtol=1e-5, atol=1e-6)
    # dropout drew from the model-parallel stream, not from the default generator
    untouched = torch.equal(torch.get_rng_state(), default_rng)
    return sum(shares) / len(shares), scaled_ok, untouched


@pytest.mark.slow
def test_attention_dropout_same_statistics_and_tracker_stream(seed):
    stats = run_distributed(_dropout_statistics, 1, seed)[0]
    for (backend, p), (share, scaled_ok, untouched) in stats.items():
        # 20 draws of 8 x 4 x 136 probabilities: the share's std is well under 0.01
        assert abs(share - p) < 0.03, (backend, share)
        assert scaled_ok, f"{backend}: kept probabilities are not scaled by 1/(1-p)"
        assert untouched, f"{backend}: attention dropout used the default generator"


def test_attention_backend_spellings():
    from megatron.common.errors import ConfigError
    from megatron.model.attention import resolve_attention_backend

    assert {resolve_attention_backend(n) for n in ("auto", "flash", "fused", "sdpa", None)} \
        == {"sdpa"}
    assert {resolve_attention_backend(n) for n in ("unfused", "local")} == {"unfused"}
    with pytest.raises(ConfigError, match="unknown attention backend"):
        resolve_attention_backend("triton")


def test_a_masked_fp16_cuda_call_leaves_cudnn_out(monkeypatch, seed):
    # cuDNN's masked SDPA backward stopped T5 fp16 training on an H100 (issue 38): an fp16
    # call with a mask tensor on CUDA may use every kernel but cuDNN's; bf16 and fp32 calls,
    # unmasked calls and CPU calls keep PyTorch's pick among all (issue 43).
    from torch.nn.attention import SDPBackend

    from megatron.model import attention

    masked = attention.sdpa_backends_for("cuda", True, torch.float16)
    assert SDPBackend.CUDNN_ATTENTION not in masked and SDPBackend.MATH in masked
    assert SDPBackend.EFFICIENT_ATTENTION in masked
    for dtype in (torch.bfloat16, torch.float32):
        assert attention.sdpa_backends_for("cuda", True, dtype) is None
    assert attention.sdpa_backends_for("cuda", False, torch.float16) is None
    assert attention.sdpa_backends_for("cpu", True, torch.float16) is None
    # the restricted call computes the same (run here on the CPU's kernels of the list)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(16, 2, 4, 8, generator=g) for _ in range(3))
    bias = torch.randn(1, 4, 16, 16, generator=g)
    mask = torch.rand(2, 1, 16, 16, generator=g) < 0.3
    free = attention.sdpa_attention(q, k, v, scale=1.0, dropout_p=0.0, mask=mask, bias=bias)
    calls = []
    monkeypatch.setattr(attention, "sdpa_backends_for",
                        lambda device, has_mask, dtype: calls.append(has_mask) or
                        (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH))
    kept = attention.sdpa_attention(q, k, v, scale=1.0, dropout_p=0.0, mask=mask, bias=bias)
    assert calls == [True]
    torch.testing.assert_close(kept, free)


def _t5_sdpa_calls(seed):
    """Every SDPA call of a T5Model forward and backward (tp 1, SDPA backend), fp32 and under
    bf16 autocast: per call the query dtype, the mask's dtype, last-dim stride, storage,
    whether it carries a gradient, and the kernels the call would ask for on CUDA."""
    from megatron.model import attention
    from megatron.model.t5_layers import T5TransformerConfig
    from megatron.model.t5_model import T5Model, t5_attention_masks

    _init_mpu(seed)
    config = T5TransformerConfig(num_layers=3, hidden_size=32, num_attention_heads=4,
                                 kv_channels=8, ffn_hidden_size=64, vocab_size=64,
                                 hidden_dropout=0.0, attention_dropout=0.0)
    model = T5Model(config)
    g = torch.Generator().manual_seed(seed)
    enc, dec, labels = (torch.randint(64, (2, n), generator=g) for n in (16, 8, 8))
    enc_real = torch.rand(2, 16, generator=g) > 0.2
    enc_real[:, 0] = True
    masks = t5_attention_masks(enc_real, torch.ones(2, 8, dtype=torch.bool))
    calls, original = [], attention.F.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, **kwargs):
        m = attn_mask
        calls.append((q.dtype, None if m is None else (m.dtype, m.stride(-1), m.shape,
                                                       m.untyped_storage().data_ptr(),
                                                       m.requires_grad),
                      attention.sdpa_backends_for("cuda", m is not None, q.dtype)))
        return original(q, k, v, attn_mask=attn_mask, **kwargs)

    attention.F.scaled_dot_product_attention = record
    out = {}
    try:
        for name, autocast in (("fp32", False), ("bf16", True)):
            calls.clear()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                model(enc, dec, *masks, labels=labels).sum().backward()
            out[name] = list(calls)
    finally:
        attention.F.scaled_dot_product_attention = original
    return out


def test_t5_attention_masks_fit_the_fused_kernels(seed):
    """Issue 43: T5's self-attention took SDPA's math path on the H100 (its bias a permuted
    view, last-dim stride np). Each call now passes a mask whose last dimension is contiguous
    and whose dtype is the queries' (what the memory-efficient and cuDNN kernels need); the
    bias and padding are folded once per stack (every layer of a stack passes the same
    tensor); the self-attention masks carry the bias's gradient; and on CUDA an fp16 masked
    call leaves cuDNN out while a bf16 one may use it."""
    from torch.nn.attention import SDPBackend

    results = run_distributed(_t5_sdpa_calls, 1, seed)[0]
    for name, calls in results.items():
        assert len(calls) == 3 * 3, name  # encoder self, decoder self and cross, 3 layers
        for q_dtype, mask, backends in calls:
            m_dtype, stride, _, _, _ = mask
            assert (m_dtype, stride) == (q_dtype, 1), (name, mask)
            assert backends is None, (name, backends)  # fp32 / bf16: every kernel
        # per stack (encoder self; decoder self, cross: interleaved), one mask per kind
        enc, dec = calls[:3], calls[3:]
        assert len({c[1][3] for c in enc}) == 1, name
        assert len({c[1][3] for c in dec[0::2]}) == 1 and len({c[1][3] for c in dec[1::2]}) == 1
        assert all(c[1][4] for c in enc) and all(c[1][4] for c in dec[0::2])  # bias's grad
        assert not any(c[1][4] for c in dec[1::2])  # the cross mask has no bias
    assert {c[0] for c in results["bf16"]} == {torch.bfloat16}
    from megatron.model.attention import sdpa_backends_for

    assert SDPBackend.CUDNN_ATTENTION not in sdpa_backends_for("cuda", True, torch.float16)
