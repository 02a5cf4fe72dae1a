"""broadcast_data and model-parallel clip_grad_norm against serial references."""
import math

import pytest
import torch

from harness import run_distributed
from megatron import mpu


def _broadcast(seed):
    mpu.initialize_model_parallel(2, 1)
    keys = ["text", "mask", "empty"]
    torch.manual_seed(seed + mpu.get_data_parallel_rank())  # differs across dp, same within tp
    source = {"text": torch.randint(0, 1000, (3, 17)), "mask": torch.randint(0, 2, (3, 1, 17)),
              "empty": torch.zeros(0, 4, dtype=torch.long)}
    data = source if mpu.get_tensor_model_parallel_rank() == 0 else None
    got = mpu.broadcast_data(keys, data, torch.long)
    same = all(torch.equal(got[k], source[k]) for k in keys)
    # A bad batch on the source rank is an error on every rank, not a hang.
    bad = dict(source, mask=source["mask"].float())
    try:
        mpu.broadcast_data(keys, bad if data is not None else None, torch.long)
        error = None
    except ValueError as exc:
        error = str(exc)
    return same, error


def test_broadcast_data_identical_on_every_tp_rank(seed):
    results = run_distributed(_broadcast, 4, seed)
    assert all(same for same, _ in results)
    assert "'mask' has dtype torch.float32" in results[0][1]
    assert all(error is not None for _, error in results)


def _broadcast_known_shapes(seed):
    from sync_count import SyncCounter

    mpu.initialize_model_parallel(2, 1)
    keys, shapes = ["text", "mask"], [(3, 17), (3, 1, 17)]
    torch.manual_seed(seed + mpu.get_data_parallel_rank())
    source = {"text": torch.randint(0, 1000, (3, 17)), "mask": torch.randint(0, 2, (3, 1, 17))}
    data = source if mpu.get_tensor_model_parallel_rank() == 0 else None
    with SyncCounter() as counter:
        got = mpu.broadcast_data(keys, data, torch.long, shapes=shapes)
    same = all(torch.equal(got[k], source[k]) for k in keys)
    bad = dict(source, text=source["text"][:, :16])
    try:
        mpu.broadcast_data(keys, bad if data is not None else None, torch.long, shapes=shapes)
        error = None
    except ValueError as exc:
        error = str(exc)
    return same, counter.events, error


def test_broadcast_data_with_known_shapes_reads_nothing_back(seed):
    results = run_distributed(_broadcast_known_shapes, 4, seed)
    assert all(same for same, _, _ in results)
    assert all(events == [] for _, events, _ in results), results
    # the source names the problem; the others received zeros and go on
    assert "'text' has shape (3, 16), expected (3, 17)" in results[0][2]
    assert results[1][2] is None


# ---------------------------------------------------------------- clip_grad_norm
def _serial_params(seed):
    """A serial 'model': (name, full grad, kind), kind in split0/split1/replicated/tied."""
    g = torch.Generator().manual_seed(seed)
    return [
        ("emb", torch.randn(16, 6, generator=g), "tied"),      # on first and last stage
        ("col_w", torch.randn(8, 6, generator=g), "split0"),
        ("col_b", torch.randn(8, generator=g), "split0"),
        ("row_w", torch.randn(6, 8, generator=g), "split1"),
        ("row_b", torch.randn(6, generator=g), "replicated"),
        ("ln_w", torch.randn(6, generator=g) * 3, "replicated"),
        ("col2_w", torch.randn(4, 6, generator=g), "split0"),
    ]


def _stage_of(index, pp):
    return index % pp


def _local_params(serial, tp_rank, tp, pp_rank, pp):
    params = []
    for i, (name, grad, kind) in enumerate(serial):
        on_stage = (pp_rank in (0, pp - 1)) if kind == "tied" else _stage_of(i, pp) == pp_rank
        if not on_stage:
            continue
        if kind in ("split0", "split1", "tied"):
            dim = 1 if kind == "split1" else 0
            size = grad.size(dim) // tp
            local = grad.narrow(dim, tp_rank * size, size).clone()
        else:
            local = grad.clone()
        p = torch.nn.Parameter(torch.zeros_like(local))
        p.grad = local
        mpu.set_tensor_model_parallel_attributes(p, kind != "replicated", 0, 1)
        if kind == "tied" and pp > 1 and pp_rank == pp - 1:
            p.shared = True  # the last stage's copy of the first stage's embedding
        params.append((i, kind, p))
    return params


def _clip(tp, pp, seed, max_norm, norm_type):
    mpu.initialize_model_parallel(tp, pp)
    s = mpu.get_parallel_state()
    local = _local_params(_serial_params(seed), s.tp_rank, tp, s.pp_rank, pp)
    norm = mpu.clip_grad_norm([p for _, _, p in local], max_norm, norm_type)
    return norm, [(i, kind, p.grad) for i, kind, p in local]


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (2, 2), (1, 4)])
def test_clip_grad_norm_matches_serial(seed, tp, pp, norm_type):
    serial = _serial_params(seed)
    ref = [torch.nn.Parameter(torch.zeros_like(g)) for _, g, _ in serial]
    for p, (_, g, _) in zip(ref, serial):
        p.grad = g.clone()
    max_norm = 0.5 if norm_type == 2.0 else 1.0
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, max_norm, norm_type).item()
    results = run_distributed(_clip, tp * pp * 2, tp, pp, seed, max_norm, norm_type)
    for rank, (norm, grads) in enumerate(results):
        assert abs(norm - ref_norm) <= 1e-5 * ref_norm, (rank, norm, ref_norm)
        tp_rank = rank % tp
        for i, kind, grad in grads:
            full = ref[i].grad
            if kind in ("split0", "split1", "tied"):
                dim = 1 if kind == "split1" else 0
                size = full.size(dim) // tp
                full = full.narrow(dim, tp_rank * size, size)
            torch.testing.assert_close(grad, full, rtol=1e-5, atol=1e-6)
