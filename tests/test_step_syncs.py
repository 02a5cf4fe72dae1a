"""No host-device synchronisation inside a training step, outside logging steps.

Each case runs the real ``pretrain()`` (pretrain_gpt2.py) for 2N + 1 steps with the log line
only at the end (``--log-interval`` large) and counts, per step, the value reads and host
copies made on the training thread (tests/sync_count.py). The syncs of the first N steps and
of the first 2N must be the same: the steps N+1..2N, neither the first (lazy start-up) nor the
last (the log line), read nothing: the project's step at every layout, the distributed
optimizer included. ``--deepspeed`` (DeepSpeed's own engine and step) reads its own values
(counted here too). Whole-device waits count as well (the accelerator's ``synchronize()``:
DeepSpeed's throughput timer, off in the config the project builds), and the final step
reads the interval's losses once.
"""
import inspect
import json
import threading

import pytest
import torch

from gpt2_runs import gpt2_argv
from harness import run_distributed
from precision import requires_ds_bf16
from sync_count import SyncCounter, gpt2_step_syncs, is_device_wait

N = 2


def _argv(data, tp, pp, dp, *extra):
    return gpt2_argv(data, "--model-parallel-size", str(tp), "--pipe-parallel-size", str(pp),
                     "--batch-size", "2", "--gas", "2", "--train-iters", str(2 * N + 1),
                     "--log-interval", "1000", "--hidden-dropout", "0",
                     "--attention-dropout", "0", *extra, seq=16)


def _check(per_rank):
    for rank, steps in enumerate(per_rank):
        assert len(steps) == 2 * N + 1, (rank, len(steps))
        first_n = sum(len(s) for s in steps[:N])
        first_2n = sum(len(s) for s in steps[:2 * N])
        assert first_2n == first_n, (rank, steps[N:2 * N])
        # the counter is live: the final (logging) step reads the 2N + 1 losses, in one read
        line = f"/megatron/training/loop.py:{_loss_flush_line()}"
        loss_reads = [name for name, where in steps[-1] if where.split(" ")[0].endswith(line)]
        assert loss_reads == ["Tensor.tolist"], (rank, loss_reads)


def engine_step_syncs(argv):
    """Rank body: :func:`gpt2_step_syncs` and, per engine built, whether DeepSpeed's
    throughput timer is on in it (tds's pipeline engine never stops it at a step, so it
    would count no wait there even when on: the setting is checked as well)."""
    from megatron.training.backend_engine import EngineBackend

    original, timers = EngineBackend.__dict__["build"], []

    def build(cls, *args, **kwargs):
        backend = original.__func__(cls, *args, **kwargs)
        timers.append(backend.model.tput_timer.config.enabled)
        return backend

    EngineBackend.build = classmethod(build)
    try:
        return gpt2_step_syncs(argv), timers
    finally:
        EngineBackend.build = original


def _check_engine(per_rank):
    """:func:`_check` of :func:`engine_step_syncs`, each rank's one engine with its timer off."""
    _check([steps for steps, _ in per_rank])
    assert [timers for _, timers in per_rank] == [[False]] * len(per_rank), per_rank


def _loss_flush_line():
    """The line of the log flush that reads the interval's losses."""
    from megatron.training import loop

    source, start = inspect.getsourcelines(loop._flush_interval)
    return next(start + i for i, text in enumerate(source) if ".tolist()" in text)


def test_counter_sees_value_reads_and_host_copies_on_its_thread_only():
    x = torch.randn(4, 3) + 10.0
    seen = []
    with SyncCounter() as counter:
        x.sum().item()
        float(x[0, 0])
        bool(x[0, 0] > 0)
        x.cpu()
        x.tolist()
        x.numpy()
        x.nonzero()
        torch.tensor(-1.0)  # host data made a tensor: on a GPU (device=...) a pageable copy
        y = x * 2  # no read: not counted
        thread = threading.Thread(target=lambda: seen.append(x.sum().item()))
        thread.start()
        thread.join()
    names = [name for name, _ in counter.events]
    assert len(names) == 8, names
    assert names.count("aten._local_scalar_dense.default") >= 2
    assert {"Tensor.cpu", "Tensor.tolist", "Tensor.numpy", "aten.nonzero.default",
            "aten.lift_fresh.default"} <= set(names)
    assert torch.equal(y, x * 2) and seen  # the other thread ran, uncounted
    assert torch.Tensor.cpu is not None and x.cpu() is x  # methods restored


def test_counter_sees_device_waits_once_each_and_restores_them(monkeypatch):
    """DeepSpeed's accelerator ``synchronize()`` (a no-op on CPU), ``torch.cuda.synchronize``
    (raises without CUDA: counted first) and the project's timer sync are counted; a wait
    that calls another counts once; the originals are back afterwards."""
    import megatron.common.timers
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    before = (torch.cuda.synchronize, megatron.common.timers.synchronize_device)
    with SyncCounter() as counter:
        accelerator.synchronize()
        try:
            torch.cuda.synchronize()
        except (AssertionError, RuntimeError):
            assert not torch.cuda.is_available()
        x = torch.ones(2) * 3  # no wait: not counted
    names = [name for name, _ in counter.events]
    assert names == ["accelerator.synchronize", "torch.cuda.synchronize"], names
    assert counter.device_waits == counter.events and float(x.sum()) == 6
    assert (torch.cuda.synchronize, megatron.common.timers.synchronize_device) == before
    assert "synchronize" not in vars(accelerator)  # the class's method shows through again
    # as on a GPU: the project's timer sync calls torch.cuda.synchronize (here a stand-in)
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(a))
    with SyncCounter() as nested:
        megatron.common.timers.synchronize_device()
    assert calls == [()] and [n for n, _ in nested.events] == [
        "megatron.common.timers.synchronize_device"], nested.events  # one wait, counted once


