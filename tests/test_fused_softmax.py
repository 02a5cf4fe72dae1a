"""Fused masked softmax (CPU kernel, CUDA kernel, PyTorch fallback) against an fp64 reference."""
import pytest
import torch

from megatron import fused_kernels
from megatron.model.fused_softmax import AttnMaskType, FusedScaleMaskSoftmax

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# (b, np, sq, sk): odd sizes, a one-element row, long rows, KV-cache style sq < sk.
PADDING_SHAPES = [(2, 3, 5, 7), (1, 1, 1, 1), (2, 4, 16, 128), (1, 2, 33, 1000), (1, 1, 3, 5003)]
CAUSAL_SHAPES = [(2, 3, 7, 7), (1, 2, 64, 64), (2, 1, 5, 37), (1, 2, 17, 2051)]


def attention_mask_func(scores, mask):
    return scores.masked_fill_(mask, -10000.0)


def reference(x, mask, scale, causal):
    """The documented semantics in fp64: mask -> -10000, causal tail -> probability 0."""
    s = x.double() * scale
    if mask is not None:
        s = s.masked_fill(mask, -10000.0)
    if causal:
        sq, sk = x.shape[-2:]
        tail = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1 + sk - sq)
        s = s.masked_fill(tail, float("-inf"))
    return torch.softmax(s, dim=-1)


def make_softmax(causal, dtype, fusion=True):
    return FusedScaleMaskSoftmax(
        input_in_fp16=dtype == torch.float16, input_in_bf16=dtype == torch.bfloat16,
        attn_mask_type=AttnMaskType.causal if causal else AttnMaskType.padding,
        scaled_masked_softmax_fusion=fusion, mask_func=attention_mask_func,
        softmax_in_fp32=True, scale=0.37)


