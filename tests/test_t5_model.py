"""T5 pieces against references: relative buckets vs transformers, FLOPs vs torch's counter."""
import pytest
import torch

from harness import run_distributed


@pytest.mark.parametrize("buckets,distance", [(32, 128), (8, 20), (6, 7)])
def test_relative_position_buckets_match_transformers(seed, buckets, distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    from megatron.model.t5_layers import relative_position_bucket

    g = torch.Generator().manual_seed(seed)
    relative = torch.randint(-3 * distance, 3 * distance, (4000,), generator=g)
    relative[:200] = torch.arange(-100, 100)  # every small distance, both directions
    for bidirectional in (True, False):
        ours = relative_position_bucket(relative, bidirectional, buckets, distance)
        theirs = T5Attention._relative_position_bucket(relative, bidirectional, buckets,
                                                       distance)
        assert torch.equal(ours, theirs), (bidirectional, buckets, distance)


def _count_flops(gated, se, sd):
    from torch.utils.flop_counter import FlopCounterMode

    from megatron import mpu
    from megatron.model.t5_layers import T5TransformerConfig
    from megatron.model.t5_model import T5Model, t5_flops_per_step

    mpu.initialize_model_parallel(1, 1)
    mpu.model_parallel_cuda_manual_seed(1)
    config = T5TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                 kv_channels=12, ffn_hidden_size=80, vocab_size=128,
                                 ff_type="gated-gelu" if gated else "relu",
                                 tie_embeddings=not gated, hidden_dropout=0.0,
                                 attention_dropout=0.0,
                                 # torch's counter does not count the CPU flash
                                 # SDPA kernel (no mask: cross-attention): count the bmm path
                                 attention_backend="unfused")
    model = T5Model(config)
    b = 3
    enc, dec = torch.randint(0, 128, (b, se)), torch.randint(0, 128, (b, sd))
    with FlopCounterMode(display=False) as counter:
        model(enc, dec, None, None, None)
    return counter.get_total_flops(), t5_flops_per_step(config, se, sd, b)


@pytest.mark.parametrize("gated", [False, True])
def test_flops_per_step_matches_torch_flop_counter(gated):
    forward, formula = run_distributed(_count_flops, 1, gated, 11, 7)[0]
    assert formula == 3 * forward  # backward = 2 x forward for the matmuls
