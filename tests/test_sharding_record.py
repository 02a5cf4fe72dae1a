"""The sharding record's merge and cut (megatron/checkpoint/sharding.py) against the mpu
layers' own split, stride included, and rotary embeddings against their definition."""
import math

import torch

from harness import run_distributed


def _shards(seed, stride):
    """Rank body: this rank's ColumnParallelLinear / RowParallelLinear / embedding shards,
    their record, and the master weights every rank drew them from."""
    from megatron import mpu
    from megatron.checkpoint.sharding import sharding_record

    mpu.initialize_model_parallel(2, 1)
    torch.manual_seed(seed)
    model = torch.nn.Module()
    model.col = mpu.ColumnParallelLinear(6, 8, stride=stride, keep_master_weight_for_test=True)
    model.row = mpu.RowParallelLinear(8, 6, keep_master_weight_for_test=True)
    model.emb = mpu.VocabParallelEmbedding(10, 6)
    masters = {"col.weight": model.col.master_weight, "row.weight": model.row.master_weight}
    return {k: v.detach() for k, v in model.state_dict().items()}, sharding_record(model), \
        masters


def test_merge_and_cut_invert_the_mpu_split(seed):
    from megatron.checkpoint.sharding import merge_recorded, slice_recorded

    for stride in (1, 2):
        ranks = run_distributed(_shards, 2, seed, stride, timeout=60)
        states = {(t, 0): r[0] for t, r in enumerate(ranks)}
        records = {(t, 0): r[1] for t, r in enumerate(ranks)}
        assert records[(0, 0)]["col.weight"][:3] == [0, stride, 0]
        assert records[(0, 0)]["row.weight"][:2] == [1, 1]
        assert records[(0, 0)]["row.bias"][0] == -1  # replicated
        assert records[(0, 0)]["emb.weight"][2] == 1  # vocabulary rows
        full = merge_recorded(states, records, 9, "test")
        for key, master in ranks[0][2].items():
            assert torch.equal(full[key], master), (stride, key)
        assert full["emb.weight"].shape[0] == 9  # padding row dropped
        for t in range(2):  # cut again: each rank's own shards, the padding row now zero
            mine = slice_recorded(full, records[(t, 0)], 2, t, 12, "test")
            for key, tensor in states[(t, 0)].items():
                if key != "emb.weight":
                    assert torch.equal(mine[key], tensor), (stride, t, key)
            repadded = torch.cat([full["emb.weight"], torch.zeros(3, 6)])  # [12, h]
            assert torch.equal(mine["emb.weight"], repadded[6 * t:6 * t + 6])


def test_rotary_rotates_each_pair_by_its_angle():
    from megatron.model.rotary import RotaryEmbedding, apply_rotary

    s, d, theta = 5, 8, 500.0
    x = torch.randn(s, 2, 3, d)  # [s, b, heads, d]
    cos, sin = RotaryEmbedding(d, theta)(s)
    out = apply_rotary(x, cos, sin)
    half = d // 2
    for p in range(s):
        for i in range(half):
            angle = p * theta ** (-2 * i / d)
            a, b = x[p, ..., i], x[p, ..., i + half]
            assert torch.allclose(out[p, ..., i], a * math.cos(angle) - b * math.sin(angle),
                                  atol=1e-5)
            assert torch.allclose(out[p, ..., i + half],
                                  b * math.cos(angle) + a * math.sin(angle), atol=1e-5)
    # relative: <rot(q, m), rot(k, n)> depends on m - n only
    q, k = torch.randn(d), torch.randn(d)
    rot = lambda v, p: apply_rotary(v.view(1, 1, 1, d).expand(s, 1, 1, d), cos, sin)[p, 0, 0]
    assert torch.allclose(rot(q, 3) @ rot(k, 1), rot(q, 4) @ rot(k, 2), atol=1e-5)
