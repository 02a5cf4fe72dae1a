"""MixedFusedLayerNorm / MixedFusedRMSNorm (CPU kernel, CUDA kernel, fallback) vs fp64 references."""
import pytest
import torch
import torch.nn.functional as F

from megatron import fused_kernels
from megatron.model.fused_layer_norm import MixedFusedLayerNorm, MixedFusedRMSNorm

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# (leading dims, hidden): odd sizes, a tiny row, long rows.
SHAPES = [((3, 5), 7), ((1,), 3), ((4, 2), 64), ((33,), 1000), ((2,), 12289)]


def make_norm(rms, hidden, params_dtype, device, seed):
    cls = MixedFusedRMSNorm if rms else MixedFusedLayerNorm
    norm = cls(hidden, params_dtype=params_dtype, device=device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-trivial parameters, drawn in fp32 then cast
        for p in norm.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5 + 1.0)
    return norm


def reference(x, norm):
    """fp64 LayerNorm / RMSNorm with the module's parameters."""
    w = norm.weight.detach().double().requires_grad_()
    params = [w]
    if isinstance(norm, MixedFusedRMSNorm):
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * w
    else:
        b = norm.bias.detach().double().requires_grad_()
        params.append(b)
        y = F.layer_norm(x, norm.normalized_shape, w, b, norm.eps)
    return y, params


def _grads_of(fn, x, norm, grad, dtype):
    """Output and gradients (x, then parameters) of ``fn`` evaluated in ``dtype``."""
    xi = x.detach().to(dtype).requires_grad_()
    params = [p.detach().to(dtype).requires_grad_() for p in norm.parameters()]
    y = fn(xi, params)
    y.backward(grad.to(dtype))
    return [y, xi.grad] + [p.grad for p in params]


def _eager(norm):
    if isinstance(norm, MixedFusedRMSNorm):
        return lambda x, ps: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * ps[0]
    return lambda x, ps: F.layer_norm(x, norm.normalized_shape, ps[0], ps[1], norm.eps)


def run_and_compare(norm, x, tol):
    """Forward + backward through ``norm`` and through the fp64 reference; compare all grads.

    An fp32 result must be within ``tol`` (relative, in norm) of fp64, or no worse than 4x
    the error of PyTorch's own fp32 computation of the same function: on tiny rows the input
    gradient is a difference of nearly equal terms, and fp32 cannot do better than that.
    """
    xk = x.clone().requires_grad_()
    y = norm(xk)
    assert y.dtype == x.dtype and y.shape == x.shape
    grad = torch.randn_like(y)
    y.backward(grad)
    xr = x.detach().double().requires_grad_()
    yr, params = reference(xr, norm)
    yr.backward(grad.double())
    pairs = [(y, yr), (xk.grad, xr.grad)] + [(p.grad, r.grad) for p, r in
                                             zip(norm.parameters(), params)]
    eager = _grads_of(_eager(norm), x, norm, grad, torch.float32) \
        if x.dtype == torch.float32 else [None] * len(pairs)

    def rel(got, want):  # relative in norm, with a floor for exact zeros (hidden 1: dw == 0)
        return ((got.double() - want).norm() / want.norm().clamp_min(1e-6)).item()

    for (got, want), plain in zip(pairs, eager):
        assert got.dtype in (x.dtype, norm.weight.dtype) and not got.isnan().any()
        bound = tol if plain is None else max(tol, 4 * rel(plain, want))
        err = rel(got, want)
        assert err < bound, f"relative error {err} > {bound}"


@pytest.fixture
def cpu_kernels():
    module = fused_kernels.get_module("cpu")
    if module is None:
        from megatron.fused_kernels.build import last_error

        pytest.fail(f"the CPU kernels did not build: {last_error('cpu')}")
    return module