def random_case(shape, causal, dtype, device, mask_batch=None, dead_rows=True):
    b, _, sq, sk = shape
    x = (torch.randn(shape, device=device) * 4).to(dtype)
    mask = None
    if not causal or mask_batch is not None:
        mb = b if mask_batch is None else mask_batch
        mask = torch.rand(mb, 1, sq, sk, device=device) < 0.3
        if dead_rows:
            mask[0, 0, sq // 2] = True  # one row hidden entirely
    return x, mask


def run(softmax, x, mask):
    """Forward and backward; returns (probs, dscores, dprobs)."""
    x = x.clone().requires_grad_()
    probs = softmax(x, mask)
    grad = torch.randn_like(probs)
    probs.backward(grad)
    return probs, x.grad, grad


def reference_grads(x, mask, scale, causal, grad):
    xr = x.detach().double().requires_grad_()
    ref = reference(xr, mask, scale, causal)
    ref.backward(grad.double())
    return ref.detach(), xr.grad


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def check_against_reference(softmax, x, mask, causal, path):
    probs, dx, grad = run(softmax, x, mask)
    assert softmax.last_path == path
    assert probs.dtype == x.dtype and not probs.isnan().any()
    ref, ref_dx = reference_grads(x, mask, softmax.scale, causal, grad)
    if x.dtype == torch.float32:
        torch.testing.assert_close(probs.double(), ref, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(dx.double(), ref_dx, rtol=1e-4, atol=1e-6)
    else:  # 16-bit outputs and a backward that reads the rounded probabilities
        torch.testing.assert_close(probs.double(), ref, rtol=1.6e-2, atol=1e-5)
        assert rel_err(dx, ref_dx) < 2e-2
    return probs, dx


@pytest.fixture
def cpu_kernels():
    module = fused_kernels.get_module("cpu")
    if module is None:
        from megatron.fused_kernels.build import last_error

        pytest.fail(f"the CPU kernels did not build: {last_error('cpu')}")
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", PADDING_SHAPES)
def test_cpu_padding_kernel_matches_reference(cpu_kernels, seed, shape, dtype):
    torch.manual_seed(seed)
    x, mask = random_case(shape, causal=False, dtype=dtype, device="cpu")
    check_against_reference(make_softmax(False, dtype), x, mask, False, "fused CPU kernel")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", CAUSAL_SHAPES)
@pytest.mark.parametrize("mask_batch", [None, 1])
def test_cpu_causal_kernel_matches_reference(cpu_kernels, seed, shape, dtype, mask_batch):
    torch.manual_seed(seed)
    x, mask = random_case(shape, causal=True, dtype=dtype, device="cpu", mask_batch=mask_batch)
    probs, _ = check_against_reference(make_softmax(True, dtype), x, mask, True,
                                       "fused CPU kernel")
    sq, sk = shape[-2:]
    tail = torch.ones(sq, sk, dtype=torch.bool).triu(1 + sk - sq)
    assert (probs[..., tail] == 0).all()  # exactly zero, not merely small


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (1, 2, 33, 1000), (2, 2, 16, 16)])
def test_kernel_and_fallback_agree_fp32(cpu_kernels, seed, shape, causal):
    torch.manual_seed(seed)
    x, mask = random_case(shape, causal, torch.float32, "cpu", mask_batch=shape[0])
    fused, fallback = make_softmax(causal, torch.float32), make_softmax(causal, torch.float32,
                                                                         fusion=False)
    xf = x.clone().requires_grad_()
    xt = x.clone().requires_grad_()
    out_f, out_t = fused(xf, mask), fallback(xt, mask)
    assert (fused.last_path, fallback.last_path) == ("fused CPU kernel", "PyTorch")
    grad = torch.randn_like(out_f)
    out_f.backward(grad)
    out_t.backward(grad)
    torch.testing.assert_close(out_f, out_t, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(xf.grad, xt.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_fallback_matches_reference(seed, dtype, causal):
    torch.manual_seed(seed)
    x, mask = random_case((2, 3, 9, 9 if causal else 13), causal, dtype, "cpu", mask_batch=2)
    check_against_reference(make_softmax(causal, dtype, fusion=False), x, mask, causal, "PyTorch")


@pytest.mark.parametrize("fusion", [True, False])
def test_fully_masked_rows_are_uniform_without_gradient(seed, fusion):
    torch.manual_seed(seed)
    x = torch.randn(2, 2, 4, 6)
    mask = torch.zeros(2, 1, 4, 6, dtype=torch.bool)
    mask[1, 0, 2] = True
    softmax = make_softmax(False, torch.float32, fusion)
    probs, dx, _ = run(softmax, x, mask)
    assert not probs.isnan().any() and not dx.isnan().any()
    torch.testing.assert_close(probs[1, :, 2], torch.full((2, 6), 1 / 6))
    assert (dx[1, :, 2] == 0).all() and dx[0].abs().sum() > 0


def test_fallback_leaves_the_input_untouched(seed):
    torch.manual_seed(seed)
    x, mask = random_case((1, 2, 4, 8), False, torch.float32, "cpu")
    softmax = FusedScaleMaskSoftmax(False, False, AttnMaskType.padding, False,
                                    attention_mask_func, True, None)
    before = x.clone()
    softmax(x, mask)
    assert torch.equal(x, before)


def test_eligibility_rules():
    causal = make_softmax(True, torch.bfloat16)
    cuda = torch.device("cuda")
    assert "fp16/bf16" in causal.kernel_unavailable_reason(None, 1, 1, 64, 64, torch.float32, cuda)
    assert "sk" in causal.kernel_unavailable_reason(None, 1, 1, 64, 8192, torch.bfloat16, cuda)
    assert "sk" in causal.kernel_unavailable_reason(None, 1, 1, 64, 100, torch.bfloat16, cuda)
    assert "fp32/bf16" in causal.kernel_unavailable_reason(None, 1, 1, 8, 8, torch.float16, "cpu")
    assert "sq > sk" in causal.kernel_unavailable_reason(None, 1, 1, 9, 8, torch.float32, "cpu")
    per_head = torch.zeros(1, 2, 8, 8, dtype=torch.bool)
    assert "mask" in causal.kernel_unavailable_reason(per_head, 1, 2, 8, 8, torch.float32, "cpu")
    off = make_softmax(True, torch.float32, fusion=False)
    assert off.kernel_unavailable_reason(None, 1, 1, 8, 8, torch.float32, "cpu") == "fusion disabled"


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 24, 24), (2, 4, 128, 128), (1, 2, 40, 1000),
                                   (1, 2, 256, 4096), (2, 16, 8, 2048)])
def test_cuda_kernel_matches_reference(seed, shape, causal, dtype):
    torch.manual_seed(seed)
    x, mask = random_case(shape, causal, dtype, "cuda", mask_batch=None if causal else shape[0])
    softmax = make_softmax(causal, dtype)
    probs, _ = check_against_reference(softmax, x, mask, causal, "fused CUDA kernel")
    if causal:
        sq, sk = shape[-2:]
        tail = torch.ones(sq, sk, dtype=torch.bool, device="cuda").triu(1 + sk - sq)
        assert (probs[..., tail] == 0).all()


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_kernel_with_causal_and_padding_mask(seed, dtype):
    torch.manual_seed(seed)
    x, mask = random_case((2, 4, 64, 64), True, dtype, "cuda", mask_batch=2)
    check_against_reference(make_softmax(True, dtype), x, mask, True, "fused CUDA kernel")
