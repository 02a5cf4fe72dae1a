"""The mpu linears in FP8 at tensor-parallel size 2 against the same layers at tp 1.

On 2 gloo ranks, each layer kind (column- and row-parallel, plain and sequence-parallel) is
built twice from the same master weights: on the tp group, and on a group of one rank (tp
1). Both run the same fresh inputs and output gradient in FP8 under bf16 autocast.

- The scales: every inverse scale a tp-2 GEMM applies equals the one tp 1 applies to that
  part of the logical tensor (rowwise: its slice; tensorwise: the same number), so the amax
  of an operand split across the ranks was all-reduced (torchtitan #3109's trap). The same
  layers with the all-reduce switched off (local amaxes) must get some scale wrong: the check
  can fail.
- The values: where no rank sums another's partial result (a column-parallel output and
  weight gradient, a row-parallel input and weight gradient) tp 2 is bit-identical to tp 1;
  a result summed across ranks (the row-parallel output, the column-parallel input gradient)
  differs by the bf16 rounding of the partial sums only (< 1e-2 relative; an FP8 error is
  several percent).
- Deferral (zero-bubble B / W split) gives the undeferred FP8 gradients bit for bit; compiled
  (inductor, with ``emulate_precision_casts`` so its bf16 casts round as eager's do) the
  layers give the eager FP8 output, input and weight gradients bit for bit, deferring or
  not (the bias gradient, a sum, to rounding).
"""
import dataclasses

import pytest
import torch
import torch.distributed as dist

from harness import run_distributed

S, B, H, F = 16, 2, 32, 64
KINDS = ("column", "row", "column-sp", "row-sp")


def _build(kind, recipe, group):
    from megatron import mpu

    torch.manual_seed(1234)  # the same master weights for both groups
    sp = kind.endswith("-sp")
    if kind.startswith("column"):
        return mpu.ColumnParallelLinear(H, F, gather_output=False, group=group,
                                        sequence_parallel=sp, fp8=recipe)
    return mpu.RowParallelLinear(F, H, input_is_parallel=True, group=group,
                                 sequence_parallel=sp, fp8=recipe)


def _shard(t, dim, rank, parts=2):
    return t.chunk(parts, dim)[rank].contiguous()


