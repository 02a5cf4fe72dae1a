"""Training with the fused kernels gives the losses of training without them (fp32, CPU).

A small attention block (LayerNorm -> QKV -> scores -> FusedScaleMaskSoftmax -> context ->
projection -> RMSNorm) trained for a few SGD steps on random data, once with fusion and
once with every op on its PyTorch path, from the same initial weights.
"""
import math

import pytest
import torch
from torch import nn

from megatron import fused_kernels
from megatron.model.fused_layer_norm import MixedFusedLayerNorm, MixedFusedRMSNorm
from megatron.model.fused_softmax import AttnMaskType, FusedScaleMaskSoftmax

HIDDEN, HEADS, SEQ, BATCH, STEPS = 32, 4, 24, 3, 6


def attention_mask_func(scores, mask):
    return scores.masked_fill_(mask, -10000.0)


class TinyBlock(nn.Module):
    def __init__(self, mask_type, fusion):
        super().__init__()
        self.ln = MixedFusedLayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.rms = MixedFusedRMSNorm(HIDDEN)
        self.softmax = FusedScaleMaskSoftmax(
            input_in_fp16=False, input_in_bf16=False, attn_mask_type=mask_type,
            scaled_masked_softmax_fusion=fusion, mask_func=attention_mask_func,
            softmax_in_fp32=True, scale=1.0 / math.sqrt(HIDDEN // HEADS))

    def forward(self, x, mask):  # x: [b, s, h]
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, s, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        probs = self.softmax(q @ k.transpose(-1, -2), mask)  # [b, heads, s, s]
        context = (probs @ v).transpose(1, 2).reshape(b, s, HIDDEN)
        return self.rms(x + self.proj(context))


def train(fusion, mask_type, seed, monkeypatch):
    """Losses of STEPS SGD steps, and the path the softmax took."""
    monkeypatch.setitem(fused_kernels._FLAGS, "layernorm_fusion", fusion)
    torch.manual_seed(seed)
    model = TinyBlock(mask_type, fusion)
    with torch.no_grad():  # non-trivial norm parameters
        for norm in (model.ln, model.rms):
            for p in norm.parameters():
                p.add_(torch.randn_like(p) * 0.2)
    data = torch.randn(BATCH, SEQ, HIDDEN)  # one batch, fitted: the loss must go down
    target = torch.randn(BATCH, SEQ, HIDDEN)
    mask = None
    if mask_type == AttnMaskType.padding:
        lengths = torch.randint(SEQ // 2, SEQ + 1, (BATCH,))
        keys = torch.arange(SEQ)[None, :] >= lengths[:, None]  # [b, s] padded keys
        mask = keys[:, None, None, :].expand(BATCH, 1, SEQ, SEQ).contiguous()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = (model(data, mask) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.softmax.last_path


@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.padding])
def test_fused_and_unfused_training_losses_agree(monkeypatch, seed, mask_type):
    if fused_kernels.get_module("cpu") is None:
        pytest.fail("the CPU kernels did not build; this test compares them with PyTorch")
    fused, path = train(True, mask_type, seed, monkeypatch)
    plain, plain_path = train(False, mask_type, seed, monkeypatch)
    assert (path, plain_path) == ("fused CPU kernel", "PyTorch")
    assert fused[-1] < fused[0]  # it trains
    for step, (a, b) in enumerate(zip(fused, plain)):
        assert abs(a - b) <= 1e-5 * abs(b), f"step {step}: fused {a} vs PyTorch {b}"
