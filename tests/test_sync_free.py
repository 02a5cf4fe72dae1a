"""tds.sync_free: DeepSpeed's ZeRO and bf16 optimizers with the norm and clipping on the device.

Reference: DeepSpeed's own step (``sync_free_step=False``) on the same model, data and
config, in the same rank process. The optimizer is plain SGD (DeepSpeed's ZeRO takes it with
``zero_allow_untested_optimizer``) so the update is the clipped gradient itself: a missing or
wrong clip, or a norm over the wrong partition, changes the weights by a large fraction of
the update (the clip binds: max norm 0.05, gradient norms ~0.5-2). The reads a step makes are
counted (tests/sync_count.py): DeepSpeed's own step reads, the sync-free one does not.

Checkpoints cross in both directions: a state saved by DeepSpeed's own step (which records
``clip_grad`` > 0, refused by DeepSpeed with ``compute_grad_norm: false``) loads into a
sync-free run, and one saved by a sync-free run loads into DeepSpeed's and still clips.
"""
import math

import pytest
import torch

from harness import run_distributed
from precision import requires_ds_bf16
from sync_count import SyncCounter

CLIP = 0.05
LR = 0.1
DP = 2
MICRO, GAS = 4, 2


def _config(stage, bf16=False, fp32_accumulation=False):
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
              "train_batch_size": MICRO * GAS * DP, "gradient_clipping": CLIP,
              "steps_per_print": 10**9, "zero_allow_untested_optimizer": True,
              # as the project's config (backend_engine._quiet_timers): the counter also sees
              # the throughput timer's device waits, which are not the optimizer step's
              "timers": {"throughput": {"enabled": False}}}
    if stage:
        config["zero_optimization"] = {"stage": stage}
    if bf16:
        config["bf16"] = {"enabled": True}
    if fp32_accumulation:
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def _batches(steps, seed):
    """Per step, GAS micro-batches (x, y), different on each data-parallel rank."""
    gen = torch.Generator().manual_seed(seed * 100 + torch.distributed.get_rank())
    return [[(torch.randn(MICRO, 16, generator=gen), torch.randn(MICRO, 8, generator=gen))
             for _ in range(GAS)] for _ in range(steps)]


def _engine(config, sync_free, seed):
    import tds

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, _, _, _ = tds.initialize(model=model, optimizer=optimizer, config=config,
                                     dist_init_required=False, sync_free_step=sync_free)
    return engine


def _train(engine, batches):
    """Train on ``batches``; per step the reported norm (a float) and the reads counted."""
    dtype = next(engine.module.parameters()).dtype
    norms, reads = [], []
    for step in batches:
        with SyncCounter() as counter:
            for x, y in step:
                loss = torch.nn.functional.mse_loss(engine(x.to(dtype)).float(), y)
                engine.backward(loss)
                engine.step()
            norm = engine.get_global_grad_norm()
        reads.append(len(counter.events))
        norms.append(float(norm))
    return norms, reads


def _weights(engine):
    return torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])


def _rank_compare(config, steps, seed):
    """Both engines from the same weights on the same batches (and, for ZeRO, each continued
    from the other's checkpoint)."""
    import tds

    tds.init_distributed(dist_backend="gloo")
    first, second = _batches(steps, seed), _batches(steps, seed + 1)
    ours, theirs = _engine(config, True, seed), _engine(config, False, seed)
    out = {"initial": _weights(ours), "sync_free": (ours.sync_free_step, theirs.sync_free_step),
           "optimizer": type(ours.optimizer).__name__}
    out["ours"], out["theirs"] = _train(ours, first), _train(theirs, first)
    out["w_ours"], out["w_theirs"] = _weights(ours), _weights(theirs)
    if config.get("zero_optimization"):
        # cross: each kind of run resumes from the other's state and trains on
        states = (ours.optimizer.state_dict(), theirs.optimizer.state_dict())
        module_states = (ours.module.state_dict(), theirs.module.state_dict())
        out["clip_saved"] = (states[0]["clip_grad"], states[1]["clip_grad"])
        for name, engine, (state, module_state), reference in (
                ("ours_from_theirs", _engine(config, True, seed), (states[1], module_states[1]),
                 theirs),
                ("theirs_from_ours", _engine(config, False, seed), (states[0], module_states[0]),
                 ours)):
            engine.module.load_state_dict(module_state)
            engine.optimizer.load_state_dict([state] * DP, load_from_fp32_weights=True)
            _train(engine, second)
            _train(reference, second)
            out[name] = (_weights(engine), _weights(reference))
    return out


def _close(a, b, update, rel):
    """``a`` and ``b`` agree to ``rel`` of the size of the update they made."""
    return float((a - b).abs().max()) <= rel * float(update.abs().max())


CASES = [
    pytest.param(_config(1), 1e-5, "SyncFreeZeroOptimizer", id="zero1-fp32"),
    pytest.param(_config(2), 1e-5, "SyncFreeZeroOptimizer", id="zero2-fp32",
                 marks=pytest.mark.slow),
    pytest.param(_config(1, bf16=True), 2e-2, "SyncFreeZeroOptimizer", id="zero1-bf16",
                 marks=[pytest.mark.precision, requires_ds_bf16]),
    pytest.param(_config(1, bf16=True, fp32_accumulation=True), 2e-2, "SyncFreeBF16Optimizer",
                 id="bf16-optimizer",
                 marks=[pytest.mark.slow, pytest.mark.precision, requires_ds_bf16]),
]


