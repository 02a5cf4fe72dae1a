"""Pretraining sampler: global batches independent of dp, exact resume."""
import numpy as np
import pytest
import torch

from megatron.data.data_samplers import MegatronPretrainingSampler, build_pretraining_data_loader
from megatron.common.errors import ConfigError


class _Range:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"text": np.array([i, i + 1]), "mask": np.array([1])}


def _global_batches(total, consumed, micro, dp):
    per_rank = [list(MegatronPretrainingSampler(total, consumed, micro, r, dp)) for r in range(dp)]
    steps = len(per_rank[0])
    assert all(len(p) == steps for p in per_rank)
    return [sum((per_rank[r][s] for r in range(dp)), []) for s in range(steps)]


def test_dp_invariant_global_batches_and_resume(seed):
    rng = np.random.default_rng(seed)
    micro, total = int(rng.integers(1, 5)), int(rng.integers(50, 300))
    acc = 4  # global batch = micro * acc * dp; compare at dp = 1, 2, 4
    flat = {}
    for dp in (1, 2, 4):
        steps = _global_batches(total, 0, micro, dp)
        per_global = acc // dp
        flat[dp] = [sorted(sum(steps[g:g + per_global], []))
                    for g in range(0, len(steps) - per_global + 1, per_global)]
    n = min(len(v) for v in flat.values())
    assert n > 0 and flat[1][:n] == flat[2][:n] == flat[4][:n]
    # Brute force: global batch g is samples [g * B, (g + 1) * B).
    B = micro * acc
    assert flat[1][:n] == [list(range(g * B, (g + 1) * B)) for g in range(n)]
    # Resume at k: continues with the same steps.
    k = micro * 2 * int(rng.integers(1, 5))
    full = _global_batches(total, 0, micro, 2)
    assert _global_batches(total, k, micro, 2) == full[k // (micro * 2):]


def test_loader_yields_int64_tensors():
    loader = build_pretraining_data_loader(_Range(20), 4, 3, 1, 2)
    batches = list(loader)
    assert batches[0]["text"].dtype == torch.int64
    assert batches[0]["text"][:, 0].tolist() == [7, 8, 9]  # step 0 of rank 1 from sample 4
    assert len(batches) == (20 - 4) // 6
    assert build_pretraining_data_loader(None, 0, 1, 0, 1) is None


def test_bad_sampler_arguments():
    with pytest.raises(ConfigError, match="used up its data"):
        MegatronPretrainingSampler(10, 10, 1, 0, 1)
    with pytest.raises(ConfigError, match="outside"):
        MegatronPretrainingSampler(10, 0, 1, 2, 2)
