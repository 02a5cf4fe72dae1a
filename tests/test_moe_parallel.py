"""Expert parallelism on several ranks against the serial reference written in the tests
(tests/moe_reference.py): the expert groups, and the MoE block at ep 2 / ep 4 / tp 2 x ep 2 /
cp 2 x ep 2 with both dispatchers: outputs, routing losses, statistics and every gradient
after the step's reduction (dense: mean over dp x cp; experts: sum over the expert-data-
parallel group / (dp x cp), Megatron-core's expert gradient scaling), and capacity mode's
drops at ep 2 against the Switch paper's definition, per rank."""
import pytest
import torch
import torch.distributed as dist

import moe_reference as ref
from harness import run_distributed
from megatron import mpu
from megatron.mpu import moe

H, F_, E = 16, 16, 8


# ---------------------------------------------------------------- the groups
def _expected_groups(rank, tp, pp, cp, ep, world):
    dp = world // (tp * pp * cp)
    coords = {r: mpu.grid_coordinates(r, tp, dp, cp) for r in range(world)}
    p, d, c, t = coords[rank]
    i = d * cp + c  # place in the data x context group
    same = [r for r in range(world) if coords[r][0] == p and coords[r][3] == t]
    index = {r: coords[r][1] * cp + coords[r][2] for r in same}
    ep_ranks = tuple(sorted((r for r in same if index[r] // ep == i // ep), key=index.get))
    edp_ranks = tuple(sorted((r for r in same if index[r] % ep == i % ep), key=index.get))
    return ep_ranks, edp_ranks, i % ep, i // ep


GROUP_LAYOUTS = {  # world -> (tp, pp, cp, ep)
    4: [(1, 1, 1, 2), (1, 1, 1, 4), (2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 2), (1, 1, 2, 4),
        (1, 1, 1, 1)],
    8: [(1, 1, 1, 2), (1, 1, 1, 8), (2, 1, 1, 4), (1, 2, 2, 2), (2, 2, 1, 2), (1, 1, 2, 4),
        (2, 1, 2, 2), (1, 1, 1, 1)]}


def _groups_on_every_layout():
    world, rank, out = dist.get_world_size(), dist.get_rank(), []
    for tp, pp, cp, ep in GROUP_LAYOUTS[world]:
        mpu.initialize_model_parallel(tp, pp, context_parallel_size=cp,
                                      expert_model_parallel_size=ep)
        s = mpu.get_parallel_state()
        sums = []
        for group in (mpu.get_expert_model_parallel_group(), mpu.get_expert_data_parallel_group()):
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=group)
            sums.append(t.item())
        got = (s.ep_ranks, s.edp_ranks, mpu.get_expert_model_parallel_rank(),
               mpu.get_expert_data_parallel_rank())
        want = _expected_groups(rank, tp, pp, cp, ep, world)
        out.append((got == want, (tp, pp, cp, ep), got, want,
                    sums == [float(sum(want[0])), float(sum(want[1]))],
                    mpu.get_expert_model_parallel_world_size() == ep,
                    mpu.get_expert_data_parallel_world_size() == len(want[1])))
        mpu.destroy_model_parallel()
    return out


@pytest.mark.parametrize("world", [4, pytest.param(8, marks=pytest.mark.exhaustive)])
def test_expert_groups_carved_out_of_data_x_context(world):
    for per_rank in run_distributed(_groups_on_every_layout, world):
        for ok, layout, got, want, sums_ok, ep_ok, edp_ok in per_rank:
            assert ok and sums_ok and ep_ok and edp_ok, (layout, got, want)


def _bad_ep():
    try:
        mpu.initialize_model_parallel(1, 1, expert_model_parallel_size=3)
    except ValueError as exc:
        return str(exc)
    return None


def test_ep_not_dividing_dp_x_cp_is_refused():
    for message in run_distributed(_bad_ep, 2):
        assert message and "expert-model-parallel size (3)" in message


# ---------------------------------------------------------------- the block
def _rank_tokens(full, s_cp, dp_rank, cp_rank, dp):
    """This rank's share of the batch ``[s, B, h]``: its samples, its part of the sequence."""
    b = full.shape[1] // dp
    return full[cp_rank * s_cp:(cp_rank + 1) * s_cp, dp_rank * b:(dp_rank + 1) * b]


def _reduced_grad(param, group, ranks):
    grad = param.grad.clone()
    dist.all_reduce(grad, group=group)
    return grad / ranks


def _tp_slice(full, dim, stride):
    tp, r = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    chunks = torch.chunk(full, tp * stride, dim=dim)
    return torch.cat(chunks[r::tp], dim=dim)


def _one_layout(tp, cp, ep, kw, seed, capacity_factor=None):
    """Build the serial and the parallel block from one seed, run the rank's tokens, reduce
    the gradients as the step does, and compare everything with the reference."""
    cfg = moe.MoEConfig(num_experts=E, hidden_size=H, ffn_hidden_size=F_, init_method_std=0.2,
                        capacity_factor=capacity_factor, **kw)
    mpu.initialize_model_parallel(1, 1)  # the serial block: tp 1, ep 1
    torch.manual_seed(seed)
    serial = moe.MoELayer(cfg, 1)
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(tp, 1, context_parallel_size=cp, expert_model_parallel_size=ep)
    torch.manual_seed(seed)
    layer = moe.MoELayer(cfg, 1)
    st = mpu.get_parallel_state()
    dp, s, batch = st.dp_size, 8, 4 * st.dp_size
    gen = torch.Generator().manual_seed(seed + 7)
    full_x = torch.randn(s, batch, H, generator=gen)
    full_g = torch.randn(s, batch, H, generator=gen)
    x = _rank_tokens(full_x, s // cp, st.dp_rank, st.cp_rank, dp).clone().requires_grad_()
    g = _rank_tokens(full_g, s // cp, st.dp_rank, st.cp_rank, dp)
    out = layer(x)
    (cp * (out * g).sum()).backward()  # the language-model loss's x cp under context parallelism

    w = {k: v.requires_grad_() for k, v in ref.full_weights(serial).items()}
    shards, outs, losses, drops = [], [], [], 0
    for d in range(dp):
        xd = full_x[:, d * 4:(d + 1) * 4].double().requires_grad_()
        o, ls, keep, _ = ref.moe_forward(xd.reshape(-1, H), w, cfg, 4, capacity_factor)
        shards.append(xd)
        outs.append(o.view(s, 4, H))
        losses.append(ls)
        drops += int((~keep).sum())
    objective = sum((o * full_g[:, d * 4:(d + 1) * 4].double()).sum() + sum(ls.values())
                    for d, (o, ls) in enumerate(zip(outs, losses))) / dp
    objective.backward()

    checks = {}
    mine = _rank_tokens(torch.stack(outs, 1).flatten(1, 2), s // cp, st.dp_rank, st.cp_rank, dp)
    checks["output"] = (out.detach().double(), mine.detach())
    xg = _rank_tokens(torch.stack([t.grad for t in shards], 1).flatten(1, 2), s // cp,
                      st.dp_rank, st.cp_rank, dp)
    checks["x grad"] = (x.grad.double(), xg * dp * cp)
    ranks = dp * cp
    checks["router grad"] = (_reduced_grad(layer.router.weight, st.dp_cp_group, ranks).double(),
                             w["router"].grad)
    first, local = st.ep_rank * (E // ep), E // ep
    stride = 2 if cfg.gated else 1
    for name, dim, s_ in (("w1", 1, stride), ("w2", 2, 1)):
        param = getattr(layer.experts, "weight" + name[1])
        expected = _tp_slice(w[name].grad[first:first + local], dim, s_)
        checks[name + " slice"] = (param.detach().double(),
                                   _tp_slice(w[name][first:first + local], dim, s_).detach())
        checks[name + " grad"] = (_reduced_grad(param, st.edp_group, ranks).double(), expected)
    if layer.shared_experts is not None:
        for name, module, dim, s_ in (("s1", layer.shared_experts.fc1, 0, stride),
                                      ("s2", layer.shared_experts.fc2, 1, 1)):
            checks[name + " grad"] = (
                _reduced_grad(module.weight, st.dp_cp_group, ranks).double(),
                _tp_slice(w[name].grad, dim, s_))
    stats = moe.routing_statistics(layer, 1)
    for kind in moe.LOSS_KINDS:
        value = sum(ls[kind].item() for ls in losses if kind in ls) / dp
        checks[kind] = (stats[kind].double().view(1), torch.tensor([value], dtype=torch.float64))
    mpu.destroy_model_parallel()
    errors = {k: (float((a - b).abs().max()), float(b.abs().max())) for k, (a, b) in checks.items()}
    return errors, (float(stats["dropped_tokens"]), drops)


LAYOUTS_4 = [  # (tp, cp, ep, config)
    (1, 1, 2, dict(topk=2, aux_loss_coeff=0.01, z_loss_coeff=0.001)),
    (1, 1, 4, dict(topk=2, aux_loss_coeff=0.01, dispatcher="allgather", grouped_gemm=True)),
    (2, 1, 2, dict(topk=2, aux_loss_coeff=0.01, activation="swiglu",
                   shared_expert_intermediate_size=16, grouped_gemm=True)),
    (1, 2, 2, dict(topk=2, aux_loss_coeff=0.01, load_balancing_type="seq_aux_loss",
                   z_loss_coeff=0.001)),
    (2, 1, 2, dict(topk=3, score_function="sigmoid", enable_expert_bias=True,
                   aux_loss_coeff=0.01, dispatcher="allgather")),
]
EXHAUSTIVE_4 = [
    (1, 2, 2, dict(topk=1, pre_softmax=True, aux_loss_coeff=0.01, dispatcher="allgather",
                   activation="relu")),
    (1, 2, 4, dict(topk=2, aux_loss_coeff=0.01, grouped_gemm=True)),
    (2, 1, 1, dict(topk=2, aux_loss_coeff=0.01, z_loss_coeff=0.001)),
    (1, 1, 4, dict(topk=2, load_balancing_type="seq_aux_loss", aux_loss_coeff=0.01,
                   activation="geglu", shared_expert_intermediate_size=8)),
    (2, 1, 2, dict(topk=2, aux_loss_coeff=0.01, dispatcher="allgather", activation="geglu")),
]


def _layouts(layouts, seed):
    return [_one_layout(tp, cp, ep, kw, seed + i) for i, (tp, cp, ep, kw) in enumerate(layouts)]


def _assert_all_close(results, layouts):
    for per_rank in results:
        for (tp, cp, ep, kw), (checks, _) in zip(layouts, per_rank):
            for name, (err, scale) in checks.items():
                assert err <= 1e-5 * max(1.0, scale), (tp, cp, ep, kw, name, err, scale)


def test_block_equals_serial_reference_at_ep_tp_cp(seed):
    _assert_all_close(run_distributed(_layouts, 4, LAYOUTS_4, seed), LAYOUTS_4)


@pytest.mark.exhaustive
def test_block_equals_serial_reference_more_layouts(seed):
    _assert_all_close(run_distributed(_layouts, 4, EXHAUSTIVE_4, seed), EXHAUSTIVE_4)


def _capacity_at_ep2(seed):
    out = []
    for policy, dispatcher in (("position", "alltoall"), ("probs", "allgather")):
        kw = dict(topk=1 if policy == "position" else 2, pre_softmax=policy == "position",
                  token_drop_policy=policy, dispatcher=dispatcher, aux_loss_coeff=0.01)
        out.append(_one_layout(1, 1, 2, kw, seed, capacity_factor=1.0))
    return out


def test_capacity_drops_and_outputs_at_ep2_equal_the_switch_paper(seed):
    """Capacity per rank (its micro-batch's tokens), the drops summed over the ranks."""
    for per_rank in run_distributed(_capacity_at_ep2, 2, seed):
        for checks, (dropped, expected) in per_rank:
            for name, (err, scale) in checks.items():
                assert err <= 1e-5 * max(1.0, scale), (name, err, scale)
            assert dropped == expected and expected > 0
