"""Pipeline schedules as action lists: generators, checker, simulator and the runner.

The runner tests run toy chunks (y = tanh(x W_c) * mask, the last chunk's loss
sum(y * target)) with hand-written backward passes on real gloo ranks and compare losses,
weight gradients and input gradients with one autograd pass over the whole chain.
"""
import os
import sys

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed
from tds.pipe.contract import StageContract
from tds.pipe.p2p import StageLink
from tds.pipe.runner import Boundary, ScheduleRunner, StageCallbacks
from tds.pipe.schedule_check import check_schedule, match_messages
from tds.pipe.schedules import (Backward, Exchange, Forward, RecvAct, RecvGrad, SendAct,
                                SendGrad, interleaved_1f1b, one_f_one_b, zb_h1)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
from pipeline_simulator import Costs, simulate  # noqa: E402

SEQ, BATCH, HIDDEN = 4, 2, 6


def _schedule(name, p, v, m):
    if name == "1f1b":
        return one_f_one_b(p, m), 1
    if name == "interleaved":
        return interleaved_1f1b(p, v, m), v
    return zb_h1(p, m), 1


# ---------------------------------------------------------------- generators + checker
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_generated_schedules_pass_the_checker(p):
    for m in sorted({1, p, 2 * p, 2 * p + 1, 3 * p - 1, 5}):
        check_schedule(one_f_one_b(p, m), p, 1, m)
        check_schedule(zb_h1(p, m), p, 1, m)
        for v in (1, 2, 3, 4) if p > 1 else ():
            check_schedule(interleaved_1f1b(p, v, m), p, v, m)


def test_every_chunk_and_micro_batch_runs_once_on_its_owner():
    p, v, m = 4, 3, 9  # checked independently of the checker
    actions = interleaved_1f1b(p, v, m)
    for kind in (Forward, Backward):
        done = sorted((a.chunk, a.mb, r) for r, acts in enumerate(actions) for a in acts
                      if type(a) is kind)
        assert done == sorted((c, mb, c % p) for c in range(p * v) for mb in range(m))


def _find(actions, rank, predicate):
    return next(i for i, a in enumerate(actions[rank]) if predicate(a))


def _raises(actions, p, v, m, *fragments):
    with pytest.raises(ValueError) as info:
        check_schedule(actions, p, v, m)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_checker_rejects_a_dropped_send():
    actions, send = one_f_one_b(4, 4), SendAct(2, 1, 3)
    index = _find(actions, 1, lambda a: a == send or isinstance(a, Exchange) and send in a.ops)
    rest = tuple(op for op in getattr(actions[1][index], "ops", ()) if op != send)
    actions[1][index:index + 1] = [Exchange(rest)] if len(rest) > 1 else list(rest)
    forward = _find(actions, 1, lambda a: a == Forward(1, 3))
    _raises(actions, 4, 1, 4, f"rank 1 action {forward} Forward(chunk=1, mb=3)",
            "never sent", "SendAct(peer=2, chunk=1, mb=3)")


def test_checker_rejects_a_receive_without_send():
    actions = one_f_one_b(2, 2)
    actions[1].append(RecvAct(0, 0, 1))
    _raises(actions, 2, 1, 2, f"rank 1 action {len(actions[1]) - 1}", "received a second time")


def test_checker_rejects_an_order_that_deadlocks():
    """Two partner exchanges posted as receive-then-send on both sides wait on each other."""
    actions = one_f_one_b(2, 4)
    index = _find(actions, 0, lambda a: isinstance(a, Exchange))
    partner = match_messages(actions)[(0, index, 0)]
    for rank, i in ((0, index), (1, partner[1])):
        ops = actions[rank][i].ops
        recvs = [op for op in ops if isinstance(op, (RecvAct, RecvGrad))]
        actions[rank][i:i + 1] = recvs + [op for op in ops if op not in recvs]
    message = _raises(actions, 2, 1, 4, "deadlocks", f"rank 0 action {index}",
                      "waits for rank 1's action", f"but rank 1 is at action {partner[1]}")
    assert f"rank 1 action {partner[1]}" in message