def spy_fused(monkeypatch):
    """Count calls into the fused operator (proves which path ran)."""
    from megatron.mpu import norms  # the classes' module (model.fused_layer_norm re-exports)

    calls = []
    original = norms.fused_norm
    monkeypatch.setattr(norms, "fused_norm",
                        lambda *a: calls.append(1) or original(*a))
    return calls


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype,params_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                                (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("lead,hidden", SHAPES)
def test_cpu_kernel_matches_reference(cpu_kernels, monkeypatch, seed, lead, hidden, dtype,
                                      params_dtype, rms):
    torch.manual_seed(seed)
    norm = make_norm(rms, hidden, params_dtype, "cpu", seed)
    x = (torch.randn(*lead, hidden) * 3 + 1).to(dtype)
    calls = spy_fused(monkeypatch)
    run_and_compare(norm, x, tol=2e-6 if dtype == torch.float32 else 1e-2)
    assert calls, "the fused kernel was not used"


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fallback_matches_reference(monkeypatch, seed, dtype, rms):
    torch.manual_seed(seed)
    monkeypatch.setitem(fused_kernels._FLAGS, "layernorm_fusion", False)
    norm = make_norm(rms, 37, None, "cpu", seed)
    calls = spy_fused(monkeypatch)
    run_and_compare(norm, (torch.randn(4, 3, 37) * 2).to(dtype),
                    tol=2e-6 if dtype == torch.float32 else 1e-2)
    assert not calls


@pytest.mark.parametrize("rms", [False, True])
def test_kernel_and_fallback_agree_fp32(cpu_kernels, monkeypatch, seed, rms):
    torch.manual_seed(seed)
    x = torch.randn(6, 5, 96) * 2 + 0.5
    outs = []
    for fusion in (True, False):
        monkeypatch.setitem(fused_kernels._FLAGS, "layernorm_fusion", fusion)
        norm = make_norm(rms, 96, None, "cpu", seed)
        xi = x.clone().requires_grad_()
        y = norm(xi)
        y.backward(torch.ones_like(y) + x)
        outs.append([y.detach(), xi.grad] + [p.grad for p in norm.parameters()])
    for fused, plain in zip(*outs):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


def test_drop_in_for_torch_layer_norm(seed):
    torch.manual_seed(seed)
    torch_ln = torch.nn.LayerNorm(48)
    with torch.no_grad():
        torch_ln.weight.normal_()
        torch_ln.bias.normal_()
    ours = MixedFusedLayerNorm(48)
    ours.load_state_dict(torch_ln.state_dict())
    assert set(ours.state_dict()) == {"weight", "bias"}
    assert set(MixedFusedRMSNorm(48).state_dict()) == {"weight"}
    x = torch.randn(5, 48)
    torch.testing.assert_close(ours(x), torch_ln(x), rtol=1e-5, atol=1e-5)


def test_unsupported_inputs_take_the_fallback(cpu_kernels, monkeypatch, seed):
    torch.manual_seed(seed)
    calls = spy_fused(monkeypatch)
    norm = MixedFusedLayerNorm(16)
    run_and_compare(norm, torch.randn(3, 16).half(), tol=1e-2)  # fp16 has no CPU kernel
    assert not calls
    with pytest.raises(RuntimeError):
        norm(torch.randn(3, 15))  # wrong size: the PyTorch path reports it


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("dtype,params_dtype", [(torch.float32, None), (torch.float16, None),
                                                (torch.bfloat16, None),
                                                (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("rows,hidden", [(1, 8), (7, 1000), (300, 1024), (64, 4096),
                                         (33, 8192)])
def test_cuda_kernel_matches_reference(monkeypatch, seed, rows, hidden, dtype, params_dtype, rms):
    monkeypatch.setitem(fused_kernels._FLAGS, "layernorm_fusion", True)  # LayerNorm: not default
    torch.manual_seed(seed)
    norm = make_norm(rms, hidden, params_dtype, "cuda", seed)
    x = (torch.randn(rows, hidden, device="cuda") * 3 + 1).to(dtype)
    calls = spy_fused(monkeypatch)
    run_and_compare(norm, x, tol=2e-6 if dtype == torch.float32 else 1e-2)
    assert calls, "the fused kernel was not used"


@needs_gpu
@pytest.mark.gpu
def test_cuda_unsupported_hidden_takes_the_fallback(monkeypatch, seed):
    torch.manual_seed(seed)
    calls = spy_fused(monkeypatch)
    norm = make_norm(False, 1004, None, "cuda", seed)  # 1004 % 8 != 0
    run_and_compare(norm, torch.randn(5, 1004, device="cuda").half(), tol=1e-2)
    assert not calls
