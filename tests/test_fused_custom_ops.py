"""The fused kernels as ``torch.library`` operators: opcheck, and compiled == eager.

``torch.library.opcheck`` runs each operator on the CPU twins of the kernels and checks what
the compiler relies on: the schema (no input written, no output aliasing one), the fake
implementation (shapes, dtypes, strides of the real outputs), the autograd registration, and
AOTAutograd tracing with dynamic shapes. Then the model-side wrappers, compiled, must give
the eager kernel's outputs and gradients, and the PyTorch fallback's.
"""
import pytest
import torch

from megatron import fused_kernels
from megatron.fused_kernels import custom_ops
from megatron.model.compile import prepare_for_compile
from megatron.model.fused_layer_norm import MixedFusedLayerNorm, MixedFusedRMSNorm
from megatron.model.fused_softmax import AttnMaskType, FusedScaleMaskSoftmax
from megatron.model.transformer import attention_mask_func


@pytest.fixture
def cpu_kernels():
    module = fused_kernels.get_module("cpu")
    if module is None:
        from megatron.fused_kernels.build import last_error

        pytest.fail(f"the CPU kernels did not build: {last_error('cpu')}")
    return module


def _mask(b, sq, sk):
    mask = torch.rand(b, 1, sq, sk) < 0.3
    mask[..., 0] = False  # no fully masked rows: their gradient is 0 by definition
    return mask


@pytest.mark.parametrize(("masked", "causal"), [(False, True), (True, False)])
def test_softmax_ops_pass_opcheck(cpu_kernels, seed, masked, causal):
    torch.manual_seed(seed)
    b, np_, sq, sk = 2, 3, 8, 8
    scores = torch.randn(b, np_, sq, sk, requires_grad=True)
    mask = _mask(b, sq, sk) if masked else None
    scale = float(torch.rand(()) + 0.5)
    torch.library.opcheck(custom_ops.masked_softmax_fwd, (scores, mask, scale, causal))
    with torch.no_grad():  # the backward op has no backward of its own: plain inputs
        probs, dead = custom_ops.masked_softmax_fwd(scores, mask, scale, causal)
    grad = torch.randn_like(probs)
    torch.library.opcheck(custom_ops.masked_softmax_bwd, (grad, probs, dead, scale, causal))


@pytest.mark.parametrize("rms", [False, True])
def test_norm_ops_pass_opcheck(cpu_kernels, seed, rms):
    torch.manual_seed(seed)
    x = torch.randn(5, 3, 24, requires_grad=True)
    weight = (torch.randn(24) * 0.1 + 1).requires_grad_()
    bias = None if rms else torch.randn(24, requires_grad=True)
    torch.library.opcheck(custom_ops.norm_fwd, (x, weight, bias, 1e-5, rms))
    with torch.no_grad():  # the backward op has no backward of its own: plain inputs
        _, mean, rstd = custom_ops.norm_fwd(x, weight, bias, 1e-5, rms)
    grad = torch.randn_like(x)
    torch.library.opcheck(custom_ops.norm_bwd,
                          (grad, x.detach(), weight.detach(), mean, rstd, not rms, rms))


def _fwd_bwd(fn, inputs):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    grad = torch.ones_like(out) * torch.linspace(-1, 1, out.numel()).view_as(out)
    out.backward(grad)
    return [out.detach()] + [t.grad for t in inputs]


def _compiled_equals_eager(module, inputs, path_check):
    eager = _fwd_bwd(module, inputs)
    path_check()
    prepare_for_compile()  # what --compile does first
    compiled = _fwd_bwd(torch.compile(module, backend="aot_eager", fullgraph=True), inputs)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    return eager


@pytest.mark.parametrize("rms", [False, True])
def test_compiled_norm_is_the_composition_and_equals_the_eager_kernel(cpu_kernels, monkeypatch,
                                                                      seed, rms):
    """Eager, the norm runs the fused kernel; inside torch.compile it is the PyTorch
    composition inductor fuses (issue 43: the opaque operator cost host time per call), with
    no call of the operator, and equal to the kernel's forward and backward."""
    torch.manual_seed(seed)
    norm = MixedFusedRMSNorm(32) if rms else MixedFusedLayerNorm(32)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.2)
    eager_calls, compiled_calls = [], []
    monkeypatch.setattr(custom_ops._EagerNorm, "apply",
                        _counting(custom_ops._EagerNorm.apply, eager_calls))
    monkeypatch.setattr(custom_ops, "norm_fwd", _counting(custom_ops.norm_fwd, compiled_calls))
    x = torch.randn(6, 2, 32) * 2 + 0.5
    eager = _compiled_equals_eager(lambda t: norm(t), [x], lambda: None)
    assert eager_calls and not compiled_calls, (len(eager_calls), len(compiled_calls))
    monkeypatch.setattr(fused_kernels, "_FLAGS", {"layernorm_fusion": False})
    fallback = _fwd_bwd(lambda t: norm(t), [x])
    for got, want in zip(eager, fallback):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _counting(function, calls):
    def counted(*args):
        calls.append(1)
        return function(*args)

    return counted


@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.padding])
def test_compiled_softmax_takes_the_kernel_and_equals_eager(cpu_kernels, seed, mask_type):
    torch.manual_seed(seed)
    softmax = FusedScaleMaskSoftmax.for_dtype(torch.float32, mask_type, True,
                                              attention_mask_func, scale=0.3)
    scores, mask = torch.randn(2, 3, 8, 8) * 3, _mask(2, 8, 8)

    def check_path():
        assert softmax.last_path == "fused CPU kernel"

    fused = _compiled_equals_eager(lambda s: softmax(s, mask), [scores], check_path)
    softmax.scaled_masked_softmax_fusion = False
    fallback = _fwd_bwd(lambda s: softmax(s, mask), [scores])
    assert softmax.last_path == "PyTorch"
    for got, want in zip(fused, fallback):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
