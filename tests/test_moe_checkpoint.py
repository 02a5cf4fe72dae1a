"""The sharding record knows the expert dimension: the Llama example as Mixtral (layout-free
names) saved at one (tp, ep), merged to whole tensors and cut for another, without a key map;
the experts land where the other layout's model holds them."""
import torch
import torch.distributed as dist

from harness import run_distributed
from llama_runs import llama_argv  # noqa: F401 (puts examples/llama on the path)
from megatron import mpu

LAYOUTS = [(2, 2), (1, 4), (1, 1), (2, 1), (1, 2)]  # (tp, ep) at 4 ranks


def _model(tp, ep, seed):
    from llama_model import LlamaConfig, LlamaModel
    from megatron.mpu import moe

    mpu.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    block = moe.MoEConfig(num_experts=4, topk=2, hidden_size=32, ffn_hidden_size=32,
                          activation="swiglu", shared_expert_intermediate_size=16)
    config = LlamaConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                         num_key_value_heads=2, ffn_hidden_size=48, vocab_size=64, seed=seed,
                         moe=block, moe_layers=(False, True))
    return LlamaModel(config)


def _whole(model):
    """Every rank's (state, record) -> whole tensors (one file per tp x ep rank)."""
    from megatron.checkpoint.sharding import merge_recorded, sharding_record

    st = mpu.get_parallel_state()
    mine = (st.tp_rank, 0, st.ep_rank, st.edp_rank, model.state_dict(), sharding_record(model))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    files = {(t, p, e): (sd, rec) for t, p, e, edp, sd, rec in every if edp == 0}
    return merge_recorded({k: v[0] for k, v in files.items()},
                          {k: v[1] for k, v in files.items()}, None, "test")


def _reshard(seed):
    from megatron.checkpoint.sharding import sharding_record, slice_recorded

    out = []
    for (tp_a, ep_a), (tp_b, ep_b) in zip(LAYOUTS, LAYOUTS[1:] + LAYOUTS[:1]):
        torch.manual_seed(seed)
        whole = _whole(_model(tp_a, ep_a, seed))
        mpu.destroy_model_parallel()
        gen = torch.Generator().manual_seed(seed + 1)  # trained weights: not the init's
        whole = {k: v + torch.randn(v.shape, generator=gen) for k, v in whole.items()}
        torch.manual_seed(seed)
        model = _model(tp_b, ep_b, seed + 3)  # another init: everything must come from `whole`
        st = mpu.get_parallel_state()
        model.load_state_dict(slice_recorded(whole, sharding_record(model), tp_b, st.tp_rank,
                                             None, "test", ep_b, st.ep_rank))
        experts = model.state_dict()["2.mlp.experts.weight1"]  # [E/ep, 2f/tp, h]
        per = 4 // ep_b
        want = whole["2.mlp.experts.weight1"][st.ep_rank * per:(st.ep_rank + 1) * per]
        chunks = torch.chunk(want, 2 * tp_b, dim=1)  # [gate; up], each split over tp
        want = torch.cat(chunks[st.tp_rank::tp_b], dim=1)
        back = _whole(model)
        mpu.destroy_model_parallel()
        out.append(((tp_a, ep_a), (tp_b, ep_b), torch.equal(experts, want),
                    sorted(back) == sorted(whole) and
                    all(torch.equal(back[k], whole[k]) for k in whole)))
    return out


def test_experts_reshard_at_another_ep_and_tp_without_a_key_map(seed):
    for per_rank in run_distributed(_reshard, 4, seed):
        for source, target, experts_ok, round_trip in per_rank:
            assert experts_ok and round_trip, (source, target)