def _run(layer, x, dy, store=None):
    """(output, input grad, weight grad, bias grad) of one FP8 forward and backward; with a
    store the backward is recorded and its weight GEMM flushed after."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, _ = layer(x)
    y.mul_(1.0)  # in place, as the output layer's padded-vocabulary mask writes its logits
    if store is None:
        y.backward(dy.to(y.dtype))
    else:
        with store.record(0):
            y.backward(dy.to(y.dtype))
        assert layer.weight.grad is None  # deferred to W
        assert store.flush(0) == 1
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def _inputs(kind, seed, rank):
    """(tp 1's input and dY, this tp-2 rank's) for the layer kind."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, B, H if kind.startswith("column") else F, generator=g)
    out = F if kind.startswith("column") else H
    dy = torch.randn(S, B, out, generator=g)
    # the split axis's second half smaller (0.3x: below half, so another power-of-two scale
    # on the rank holding it): dY's ``out`` at a column-parallel layer, X's ``in`` at a
    # row-parallel one, the operands whose amaxes must be all-reduced
    split = dy if kind.startswith("column") else x
    split[..., split.size(-1) // 2:] *= 0.3
    if kind == "column":
        return (x, dy), (x, _shard(dy, -1, rank))
    if kind == "column-sp":  # sequence shard in, columns out
        return (x, dy), (_shard(x, 0, rank), _shard(dy, -1, rank))
    if kind == "row":
        return (x, dy), (_shard(x, -1, rank), dy)
    return (x, dy), (_shard(x, -1, rank), _shard(dy, 0, rank))  # row-sp: sequence out


def _record_scales():
    """Patch Fp8Gemms._cast to record ``(operand, K axis) -> inverse scale``."""
    from megatron.mpu.fp8 import Fp8Gemms

    seen, original = {}, Fp8Gemms._cast

    def cast(self, t, operand, k_axis, dtype, amax=None):
        out = original(self, t, operand, k_axis, dtype, amax)
        seen[(operand, k_axis)] = out[1].detach().clone()
        return out

    Fp8Gemms._cast = cast
    return seen, lambda: setattr(Fp8Gemms, "_cast", original)


def _same_part(tp2, tp1, rank):
    """Whether a tp-2 scale equals tp 1's for this rank's part of the tensor."""
    if tp2.shape != tp1.shape:
        dim = next(d for d in range(tp1.dim()) if tp2.shape[d] != tp1.shape[d])
        tp1 = _shard(tp1, dim, rank)
    return torch.equal(tp2, tp1)


def _expected(kind, rank, ref):
    """tp 1's results cut to what this tp-2 rank holds."""
    y, dx, dw, db = ref
    col, sp = kind.startswith("column"), kind.endswith("-sp")
    y = _shard(y, -1, rank) if col else (_shard(y, 0, rank) if sp else y)
    dx = (_shard(dx, 0, rank) if sp else dx) if col else _shard(dx, -1, rank)
    dw = _shard(dw, 0 if col else 1, rank)
    db = _shard(db, 0, rank) if col else db
    return y, dx, dw, db


def _check_layers(seed, recipes, compile_kinds, compile_modes=("plain", "deferred")):
    """Rank body (2 ranks): see the module docstring. Returns what failed (empty: none) and,
    per recipe and kind, whether local amaxes gave this rank tp 1's scales too."""
    import torch._inductor.config as inductor_config

    from megatron import mpu

    mpu.initialize_model_parallel(2, 1)
    rank, tp_group = dist.get_rank(), mpu.get_tensor_model_parallel_group()
    singles = [dist.new_group([r]) for r in range(2)]
    failed, local = [], {}
    seen, restore = _record_scales()
    try:
        for name in recipes:
            recipe = mpu.Fp8Recipe(*name.split("-"))
            for kind in KINDS:
                (x1, dy1), (x2, dy2) = _inputs(kind, seed, rank)
                where = f"{name} {kind}"
                serial = _build(kind, recipe, singles[rank])
                ref = _run(serial, x1, dy1)
                scales1 = dict(seen)
                layer = _build(kind, recipe, tp_group)
                got = _run(layer, x2, dy2)
                scales2 = dict(seen)
                assert scales1.keys() == scales2.keys(), where
                failed += [f"{where}: scale of {k} differs from tp 1's" for k in scales1
                           if not _same_part(scales2[k], scales1[k], rank)]
                # the control: local amaxes get a split operand's scale wrong
                layer.fp8 = dataclasses.replace(layer.fp8, group=None)
                _run(layer, x2, dy2)
                local[where] = all(_same_part(seen[k], scales1[k], rank) for k in scales1)
                layer.fp8 = dataclasses.replace(layer.fp8, group=tp_group)
                failed += _compare(where, kind, got, _expected(kind, rank, ref))
                store = mpu.set_weight_grad_deferral(layer)
                deferred = _run(layer, x2, dy2, store)
                failed += [f"{where}: deferred {n} differs" for n, a, b in
                           zip(("y", "dx", "dw", "db"), deferred, got) if not torch.equal(a, b)]
                if kind in compile_kinds:
                    with inductor_config.patch(emulate_precision_casts=True):
                        failed += _compiled(where, layer, x2, dy2, store, got,
                                            compile_modes)
                mpu.set_weight_grad_deferral(layer, enabled=False)
    finally:
        restore()
    return failed, local


def _compare(where, kind, got, expected):
    """Bit-identical where no rank sums another's partial result, else < 1e-2 relative (a
    row-parallel sequence-parallel bias: each rank sums its part of the sequence)."""
    col = kind.startswith("column")
    summed = {"y": not col, "dx": col, "dw": False, "db": kind == "row-sp"}
    failed = []
    for (name, is_summed), a, b in zip(summed.items(), got, expected):
        if is_summed:
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            if not err < 1e-2:
                failed.append(f"{where}: {name} {err:.2e} from tp 1")
        elif not torch.equal(a, b):
            failed.append(f"{where}: {name} not bit-identical to tp 1")
    return failed


def _compiled(where, layer, x, dy, store, eager, modes):
    """The compiled layer (``modes``: plain, deferring) against its eager FP8 results."""
    from megatron import mpu

    failed = []
    forward = layer.forward
    for mode in modes:
        torch._dynamo.reset()
        mpu.set_weight_grad_deferral(layer, enabled=mode == "deferred", store=store)
        layer.forward = torch.compile(forward, dynamic=False)
        try:
            got = _run(layer, x, dy, store if mode == "deferred" else None)
        finally:
            layer.forward = forward
        failed += [f"{where}: compiled {mode} {n} differs from eager" for n, a, b in
                   zip(("y", "dx", "dw"), got, eager) if not torch.equal(a, b)]
        # the bias gradient is a sum of dY (the row-parallel one autograd's, outside the
        # FP8 function): inductor adds in another order
        torch.testing.assert_close(got[3], eager[3], rtol=1e-2, atol=1e-3)
    return failed


def _assert_layers(per_rank):
    assert [failed for failed, _ in per_rank] == [[], []], per_rank
    controls = [local for _, local in per_rank]
    # on the rank that holds a split operand's largest value its local amax is right:
    # the other one's is not
    wrong = [where for where in controls[0] if all(c[where] for c in controls)]
    assert not wrong, f"local amaxes gave tp 1's scales on both ranks: {wrong}"


def test_fp8_layers_at_tp2_equal_tp1(seed):
    """Two recipes, every layer kind; compiled: the deferring sequence-parallel column layer
    (the compiled plain path trains in tests/test_fp8_training.py; -m exhaustive has all)."""
    _assert_layers(run_distributed(_check_layers, 2, seed,
                                   ("hybrid-tensorwise", "e4m3-rowwise"), ("column-sp",),
                                   ("deferred",), timeout=600))


@pytest.mark.exhaustive
def test_fp8_layers_at_tp2_equal_tp1_every_recipe_compiled(seed):
    recipes = ("e4m3-tensorwise", "hybrid-tensorwise", "e4m3-rowwise", "hybrid-rowwise")
    _assert_layers(run_distributed(_check_layers, 2, seed, recipes, KINDS, timeout=1200))