def test_checker_rejects_a_backward_before_its_forward():
    actions = one_f_one_b(2, 3)
    f, b = (_find(actions, 1, lambda a, k=k: a == k(1, 0)) for k in (Forward, Backward))
    actions[1][f], actions[1][b] = actions[1][b], actions[1][f]
    _raises(actions, 2, 1, 3, f"rank 1 action {f} Backward(chunk=1, mb=0)",
            "backward before the forward")


def test_checker_rejects_a_chunk_on_the_wrong_rank():
    actions = interleaved_1f1b(2, 2, 4)
    index = _find(actions, 0, lambda a: a == Forward(2, 1))
    actions[0][index] = Forward(3, 1)
    _raises(actions, 2, 2, 4, f"rank 0 action {index} Forward(chunk=3, mb=1)",
            "chunk 3 lives on rank 1")


def test_checker_rejects_a_send_to_itself():
    actions = one_f_one_b(2, 2)
    index = _find(actions, 0, lambda a: a == SendAct(1, 0, 0))
    actions[0][index] = SendAct(0, 0, 0)
    _raises(actions, 2, 1, 2, f"rank 0 action {index}", "itself")


def test_checker_rejects_next_previous_confusion_at_pp2():
    """pp = 2: activation and gradient from rank 0 share one channel; swapping the order
    in which rank 1 receives them (Megatron's pp = 2 bug) hands one for the other."""
    actions = interleaved_1f1b(2, 2, 4)
    index = _find(actions, 1, lambda a: isinstance(a, Exchange) and
                  {type(op) for op in a.ops} >= {RecvAct, RecvGrad})
    ops = list(actions[1][index].ops)
    act, grad = (next(i for i, op in enumerate(ops) if isinstance(op, k))
                 for k in (RecvAct, RecvGrad))
    ops[act], ops[grad] = ops[grad], ops[act]
    actions[1][index] = Exchange(tuple(ops))
    _raises(actions, 2, 2, 4, f"rank 1 action {index}", "would receive",
            "SendAct(peer=1", "posting order")


def test_checker_rejects_a_grad_sent_to_the_wrong_peer():
    actions = one_f_one_b(4, 4)
    index = _find(actions, 2, lambda a: a == SendGrad(1, 2, 0))
    actions[2][index] = SendGrad(3, 2, 0)
    _raises(actions, 4, 1, 4, f"rank 2 action {index}", "names peer rank 3")


def _last_chunk_swapped(p, v, m):
    """Interleaved 1F1B's computation orders with the last chunk's forward and backward of
    micro-batches 0 and 1 swapped on its rank, lowered: well formed, well paired and
    deadlock-free, but the last chunk runs micro-batch 1 first while chunk 0 loads 0."""
    from tds.pipe.schedules import _alternate, interleaved_order, interleaved_warmup, lower

    last = p * v - 1

    def swap(step):
        if isinstance(step, tuple):
            return tuple(swap(action) for action in step)
        if isinstance(step, (Forward, Backward)) and step.chunk == last and step.mb < 2:
            return type(step)(last, 1 - step.mb)
        return step

    steps = [_alternate(interleaved_order(p, v, m, r, backward=False),
                        interleaved_order(p, v, m, r, backward=True),
                        interleaved_warmup(p, v, m, r), paired=True) for r in range(p)]
    steps[last % p] = [swap(step) for step in steps[last % p]]
    return lower(steps, p, v)


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (4, 2, 8)])
def test_checker_rejects_labels_read_in_another_order_than_inputs(p, v, m):
    """The interleaved step reads chunk 0's inputs and the last chunk's labels from the data
    in call order: a schedule whose last chunk runs the micro-batches in another order would
    train micro-batch 1's inputs against micro-batch 0's labels."""
    from tds.pipe.schedule_check import simulate_deadlock

    actions, last = _last_chunk_swapped(p, v, m), p * v - 1
    simulate_deadlock(actions, match_messages(actions))  # every other property holds
    read = _find(actions, last % p, lambda a: isinstance(a, Forward) and a.chunk == last)
    load = _find(actions, 0, lambda a: isinstance(a, Forward) and a.chunk == 0)
    assert actions[last % p][read] == Forward(last, 1) and actions[0][load] == Forward(0, 0)
    message = _raises(actions, p, v, m, f"rank {last % p} action {read} "
                      f"Forward(chunk={last}, mb=1): the last chunk's forward number 1 is "
                      f"micro-batch 1, but chunk 0's forward number 1 (rank 0 action {load} "
                      f"Forward(chunk=0, mb=0)) is micro-batch 0",
                      "same micro-batch order")
    assert message.startswith("pipeline schedule: "), message