@pytest.mark.parametrize("config, rel, optimizer", CASES)
def test_sync_free_step_equals_deepspeeds_without_reads(config, rel, optimizer, seed):
    steps = 3
    for out in run_distributed(_rank_compare, DP, config, steps, seed % 1000, timeout=300):
        assert out["sync_free"] == (True, False) and out["optimizer"] == optimizer
        update = out["w_theirs"] - out["initial"]
        assert _close(out["w_ours"], out["w_theirs"], update, rel)
        (norms, reads), (ref_norms, ref_reads) = out["ours"], out["theirs"]
        assert max(norms) > 5 * CLIP  # the clip binds
        for a, b in zip(norms, ref_norms):
            assert math.isclose(a, b, rel_tol=1e-5 if rel < 1e-3 else 1e-2), (norms, ref_norms)
        assert reads[1:] == [0] * (steps - 1), reads  # the first step builds DeepSpeed's state
        assert all(r > 0 for r in ref_reads[1:]), ref_reads  # the counter sees DeepSpeed's
        if "ours_from_theirs" in out:
            assert out["clip_saved"] == (CLIP, CLIP)
            for a, b in (out["ours_from_theirs"], out["theirs_from_ours"]):
                assert _close(a, b, update, rel)


def _rank_non_finite(config):
    """A step whose gradient is nan: DeepSpeed's step skips it, the sync-free one applies it
    and reports the norm as non-finite (the caller stops on it when it reads it)."""
    import tds

    tds.init_distributed(dist_backend="gloo")
    batches = _batches(2, 7)
    batches[1][0] = (torch.full_like(batches[1][0][0], math.nan), batches[1][0][1])
    out = {}
    for name, sync_free in (("ours", True), ("theirs", False)):
        engine = _engine(config, sync_free, 7)
        norms, _ = _train(engine, batches)
        out[name] = (norms, bool(torch.isfinite(_weights(engine)).all()),
                     bool(getattr(engine.optimizer, "overflow", False)))
    return out


def test_non_finite_norm_is_reported_not_skipped():
    for out in run_distributed(_rank_non_finite, DP, _config(1), timeout=300):
        norms, finite, overflow = out["ours"]
        assert math.isfinite(norms[0]) and not math.isfinite(norms[1])
        assert not finite and not overflow
        ref_norms, ref_finite, ref_overflow = out["theirs"]
        assert not math.isfinite(ref_norms[1]) and ref_finite and ref_overflow


def test_prepare_config_leaves_fp16_and_offload_to_deepspeed():
    from tds.sync_free import prepare_config

    config, max_norm = prepare_config(_config(1))
    assert max_norm == CLIP and config["gradient_clipping"] == 0.0
    assert config["zero_optimization"] == {"stage": 1, "compute_grad_norm": False}
    assert _config(1)["gradient_clipping"] == CLIP  # a copy: the caller's is unchanged
    config, _ = prepare_config(_config(2, bf16=True))
    assert config["bf16"] == {"enabled": True, "check_grad_overflow": False}
    config, max_norm = prepare_config(_config(1, bf16=True, fp32_accumulation=True))
    assert max_norm == CLIP and config["gradient_clipping"] == CLIP  # bf16 optimizer clips
    assert "compute_grad_norm" not in config["zero_optimization"]
    fp16 = {**_config(1), "fp16": {"enabled": True}}
    assert prepare_config(fp16) == (fp16, None)
    offload = _config(2)
    offload["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    assert prepare_config(offload) == (offload, None)
    with pytest.raises(TypeError, match="as a dict"):
        prepare_config("ds_config.json")


def test_norm_masking_is_deepspeeds_without_a_host_made_tensor():
    # DeepSpeed masks a non-finite norm with torch.tensor(-1.0, device=...): a pageable copy
    # (a wait) on a GPU, found on an H100. tds's replacement gives the same values from a
    # Python number; install() puts it where DeepSpeed's norm helpers look it up.
    import deepspeed.runtime.utils as ds_utils
    import deepspeed.runtime.zero.stage_1_and_2 as ds_zero
    from torch.utils._python_dispatch import TorchDispatchMode

    from tds import sync_free

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    original = sync_free.DEEPSPEED_MASKING
    assert original is not sync_free.mask_nan_or_inf_inplace
    values = torch.tensor([1.5, float("inf"), float("nan"), -float("inf"), 0.0, -2.0])
    theirs, ours = values.clone(), values.clone()
    with Ops() as their_ops:
        original(theirs, device=theirs.device)
    with Ops() as our_ops:
        sync_free.mask_nan_or_inf_inplace(ours, device=ours.device)
    assert torch.equal(theirs, ours) and ours.tolist() == [1.5, -1.0, -1.0, -1.0, 0.0, -2.0]
    assert "aten.lift_fresh.default" in their_ops.seen  # the copy the replacement avoids
    assert "aten.lift_fresh.default" not in our_ops.seen, our_ops.seen
    sync_free._install_masking()
    assert ds_utils.mask_nan_or_inf_with_val_inplace is sync_free.mask_nan_or_inf_inplace
    assert ds_zero.mask_nan_or_inf_with_val_inplace is sync_free.mask_nan_or_inf_inplace
