"""MoE in the memory model's states, step time and planner, against counts written here
from the layers' shapes (megatron/mpu/moe): experts per rank at every ep, the expert buffer
sharded over the expert-data-parallel ranks, the dispatch's all-to-alls, ep a planner
dimension. (The measured peaks: tests/test_memory_peak.py's MoE layouts.)"""
import random
from dataclasses import replace

import pytest

from megatron.memory import MemorySpec
from megatron.memory.model_states import model_states
from megatron.memory.planner import layouts
from megatron.memory.plans import Hardware
from megatron.memory.stages import stage_layers
from megatron.memory.step_time import H100, ep_comm, gemm_time, step_time


def _spec(**kw):
    h = random.choice([64, 128])
    base = dict(family="gpt2", num_layers=4, hidden=h, heads=4, kv_channels=h // 4,
                ffn=4 * h, vocab=1024, seq=128, micro_batch=2, num_micro_batches=2, dp=8,
                num_experts=8, moe_topk=2, max_positions=128)
    base.update(kw)
    return MemorySpec(**base)


@pytest.mark.parametrize("ep", [1, 2, 4, 8])
def test_experts_per_rank_and_the_sharded_expert_buffer(ep):
    spec = _spec(ep=ep, zero_stage=1, moe_layers=(True, False, True, False))
    h, f, v = spec.hidden, spec.ffn, spec.vocab
    attention = 3 * h * h + 3 * h + h * h + h + 4 * h  # qkv, dense, two LayerNorms
    dense_mlp = 2 * h * f + f + h
    experts = 2 * (8 // ep) * 2 * f * h  # two MoE layers, E / ep experts of fc1 + fc2
    router = 2 * 8 * h
    dense = v * h + 128 * h + 4 * attention + 2 * dense_mlp + router + 2 * h
    states = model_states(spec, stage_layers(spec)[0])
    assert states.params == dense + experts
    # Adam's moments: the dense buffer over dp, the expert one over dp / ep (ceil: padded)
    assert states.optimizer_bytes == 8 * (-(-dense // 8) + -(-experts // (8 // ep)))


def test_dispatch_time_and_expert_gemms():
    spec = _spec(num_layers=2, dp=8)
    tokens, k, h, e = spec.seq * spec.micro_batch, spec.moe_topk, spec.hidden, spec.e
    assert ep_comm(spec, H100, tokens, 8) == 0.0
    for ep, per_node in ((2, 8), (8, 4)):  # inside a node; 8 x tp 1 over 2 nodes of 4
        bw = H100.intra_gbps if ep <= per_node else H100.inter_gbps
        one = (ep - 1) / ep * tokens * k * h * e / (bw * 1e9) + H100.latency_s
        assert ep_comm(replace(spec, ep=ep), H100, tokens, per_node) == pytest.approx(4 * one)
    # the experts' GEMMs at the active width: an MoE stack of 2 layers is slower than the
    # dense one by exactly the expert GEMMs (k rows per token, over E / ep experts) less the
    # dense MLP's and plus the router's, forward and backward (3 x)
    dense = replace(spec, num_experts=0)
    stages = [(2, 0, False, 2)]
    moe_t = step_time(spec, H100, 8, stages, 1).compute
    dense_t = step_time(dense, H100, 8, [(2, 0, False)], 1).compute
    f = spec.ffn
    rows = tokens * k // 8
    expert = 8 * (gemm_time(rows, f, h, e, H100) + gemm_time(rows, h, f, e, H100))
    mlp = gemm_time(tokens, f, h, e, H100) + gemm_time(tokens, h, f, e, H100)
    router = gemm_time(tokens, 8, h, 4, H100)
    gemm_delta = spec.num_micro_batches * 2 * 3 * (expert + router - mlp)
    elementwise = moe_t - dense_t - gemm_delta  # the experts' activation, sort and combine
    # the activation's bytes over k rows a token instead of one, the sort and the combine;
    # forward and backward (each op once more), 2 layers, m micro-batches
    bytes_ = tokens * (k - 1) * 4 * f * e + tokens * k * h * (3 * e + 8)
    moved = spec.num_micro_batches * 2 * 2 * bytes_ / (H100.hbm_gbps * 1e9 * H100.hbm_efficiency)
    assert elementwise == pytest.approx(moved, rel=1e-6)


def test_ep_is_a_planner_dimension():
    base = _spec(num_layers=4, dp=1, tp=1)
    hw = Hardware(gpus=8, gpu_memory=80 * 2**30)
    rows = list(layouts(base, hw, 16))
    seen = {(r.dp * r.cp, r.ep) for r in rows}
    for group in {g for g, _ in seen}:  # every ep dividing dp x cp and the 8 experts
        assert {ep for g, ep in seen if g == group} == \
            {ep for ep in (1, 2, 4, 8) if group % ep == 0}, seen
    assert not any(r.sequence_parallel or r.pipeline_schedule in ("zb-h1", "zbv") and r.pp > 1
                   or r.backend == "engine" for r in rows)
    for r in random.sample(rows, 20):
        r.check()  # each is a spec the model describes


def test_the_fast_ranking_gives_each_moe_layout_its_full_evaluation():
    """ranking.py's grouped walk (one matrix product per schedule) against evaluating each
    MoE layout in full, including pipelines whose stages hold different MoE layer counts."""
    from megatron.memory.planner import evaluate
    from megatron.memory.ranking import fitting_plans

    base = _spec(num_layers=6, moe_layers=(True, False) * 3, dp=1)
    hw = Hardware(gpus=8, gpu_memory=80 * 2**30)
    rows = random.sample([r for r in layouts(base, hw, 16) if r.pp > 1], 12)
    fast = {p.spec: p for p in fitting_plans(rows, hw, 1.0)}
    assert len(fast) == len(rows)
    for spec in rows:
        full = evaluate(spec, hw, 1.0)
        assert [s.peak for s in fast[spec].stages] == [s.peak for s in full.stages], spec
        assert fast[spec].step_time == pytest.approx(full.step_time)
