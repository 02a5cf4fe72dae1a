"""The MoE block in one process against an independent implementation (tests/moe_reference.py:
every token through every expert, the routing and losses from the papers' definitions, the
Switch paper's capacity by a loop): values, routing losses, gradients; grouped GEMM against
the per-expert loop; the expert-bias update; the routing statistics; bad settings."""
import contextlib
from unittest import mock

import pytest
import torch

import moe_reference as ref
from megatron import mpu
from megatron.common.errors import ConfigError
from megatron.mpu import moe

H, F_, E = 16, 24, 8


@pytest.fixture(autouse=True, scope="module")
def one_rank():
    """A world of one rank (the mpu layers of the shared experts need groups)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mpu.initialize_model_parallel(1, 1)
    yield
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


def _config(**kw):
    base = dict(num_experts=E, topk=2, hidden_size=H, ffn_hidden_size=F_,
                aux_loss_coeff=0.01, z_loss_coeff=0.001, init_method_std=0.2)
    base.update(kw)
    return moe.MoEConfig(**base)


def _layer(cfg, seed):
    torch.manual_seed(seed)
    layer = moe.MoELayer(cfg, layer_number=1)
    if cfg.enable_expert_bias:  # a bias that changes the choice
        layer.router.expert_bias.copy_(torch.randn(cfg.num_experts) * 0.3)
    return layer


@contextlib.contextmanager
def _only_grouped(grouped):
    """With grouped GEMM asked (and aligned widths), the per-expert loop must not run."""
    if not grouped:
        yield
        return

    def refuse(*_):
        raise AssertionError("the per-expert loop ran although grouped GEMM was asked")

    with mock.patch("megatron.mpu.moe.experts.looped_linear", refuse):
        yield


def _check_against_reference(cfg, seed, s=6, b=4, scale=1.0, capacity_factor=None):
    layer = _layer(cfg, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(s, b, H, generator=gen, requires_grad=True)
    g = torch.randn(s, b, H, generator=gen)
    moe.set_aux_loss_scale(scale)
    try:
        with _only_grouped(cfg.grouped_gemm and capacity_factor is None):
            out = layer(x)
            (out * g).sum().backward()
    finally:
        moe.set_aux_loss_scale(1.0)
    w = {k: v.requires_grad_() for k, v in ref.full_weights(layer).items()}
    x64 = x.detach().double().reshape(s * b, H).requires_grad_()
    r_out, losses, keep, _ = ref.moe_forward(x64, w, cfg, b, capacity_factor)
    (r_out * g.double().reshape(s * b, H)).sum().add(scale * sum(losses.values())).backward()
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.detach().double().reshape(s * b, H), r_out.detach(), **close)
    torch.testing.assert_close(x.grad.double().reshape(s * b, H), x64.grad, **close)
    for name, param in (("router", layer.router.weight), ("w1", layer.experts.weight1),
                        ("w2", layer.experts.weight2)):
        torch.testing.assert_close(param.grad.double(), w[name].grad, **close)
    stats = moe.routing_statistics(layer, num_layers=1)
    for kind in moe.LOSS_KINDS:
        expected = losses[kind].item() if kind in losses else 0.0
        assert stats[kind].item() == pytest.approx(expected, rel=1e-5, abs=1e-9)
    assert stats["dropped_tokens"].item() == (~keep).sum().item()
    return layer, stats


@pytest.mark.parametrize("kw", [
    dict(),                                                            # Mixtral's router
    dict(topk=1, pre_softmax=True, activation="relu"),                 # Switch
    dict(score_function="sigmoid", topk=3, enable_expert_bias=True,    # DeepSeek-V3
         load_balancing_type="seq_aux_loss", activation="swiglu",
         shared_expert_intermediate_size=20),
    dict(pre_softmax=True, activation="geglu", grouped_gemm=True, z_loss_coeff=0.0),
    dict(load_balancing_type="none", grouped_gemm=True, shared_expert_intermediate_size=8),
])
def test_layer_equals_reference(kw, seed):
    _check_against_reference(_config(**kw), seed, scale=0.5 if kw.get("topk") == 1 else 1.0)


@pytest.mark.parametrize("policy", ["position", "probs"])
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_capacity_equals_switch_paper(policy, dispatcher, seed):
    """Dropped choices and outputs equal the Switch paper's capacity computed by a loop."""
    cfg = _config(topk=1 if policy == "position" else 2, pre_softmax=policy == "position",
                  capacity_factor=1.0, token_drop_policy=policy, dispatcher=dispatcher)
    _, stats = _check_against_reference(cfg, seed, s=8, b=4, capacity_factor=1.0)
    assert stats["dropped_tokens"].item() > 0  # routed this way, some expert overflows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_loop(dtype, seed):
    """torch._grouped_mm against F.linear per expert: values and both gradients, groups of
    every size including empty ones."""
    from megatron.mpu.moe import grouped_gemm as gg

    if not gg.grouped_mm_runs("cpu", dtype):
        pytest.skip(f"torch._grouped_mm does not run for {dtype} on this CPU")
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 7, (5,), generator=gen)
    sizes[seed % 5] = 0  # an empty group
    n = int(sizes.sum())
    x = torch.randn(n, 16, generator=gen).to(dtype)
    w = torch.randn(5, 24, 16, generator=gen).to(dtype)
    grad = torch.randn(n, 24, generator=gen).to(dtype)
    outs = []
    for fn in (lambda a, b: gg.grouped_linear(a, b, gg.expert_offsets(sizes)),
               lambda a, b: gg.looped_linear(a, b, sizes.tolist())):
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(a, b)
        y.backward(grad)
        outs.append((y.float(), a.grad.float(), b.grad.float()))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for got, want in zip(*outs):
        torch.testing.assert_close(got, want, **tol)


