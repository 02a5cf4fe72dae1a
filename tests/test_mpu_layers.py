"""Each tensor-parallel layer against its plain PyTorch counterpart, forward and backward.

Every rank builds the parallel layer and the reference from the same seed, feeds both the
same fresh random input and output-gradient, and compares outputs, input grads, and the
weight/bias grads (gathered from the ranks) with max abs error < 1e-5 (fp32).
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness import run_distributed
from megatron import mpu

TOL = 1e-5


def _gather(shard, dim):
    """Full tensor from the tensor-parallel shards along ``dim``."""
    parts = [torch.empty_like(shard) for _ in range(mpu.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, shard.contiguous(), group=mpu.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=dim)


def _shard(full, dim):
    size = full.size(dim) // mpu.get_tensor_model_parallel_world_size()
    return full.narrow(dim, mpu.get_tensor_model_parallel_rank() * size, size)


def _max_err(a, b):
    return (a - b).abs().max().item()


def _column(seed, gather_output):
    torch.manual_seed(seed)
    layer = mpu.ColumnParallelLinear(12, 16, gather_output=gather_output)
    full_bias = torch.randn(16)
    with torch.no_grad():
        layer.bias.copy_(_shard(full_bias, 0))
    ref = nn.Linear(12, 16)
    with torch.no_grad():
        ref.weight.copy_(_gather(layer.weight.detach(), 0))
        ref.bias.copy_(full_bias)
    x = torch.randn(5, 3, 12)
    dy = torch.randn(5, 3, 16)
    xp, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, bias = layer(xp)
    assert bias is None
    ref_out = ref(xr)
    if gather_output:
        out.backward(dy)
    else:
        out.backward(_shard(dy, -1))
        out = _gather(out.detach(), -1)
    ref_out.backward(dy)
    return {
        "out": _max_err(out, ref_out),
        "dx": _max_err(xp.grad, xr.grad),
        "dw": _max_err(_gather(layer.weight.grad, 0), ref.weight.grad),
        "db": _max_err(_gather(layer.bias.grad, 0), ref.bias.grad),
        "weight": _gather(layer.weight.detach(), 0),
    }


def _row(seed, input_is_parallel):
    torch.manual_seed(seed)
    layer = mpu.RowParallelLinear(16, 12, input_is_parallel=input_is_parallel)
    full_bias = torch.randn(12)
    with torch.no_grad():
        layer.bias.copy_(full_bias)
    ref = nn.Linear(16, 12)
    with torch.no_grad():
        ref.weight.copy_(_gather(layer.weight.detach(), 1))
        ref.bias.copy_(full_bias)
    x = torch.randn(4, 3, 16)
    dy = torch.randn(4, 3, 12)
    xr = x.clone().requires_grad_()
    xp = (_shard(x, -1) if input_is_parallel else x).clone().requires_grad_()
    out, _ = layer(xp)
    ref_out = ref(xr)
    out.backward(dy)
    ref_out.backward(dy)
    dx = _gather(xp.grad, -1) if input_is_parallel else xp.grad
    return {
        "out": _max_err(out, ref_out),
        "dx": _max_err(dx, xr.grad),
        "dw": _max_err(_gather(layer.weight.grad, 1), ref.weight.grad),
        "db": _max_err(layer.bias.grad, ref.bias.grad),
        "weight": _gather(layer.weight.detach(), 1),
    }


def _embedding(seed):
    torch.manual_seed(seed)
    layer = mpu.VocabParallelEmbedding(32, 8, init_method=nn.init.normal_)
    ref = nn.Embedding(32, 8)
    with torch.no_grad():
        ref.weight.copy_(_gather(layer.weight.detach(), 0))
    ids = torch.randint(0, 32, (6, 5))
    dy = torch.randn(6, 5, 8)
    out = layer(ids)
    ref_out = ref(ids)
    out.backward(dy)
    ref_out.backward(dy)
    return {
        "out": _max_err(out, ref_out),
        "dw": _max_err(_gather(layer.weight.grad, 0), ref.weight.grad),
        "weight": _gather(layer.weight.detach(), 0),
    }


def _cross_entropy(seed):
    torch.manual_seed(seed)
    logits = torch.randn(7, 3, 40) * 4
    target = torch.randint(0, 40, (7, 3))
    dloss = torch.rand(7, 3)
    lp = _shard(logits, -1).clone().requires_grad_()
    lr = logits.clone().requires_grad_()
    before = lp.detach().clone()
    loss = mpu.vocab_parallel_cross_entropy(lp, target)
    ref = F.cross_entropy(lr.view(-1, 40), target.view(-1), reduction="none").view(7, 3)
    loss.backward(dloss)
    ref.backward(dloss)
    # in place (the models' loss): the same values and gradients, the logits overwritten
    li = lp.detach().clone().requires_grad_()
    scaled = li * 1.0  # not a leaf: what an output layer hands the loss
    loss_inplace = mpu.vocab_parallel_cross_entropy(scaled, target, inplace=True)
    loss_inplace.backward(dloss)
    # the form compiled code traces (--compile): plain ops, its gradient through autograd
    from megatron.mpu.cross_entropy import _composed_cross_entropy

    lc = lp.detach().clone().requires_grad_()
    loss_composed = _composed_cross_entropy(lc, target, mpu.get_tensor_model_parallel_group())
    loss_composed.backward(dloss)
    return {"out": _max_err(loss, ref), "dx": _max_err(_gather(lp.grad, -1), lr.grad),
            "out_composed": _max_err(loss_composed, ref),
            "dx_composed": _max_err(_gather(lc.grad, -1), lr.grad),
            "input_untouched": _max_err(lp.detach(), before),
            "out_inplace": _max_err(loss_inplace, ref),
            "dx_inplace": _max_err(_gather(li.grad, -1), lr.grad),
            "overwritten": float(not torch.equal(scaled.detach(), before))}


def _run_all(tp, seed):
    mpu.initialize_model_parallel(tp, 1)
    return {
        "column_gather": _column(seed, True),
        "column_parallel_out": _column(seed + 1, False),
        "row": _row(seed + 2, False),
        "row_parallel_in": _row(seed + 3, True),
        "embedding": _embedding(seed + 4),
        "cross_entropy": _cross_entropy(seed + 5),
    }


@pytest.fixture(scope="module")
def layer_results(request):
    import random
    seed = random.SystemRandom().randrange(2**31)
    print(f"layer seed={seed}")
    return seed, {tp: run_distributed(_run_all, tp, tp, seed) for tp in (1, 2, 4)}


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layers_match_pytorch(layer_results, tp):
    seed, results = layer_results
    for rank, per_layer in enumerate(results[tp]):
        for layer, errors in per_layer.items():
            for what, err in errors.items():
                if what == "overwritten":  # in place: the logits now hold the softmax
                    assert err == 1.0, f"seed={seed} tp={tp} rank={rank}: logits not written"
                elif what != "weight":
                    assert err < TOL, f"seed={seed} tp={tp} rank={rank} {layer} {what}: {err}"


@pytest.mark.parametrize("tp", [2, 4])
def test_initialization_is_layout_invariant(layer_results, tp):
    seed, results = layer_results
    for layer in ("column_gather", "column_parallel_out", "row", "row_parallel_in", "embedding"):
        serial = results[1][0][layer]["weight"]
        for rank in range(tp):
            assert torch.equal(results[tp][rank][layer]["weight"], serial), (seed, tp, layer)


def _strided_column(seed):
    """A fused [Q; K; V] weight with stride 3: each rank keeps its rows of each projection."""
    torch.manual_seed(seed)
    layer = mpu.ColumnParallelLinear(8, 3 * 8, stride=3, keep_master_weight_for_test=True)
    tp, r = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
    q, k, v = layer.master_weight.chunk(3, dim=0)
    expected = torch.cat([m.chunk(tp, dim=0)[r] for m in (q, k, v)], dim=0)
    return torch.equal(layer.weight.detach(), expected), layer.master_weight


def test_strided_partition_keeps_each_projection_slice(seed):
    results = run_distributed(_strided_column_init, 2, seed)
    assert all(ok for ok, _ in results)
    assert torch.equal(results[0][1], results[1][1])


def _strided_column_init(seed):
    mpu.initialize_model_parallel(2, 1)
    return _strided_column(seed)


def _indivisible(kind):
    mpu.initialize_model_parallel(4, 1)
    try:
        if kind == "column":
            mpu.ColumnParallelLinear(8, 6)
        elif kind == "row":
            mpu.RowParallelLinear(10, 8)
        else:
            mpu.VocabParallelEmbedding(30, 8)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("kind,numbers", [("column", "output size (6)"),
                                          ("row", "input size (10)"),
                                          ("embedding", "vocabulary size (30)")])
def test_sizes_that_do_not_divide_tp_raise_on_every_rank(kind, numbers):
    messages = run_distributed(_indivisible, 4, kind, timeout=60)
    for m in messages:
        assert m is not None and numbers in m and "tensor-model-parallel size (4)" in m, m
