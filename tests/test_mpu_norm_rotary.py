"""mpu.RMSNorm and rotary embeddings as mpu pieces: RMSNorm with sequence parallelism at tp=2
equals the serial RMSNorm (outputs, input gradients, and the weight's gradient summed over the
tensor-parallel ranks), and a rank's heads rotate as the same heads of the whole tensor."""
import pytest

from harness import run_distributed

S, B, H, HEADS, D = 8, 3, 16, 4, 8


def _sp_rmsnorm_vs_serial(seed):
    """Rank body (tp=2): largest differences between the sequence-parallel RMSNorm on this
    rank's sequence shard and the serial RMSNorm on the whole sequence."""
    import torch

    from megatron import mpu

    mpu.initialize_model_parallel(2, 1)
    rank, tp = mpu.get_tensor_model_parallel_rank(), 2
    torch.manual_seed(seed)  # the same tensors on both ranks
    x = torch.randn(S, B, H) * 3 + 0.5  # [s, b, h]
    dy = torch.randn(S, B, H)
    weight = torch.rand(H) + 0.5

    serial = mpu.RMSNorm(H, eps=1e-5)
    sp = mpu.RMSNorm(H, eps=1e-5, sequence_parallel=True)
    with torch.no_grad():
        serial.weight.copy_(weight)
        sp.weight.copy_(weight)
    x_full = x.clone().requires_grad_()
    y_full = serial(x_full)
    (y_full * dy).sum().backward()

    rows = slice(rank * S // tp, (rank + 1) * S // tp)  # this rank's sequence shard
    x_shard = x[rows].clone().requires_grad_()  # [s/tp, b, h]
    y_shard = sp(x_shard)
    (y_shard * dy[rows]).sum().backward()

    formula = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
    return {"output": (y_shard - y_full[rows]).abs().max().item(),
            "input grad": (x_shard.grad - x_full.grad[rows]).abs().max().item(),
            "weight grad": (sp.weight.grad - serial.weight.grad).abs().max().item(),
            "formula": (y_full - formula).abs().max().item(),
            "weight grad scale": serial.weight.grad.abs().max().item(),
            "shard-only weight grad": _shard_only_weight_grad_gap(x, dy, weight, rows, serial)}


def _shard_only_weight_grad_gap(x, dy, weight, rows, serial):
    """How far a rank's own (unsummed) weight gradient is from the serial one: what the sum
    over tp must close (the test would not see a missing sum otherwise)."""
    from megatron import mpu

    plain = mpu.RMSNorm(H, eps=1e-5)
    with __import__("torch").no_grad():
        plain.weight.copy_(weight)
    (plain(x[rows]) * dy[rows]).sum().backward()
    return (plain.weight.grad - serial.weight.grad).abs().max().item()


def test_rmsnorm_sequence_parallel_tp2_equals_serial(seed):
    for per_rank in run_distributed(_sp_rmsnorm_vs_serial, 2, seed, timeout=120):
        assert per_rank["formula"] < 1e-5, per_rank  # the serial norm is RMSNorm
        assert per_rank["weight grad scale"] > 0.1, per_rank
        assert per_rank["shard-only weight grad"] > 1e-2, per_rank
        for what in ("output", "input grad"):
            assert per_rank[what] < 1e-6, (what, per_rank)
        # a sum of 2 partial sums vs one sum of 24 rows: fp32 rounding, relative to the scale
        assert per_rank["weight grad"] < 1e-6 * per_rank["weight grad scale"], per_rank


def _rotary_on_a_head_shard(seed):
    """Rank body (tp=2): this rank's heads rotated vs the same heads of the whole tensor
    rotated, and the whole rotation vs transformers' Llama rotary."""
    import torch

    from megatron import mpu

    mpu.initialize_model_parallel(2, 1)
    rank = mpu.get_tensor_model_parallel_rank()
    torch.manual_seed(seed)
    q = torch.randn(S, B, HEADS, D)  # [s, b, heads, d]
    rope = mpu.RotaryEmbedding(D, theta=5000.0)
    cos, sin = rope(S)
    whole = mpu.apply_rotary(q, cos, sin)
    heads = slice(rank * HEADS // 2, (rank + 1) * HEADS // 2)
    mine = mpu.apply_rotary(q[:, :, heads].contiguous(), cos, sin)
    return (mine - whole[:, :, heads]).abs().max().item(), _against_transformers(q, whole)


def _against_transformers(q, ours):
    """Largest difference to transformers' ``apply_rotary_pos_emb`` (None without it)."""
    try:
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import (LlamaRotaryEmbedding,
                                                              apply_rotary_pos_emb)
    except ImportError:
        return None
    import torch

    config = LlamaConfig(hidden_size=HEADS * D, num_attention_heads=HEADS, rope_theta=5000.0)
    hf = LlamaRotaryEmbedding(config)
    x = q.permute(1, 2, 0, 3)  # [b, heads, s, d]
    cos, sin = hf(x, torch.arange(S)[None].expand(B, S))
    theirs, _ = apply_rotary_pos_emb(x, x, cos, sin)
    return (theirs.permute(2, 0, 1, 3) - ours).abs().max().item()


def test_rotary_is_per_head_and_equals_transformers(seed):
    for shard_gap, hf_gap in run_distributed(_rotary_on_a_head_shard, 2, seed, timeout=120):
        assert shard_gap == 0.0
        if hf_gap is None:
            pytest.skip("transformers is not installed")
        assert hf_gap < 1e-5


def test_norms_are_built_on_mpu_device_as_the_linears():
    """mpu's norms put their parameters where the mpu linears put theirs (mpu.get_device()),
    not on torch's default device: built under another default device, they still land on
    mpu's."""
    import torch

    from megatron import mpu

    with torch.device("meta"):  # torch's default device for this block only
        norms = [mpu.RMSNorm(H), mpu.MixedFusedLayerNorm(H),
                 mpu.MixedFusedLayerNorm(H, device=torch.device("meta"))]
    device = mpu.get_device()
    assert [p.device for p in norms[0].parameters()] == [device]
    assert [p.device for p in norms[1].parameters()] == [device, device]
    assert {p.device.type for p in norms[2].parameters()} == {"meta"}  # asked for: kept