def test_grouped_layer_equals_looped_layer_bf16(seed):
    """The whole layer under bf16 autocast: grouped GEMM and the loop agree to bf16's rounding."""
    results = []
    for grouped in (True, False):
        layer = _layer(_config(grouped_gemm=grouped, activation="swiglu"), seed)
        x = torch.randn(4, 3, H, generator=torch.Generator().manual_seed(seed),
                        requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
        out.float().square().sum().backward()
        results.append((out.float(), x.grad, layer.experts.weight1.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2)


def test_expert_bias_update(seed):
    """Loads counted over the step's forwards, bias += rate * sign(mean - load), reset."""
    cfg = _config(score_function="sigmoid", enable_expert_bias=True, bias_update_rate=0.01)
    layer = _layer(cfg, seed)
    before = layer.router.expert_bias.clone()
    w = ref.full_weights(layer)
    loads = torch.zeros(E, dtype=torch.float64)
    for i in range(2):  # two micro-batches
        x = torch.randn(5, 2, H, generator=torch.Generator().manual_seed(seed + i))
        layer(x).sum().backward()
        _, _, _, experts = ref.moe_forward(x.double().reshape(-1, H), w, cfg, 2)
        loads += torch.zeros(E, dtype=torch.float64).index_add_(
            0, experts.reshape(-1), torch.ones(experts.numel(), dtype=torch.float64))
    layer.eval()
    layer(torch.randn(5, 2, H))  # an evaluation forward counts nothing
    moe.update_expert_bias(layer)
    expected = before.double() + 0.01 * torch.sign(loads.mean() - loads)
    torch.testing.assert_close(layer.router.expert_bias.double(), expected)
    assert layer.router.local_tokens_per_expert.abs().sum() == 0


def test_recompute_counts_once_and_keeps_gradients(seed):
    """Under activation recompute the statistics count each micro-batch once and the
    gradients (routing losses included) equal the run without it."""
    grads, stats = [], []
    for recompute in (False, True):
        layer = _layer(_config(), seed)
        x = torch.randn(4, 2, H, generator=torch.Generator().manual_seed(seed),
                        requires_grad=True)
        out = mpu.checkpoint(layer, x) if recompute else layer(x)
        out.square().sum().backward()
        grads.append((x.grad, layer.router.weight.grad, layer.experts.weight2.grad))
        stats.append(moe.routing_statistics(layer, 1))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for key in stats[0]:
        torch.testing.assert_close(stats[1][key], stats[0][key], rtol=0, atol=0)


def test_routing_statistics_tokens_per_expert(seed):
    cfg = _config()
    layer = _layer(cfg, seed)
    layer.layer_number = 2
    x = torch.randn(6, 2, H, generator=torch.Generator().manual_seed(seed))
    layer(x)
    _, _, _, experts = ref.moe_forward(x.double().reshape(-1, H), ref.full_weights(layer), cfg, 2)
    counts = torch.bincount(experts.reshape(-1), minlength=E).double()
    stats = moe.routing_statistics(layer, num_layers=3)
    torch.testing.assert_close(stats["tokens_per_expert_max"].double(),
                               torch.tensor([0.0, counts.max(), 0.0], dtype=torch.float64))
    torch.testing.assert_close(stats["tokens_per_expert_mean"].double(),
                               torch.tensor([0.0, counts.mean(), 0.0], dtype=torch.float64))
    again = moe.routing_statistics(layer, num_layers=3)  # read resets
    assert again["tokens_per_expert_max"].abs().sum() == 0


@pytest.mark.parametrize("kw, words", [
    (dict(topk=9), "--moe-router-topk (9) must be between 1 and --num-experts (8)"),
    (dict(capacity_factor=0.0), "--moe-expert-capacity-factor must be > 0"),
    (dict(capacity_factor=-1.5), "--moe-expert-capacity-factor must be > 0"),
    (dict(num_experts=0, topk=1), "--num-experts must be >= 1"),
    (dict(score_function="tanh"), "--moe-router-score-function must be one of"),
    (dict(load_balancing_type="sinkhorn"), "--moe-router-load-balancing-type must be one of"),
    (dict(dispatcher="flex"), "--moe-token-dispatcher-type must be one of"),
    (dict(aux_loss_coeff=-1.0), "--moe-aux-loss-coeff must be >= 0"),
])
def test_bad_config_refused(kw, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        _config(**kw)


def test_sequence_parallel_refused():
    with pytest.raises(NotImplementedError, match="--sequence-parallel with MoE"):
        moe.MoELayer(_config(), 1, sequence_parallel=True)


@pytest.mark.parametrize("kw, dtype, breaks", [
    (dict(capacity_factor=1.25), torch.float32, 0),                     # static: one graph
    pytest.param(dict(capacity_factor=1.25, dispatcher="allgather"), torch.bfloat16, 0,
                 marks=pytest.mark.exhaustive),
    (dict(grouped_gemm=True), torch.bfloat16, 0),                       # ep 1, sizes on device
    pytest.param(dict(grouped_gemm=False), torch.float32, 4,            # the loop reads sizes
                 marks=pytest.mark.exhaustive),
])
def test_compiled_graph_breaks(kw, dtype, breaks):
    """What torch.compile makes of the layer (ep 1): the static capacity form and grouped
    GEMM in bf16 trace whole; the per-expert loop breaks where it reads the group sizes
    (its two GEMMs' splits, forward and backward)."""
    layer = _layer(_config(**kw), 0)
    x = torch.randn(8, 2, H, requires_grad=True)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        explained = torch._dynamo.explain(layer)(x)
    assert explained.graph_break_count == breaks, [str(b.reason) for b in
                                                   explained.break_reasons]
    assert explained.graph_count == breaks + 1