def test_no_syncs_ddp_tp1_fp32(gpt2_data):
    _check(run_distributed(gpt2_step_syncs, 1, _argv(gpt2_data, 1, 1, 1), timeout=300))


def test_no_syncs_ddp_tp2_bf16(gpt2_data):
    _check(run_distributed(gpt2_step_syncs, 2, _argv(gpt2_data, 2, 1, 1, "--bf16"),
                           timeout=300))


def test_no_syncs_pipeline_pp2_fp32(gpt2_data):
    _check(run_distributed(gpt2_step_syncs, 2, _argv(gpt2_data, 1, 2, 1), timeout=300))


@pytest.mark.slow
@pytest.mark.parametrize("extra", [("--fp16",), ("--sequence-parallel",)])
def test_no_syncs_ddp_tp2_other_modes(gpt2_data, extra):
    """fp16 through the DDP backend (autocast + our loss scaler, overflow handled on the
    device) and sequence parallelism."""
    _check(run_distributed(gpt2_step_syncs, 2, _argv(gpt2_data, 2, 1, 1, *extra), timeout=300))


@pytest.mark.slow
@pytest.mark.precision
@requires_ds_bf16
def test_no_syncs_pipeline_pp2_bf16(gpt2_data):
    _check(run_distributed(gpt2_step_syncs, 2, _argv(gpt2_data, 1, 2, 1, "--bf16"),
                           timeout=300))


@pytest.mark.parametrize("precision", [(), pytest.param(("--bf16",), marks=pytest.mark.slow)])
def test_no_syncs_distributed_optimizer(gpt2_data, precision):
    """The distributed optimizer (reduce-scatter, the slices' norm and clip, the update,
    the all-gather) at dp 2 reads nothing on the host either."""
    _check(run_distributed(gpt2_step_syncs, 2, _argv(
        gpt2_data, 1, 1, 2, "--use-distributed-optimizer", *precision), timeout=300))


def test_deepspeed_engine_reads_its_own_values_but_waits_for_no_timer(gpt2_data):
    """``--deepspeed`` is DeepSpeed's own engine and step: its ZeRO-1 optimizer reads the
    norm's validity and the clip decision on the host (the same count every step, all in
    DeepSpeed's code), and its throughput timer, off in the config the project builds,
    makes no device wait (the next test shows what it costs when on)."""
    per_rank = run_distributed(engine_step_syncs, 2, _argv(
        gpt2_data, 1, 1, 2, "--deepspeed", "--zero-stage", "1"), timeout=300)
    for steps, timers in per_rank:
        assert timers == [False], timers
        middle = steps[N:2 * N]
        assert all(step == middle[0] for step in middle) and middle[0], middle
        assert all("/deepspeed/" in where for step in middle for _, where in step), middle
        assert not any(is_device_wait(name) for step in middle for name, _ in step), middle


@pytest.mark.slow
def test_deepspeed_throughput_timer_when_the_user_turns_it_on(gpt2_data, tmp_path):
    """A ds config that asks for DeepSpeed's throughput timer gets it, and the counter sees
    its cost: from DeepSpeed's third step on, one accelerator ``synchronize()`` at each
    micro-batch's ``forward()`` and one at its ``step()``: 2 x gas = 4 per step, on every
    rank (what test_no_syncs_deepspeed_zero1 fails with if the timer is back on)."""
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"timers": {"throughput": {"enabled": True}}}))
    per_rank = run_distributed(gpt2_step_syncs, 2, _argv(
        gpt2_data, 1, 1, 2, "--deepspeed", "--zero-stage", "1", "--deepspeed_config",
        str(path)), timeout=300)
    for steps in per_rank:
        waits = [[name for name, _ in step if is_device_wait(name)] for step in steps]
        assert waits[N:2 * N] == [["accelerator.synchronize"] * 4] * N, waits
        assert all("deepspeed/utils/timer.py" in where for step in steps[N:2 * N]
                   for name, where in step if is_device_wait(name)), steps[N:2 * N]


def _ds_config(tmp_path, user):
    from megatron.config import parse_args
    from megatron.training.backend_engine import build_deepspeed_config

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--batch-size", "2", "--train-iters", "4",
            "--lr", "1e-3", "--tokenizer-type", "GPT2BPETokenizer", "--deepspeed"]
    if user is not None:
        (tmp_path / "ds.json").write_text(json.dumps(user))
        argv += ["--deepspeed_config", str(tmp_path / "ds.json")]
    cfg = parse_args(argv, world_size=1, rank=0, check_files=False)
    return build_deepspeed_config(cfg)  # data-parallel size 1


def test_deepspeed_timers_off_unless_the_ds_config_asks(tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    off = _ds_config(tmp_path, None)
    assert off["timers"] == {"throughput": {"enabled": False}}
    assert off["wall_clock_breakdown"] is False
    parsed = DeepSpeedConfig(off)  # DeepSpeed reads it as meant
    assert not parsed.timers_config.enabled and not parsed.wall_clock_breakdown
    for user in ({"wall_clock_breakdown": True}, {"flops_profiler": {"enabled": True}}):
        assert "timers" not in _ds_config(tmp_path, user), user  # DeepSpeed's default
    user = {"timers": {"throughput": {"synchronized": False}}}
    assert _ds_config(tmp_path, user)["timers"] == user["timers"]  # untouched