# ---------------------------------------------------------------- simulator
def _formula(name, p, v, m):
    return {"1f1b": (p - 1) / (m + p - 1), "interleaved": (p - 1) / (v * m + p - 1),
            "zb-h1": (p - 1) / (3 * m + p - 1)}[name]


def test_simulator_follows_the_blocking_semantics_by_hand():
    """p = 2, m = 1: F0 | send | F1 B1 | send | B0 = 1 + .5 + 1 + 2 + .5 + 2."""
    result = simulate(one_f_one_b(2, 1), 1, Costs(forward=1, backward=2, p2p=0.5))
    assert result.step_time == pytest.approx(7.0)
    assert result.bubble == pytest.approx([4 / 7, 4 / 7])


@pytest.mark.parametrize("p", [2, 4, 8])
def test_simulated_bubble_matches_the_formulas(p):
    """Unit costs (f = 1, b = 2, or 1 + 1 split), no latency: exactly the textbook bubble
    for m >= p, including m not a multiple of p for the interleaved schedule."""
    for m in (p, 2 * p, 2 * p + 1, 16):
        one = simulate(one_f_one_b(p, m), 1, Costs())
        assert one.bubble == pytest.approx([_formula("1f1b", p, 1, m)] * p, abs=1e-12)
        zb = simulate(zb_h1(p, m), 1, Costs())
        assert zb.overall_bubble == pytest.approx(_formula("zb-h1", p, 1, m), abs=1e-12)
        for v in (2, 4):
            inter = simulate(interleaved_1f1b(p, v, m), v, Costs())
            assert inter.overall_bubble == pytest.approx(_formula("interleaved", p, v, m),
                                                         abs=1e-12)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_activations_in_flight_on_rank_zero(p):
    for m in (1, p, 2 * p, 2 * p + 1):
        assert simulate(one_f_one_b(p, m), 1, Costs()).peak_in_flight[0] == min(p, m)
        zb = simulate(zb_h1(p, m), 1, Costs()).peak_in_flight
        assert zb[0] == min(p, m) and max(zb) <= p  # ZB-H1 keeps 1F1B's peak
        for v in (2, 3):
            # Megatron's warm-up 2 (p - 1) + (v - 1) g on rank 0, g = first group's size:
            # p when p | m; m spread over floor(m / p) groups, larger first, otherwise.
            first_group = -(-m // max(m // p, 1))
            warmup = 2 * (p - 1) + (v - 1) * first_group
            peak = simulate(interleaved_1f1b(p, v, m), v, Costs()).peak_in_flight[0]
            assert peak == min(warmup + 1, v * m)


def test_interleaving_shrinks_the_bubble_when_p_does_not_divide_m():
    for p, m in ((2, 5), (4, 9), (4, 10), (8, 12)):
        one = simulate(one_f_one_b(p, m), 1, Costs()).overall_bubble
        two = simulate(interleaved_1f1b(p, 2, m), 2, Costs()).overall_bubble
        assert two < one


# ---------------------------------------------------------------- runner on gloo ranks
class ToyChunks(StageCallbacks):
    """Chunk c: y = tanh(x @ W_c) * mask; the last chunk returns sum(y * target).

    Backward passes are written out by hand (input and weight parts separately), so the
    autograd reference below is an independent computation.
    """

    def __init__(self, seed, num_chunks, m):
        gen = torch.Generator().manual_seed(seed)
        self.weights = [torch.randn(HIDDEN, HIDDEN, generator=gen) / HIDDEN ** 0.5
                        for _ in range(num_chunks)]
        self.xs = [torch.randn(SEQ, BATCH, HIDDEN, generator=gen) for _ in range(m)]
        self.masks = [torch.rand(SEQ, BATCH, generator=gen) > 0.3 for _ in range(m)]
        self.targets = [torch.randn(SEQ, BATCH, HIDDEN, generator=gen) for _ in range(m)]
        self.num_chunks = num_chunks
        self.weight_grads = {c: torch.zeros(HIDDEN, HIDDEN) for c in range(num_chunks)}
        self.input_grads, self.stash = {}, {}

    def load(self, mb):
        return self.xs[mb], self.masks[mb]

    def forward(self, chunk, mb, inputs):
        x, mask = inputs
        y = torch.tanh(x.detach() @ self.weights[chunk]) * mask[..., None]  # [s, b, h]
        self.stash[(chunk, mb)] = (x.detach(), y, mask)
        if chunk == self.num_chunks - 1:
            return (y * self.targets[mb]).sum()
        return y, mask

    def backward_input(self, chunk, mb, output_grads):
        x, y, mask = self.stash[(chunk, mb)]
        dy = self.targets[mb] if output_grads is None else output_grads[0]
        pre = dy * (1 - y * y) * mask[..., None]
        self.stash[(chunk, mb)] = (x, pre)
        dx = pre @ self.weights[chunk].t()
        if chunk == 0:
            self.input_grads[mb] = dx
        return dx, None

    def backward_weight(self, chunk, mb):
        x, pre = self.stash.pop((chunk, mb))
        self.weight_grads[chunk] += x.reshape(-1, HIDDEN).t() @ pre.reshape(-1, HIDDEN)

    def backward(self, chunk, mb, output_grads):
        grads = self.backward_input(chunk, mb, output_grads)
        self.backward_weight(chunk, mb)
        return grads


def _reference(seed, num_chunks, m):
    toy = ToyChunks(seed, num_chunks, m)
    weights = [w.clone().requires_grad_() for w in toy.weights]
    losses, input_grads = [], []
    for mb in range(m):
        x = toy.xs[mb].clone().requires_grad_()
        y = x
        for w in weights:
            y = torch.tanh(y @ w) * toy.masks[mb][..., None]
        loss = (y * toy.targets[mb]).sum()
        loss.backward()
        losses.append(loss.detach())
        input_grads.append(x.grad)
    return losses, [w.grad for w in weights], input_grads


def _run_schedules(cases, seed, tp):
    """On every rank: run each (name, p, v, m) and return what this rank computed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tp_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(world // tp)]
    pp_rank, tp_rank = divmod(rank, tp)
    link = StageLink(tp_groups[pp_rank], torch.device("cpu"))
    contract = StageContract.build(["float", "bool"], [True, False], [tp > 1, False])
    meta = (((SEQ, BATCH, HIDDEN), torch.float32), ((SEQ, BATCH), torch.bool))
    out = []
    for name, p, v, m in cases:
        actions, v = _schedule(name, p, v, m)
        runner = ScheduleRunner(actions, v, m, [s * tp + tp_rank for s in range(p)], link,
                                Boundary(contract, meta))
        toy = ToyChunks(seed, p * v, m)
        sent_before = link.bytes_sent
        results = runner.run(toy)
        mine = range(pp_rank, p * v, p)
        # numpy, not tensors: tensors leave a rank through shared memory it owns
        out.append({"losses": {mb: t.detach().numpy() for mb, t in results.items()},
                    "input_grads": {mb: t.numpy() for mb, t in toy.input_grads.items()},
                    "weight_grads": {c: toy.weight_grads[c].numpy() for c in mine},
                    "bytes_sent": link.bytes_sent - sent_before,
                    "actions": actions[pp_rank]})
    return out


def _expected_bytes(actions, tp):
    hidden, mask = SEQ * BATCH * HIDDEN * 4 // tp, SEQ * BATCH
    ops = [op for a in actions for op in (a.ops if isinstance(a, Exchange) else (a,))]
    return sum(hidden + mask for op in ops if isinstance(op, SendAct)) + \
        sum(hidden for op in ops if isinstance(op, SendGrad))


def _compare(cases, per_rank, seed, tp):
    for k, (name, p, v, m) in enumerate(cases):
        chunks = p * (v if name == "interleaved" else 1)
        losses, weight_grads, input_grads = _reference(seed, chunks, m)
        for rank, results in enumerate(per_rank):
            got, pp_rank = results[k], rank // tp
            where = f"{name} p={p} v={v} m={m} rank {rank}"
            assert got["bytes_sent"] == _expected_bytes(got["actions"], tp), where
            for c, grad in got["weight_grads"].items():
                torch.testing.assert_close(torch.from_numpy(grad), weight_grads[c], msg=where)
            if pp_rank == (chunks - 1) % p:
                assert sorted(got["losses"]) == list(range(m)), where
                for mb in range(m):
                    torch.testing.assert_close(torch.from_numpy(got["losses"][mb]), losses[mb],
                                               msg=where)
            if pp_rank == 0:
                for mb in range(m):
                    torch.testing.assert_close(torch.from_numpy(got["input_grads"][mb]),
                                               input_grads[mb], msg=where)


def _cases(p):
    cases = [(name, p, 2, m) for name in ("1f1b", "interleaved", "zb-h1")
             for m in (p, 2 * p + 1)]
    return cases + [("interleaved", p, 3, 2 * p + 1)] if p == 2 else cases


@pytest.mark.parametrize("p", [2, 4])
def test_runner_matches_a_serial_computation(p, seed):
    cases = _cases(p)
    _compare(cases, run_distributed(_run_schedules, p, cases, seed, 1), seed, 1)


def test_runner_with_tensor_parallel_partitioned_positions(seed):
    cases = [(name, 2, 2, m) for name in ("1f1b", "interleaved") for m in (2, 5)]
    _compare(cases, run_distributed(_run_schedules, 4, cases, seed, 2), seed, 2)


def _bad_runner(kind):
    link = StageLink(dist.new_group([dist.get_rank()]), torch.device("cpu"))
    contract = StageContract.build(["float"], [True], None)
    boundary = Boundary(contract, (((SEQ, BATCH, HIDDEN), torch.float32),))
    actions = one_f_one_b(2, 2)
    if kind == "schedule":
        del actions[1][-1]  # rank 1 never sends its last gradient
    runner = ScheduleRunner(actions, 1, 2, [0, 1], link, boundary)

    class ForwardOnly(StageCallbacks):
        def forward(self, chunk, mb, inputs):
            return inputs

    runner.run(ForwardOnly())


@pytest.mark.parametrize("kind", ["schedule", "callbacks"])
def test_runner_fails_on_every_rank_before_any_step(kind):
    with pytest.raises(Exception) as info:
        run_distributed(_bad_runner, 2, kind, timeout=60)
    message = str(info.value)
    for rank in (0, 1):
        assert f"rank {rank} raised" in message, message
    fragment = "rank 1 action" if kind == "schedule" else "needs callbacks load, backward"
    assert fragment in message, message


# ---------------------------------------------------------------- measured bubble
def _time_bubble(pp, cases, steps, forward_s):
    from pipeline_bubble import _time_runner

    return _time_runner(pp, cases, steps, forward_s)


@pytest.mark.slow
@pytest.mark.alone  # its bounds (10 %) assume idle cores: a busy neighbour halves the margin
def test_measured_bubble_shrinks_as_predicted():
    """Sleep-calibrated equal stages (50 ms forward, 100 ms backward) on 4 gloo ranks:
    interleaving (v = 2) beats 1F1B by the simulator's ratio, within noise (about 20 s)."""
    from pipeline_bubble import _step_stats

    p, m, steps, forward_s = 4, 8, 3, 0.05
    cases = [("1f1b", 1, m), ("interleaved", 2, m)]
    per_rank = run_distributed(_time_bubble, p, p, cases, steps, forward_s, timeout=300)
    latency = per_rank[0][0]
    costs = Costs(forward_s, 2 * forward_s, forward_s, forward_s, latency)
    measured, predicted = {}, {}
    for name, v, _ in cases:
        measured[name] = _step_stats([rank[1][(name, v, m)] for rank in per_rank])[0]
        actions, v = _schedule(name, p, v, m)
        predicted[name] = simulate(actions, v, costs).step_time
        assert 0.95 < measured[name] / predicted[name] < 1.10, (name, measured, predicted)
    ratio = measured["interleaved"] / measured["1f1b"]
    assert ratio < predicted["interleaved"] / predicted["1f1b"] + 0.05, (measured, predicted)
    assert ratio < 0.95, (measured, predicted)
