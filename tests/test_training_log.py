"""The training log: Megatron's FLOP count, the progress line, TensorBoard scalars, and
which process prints it (each node's first) at what cost (the loss stage's stats shared once per log interval)."""
import contextlib
import io
import re

import pytest

from gpt2_runs import gpt2_argv
from harness import run_distributed
from megatron.config import saved_run_config
from megatron.observability.training_log import model_flops_per_step, throughput


def _matmul_flops(b, s, layers, h, vocab):
    """Independent count: 2 FLOPs per multiply-add of every matmul, backward = 2x forward."""
    per_layer = (2 * b * s * h * 3 * h      # QKV projection
                 + 2 * b * s * s * h         # scores q.k
                 + 2 * b * s * s * h         # probabilities x values
                 + 2 * b * s * h * h         # attention output projection
                 + 2 * 2 * b * s * h * 4 * h)  # MLP up and down
    logits = 2 * b * s * h * vocab
    return 3 * (layers * per_layer + logits)


@pytest.mark.parametrize("b,s,layers,h,vocab", [(8, 1024, 24, 1024, 50304),
                                                (3, 64, 2, 96, 512)])
def test_flops_formula_counts_every_matmul(b, s, layers, h, vocab):
    args = saved_run_config(dict(global_batch_size=b, seq_length=s, num_layers=layers,
                                 hidden_size=h, padded_vocab_size=vocab, world_size=4,
                                 peak_tflops=100.0))
    expected = _matmul_flops(b, s, layers, h, vocab)
    assert model_flops_per_step(args) == pytest.approx(expected, rel=1e-12)
    tokens, tflops, mfu = throughput(args, 2.0)
    assert tokens == pytest.approx(b * s / 2.0)
    assert tflops == pytest.approx(expected / 2.0 / 4 / 1e12)
    assert mfu == pytest.approx(tflops / 100.0)


def _train_logged(argv):
    import pretrain_gpt2

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        state = pretrain_gpt2.main(argv)
    return state.losses, state.eval_losses, out.getvalue()


def test_log_line_and_tensorboard_scalars(gpt2_data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    argv = gpt2_argv(gpt2_data, "--batch-size", "2", "--train-iters", "6", "--log-interval", "3",
                     "--eval-interval", "3", "--tensorboard-dir", str(tb))
    (losses, evals, out), = run_distributed(_train_logged, 1, argv)
    lines = [line for line in out.splitlines() if line.startswith("iteration")]
    assert len(lines) == 2
    for field in ("consumed samples:", "elapsed time per iteration (ms):", "learning rate:",
                  "lm loss:", "grad norm:", "skipped iterations:", "tokens/s:",
                  "TFLOP/s/device:", "MFU: n/a"):
        assert field in lines[0], (field, lines[0])
    assert "lm loss PPL" in out
    events = EventAccumulator(str(tb))
    events.Reload()
    logged = [e.value for e in events.Scalars("train/lm-loss")]
    expected = [sum(losses[:3]) / 3, sum(losses[3:]) / 3]
    assert logged == pytest.approx(expected, rel=1e-6)
    assert [e.value for e in events.Scalars("validation/lm-loss")] == \
        pytest.approx([loss for _, loss in evals], rel=1e-6)


# ---------------------------------------------------------------- FLOPs and peaks (issue 22)
def _matmul_flops_general(b, s, layers, h, heads, kv, ffn, vocab):
    """Independent count with the attention width (heads x kv) and ffn size of the model:
    each matmul's shape written out, 2 FLOPs per multiply-add, backward = 2x forward."""
    a = heads * kv
    shapes = [(b * s, h, 3 * a),            # QKV projection [bs, h] x [h, 3a]
              (b * heads * s, kv, s),       # scores, per head [s, kv] x [kv, s]
              (b * heads * s, s, kv),       # probabilities x values
              (b * s, a, h),                # attention output projection
              (b * s, h, ffn), (b * s, ffn, h)]  # MLP up and down
    per_layer = sum(2 * m * k * n for m, k, n in shapes)
    return 3 * (layers * per_layer + 2 * b * s * h * vocab)


@pytest.mark.parametrize("heads,kv,ffn", [(4, 24, 200), (3, 7, 96), (8, 16, 4 * 96)])
def test_flops_from_the_real_ffn_and_kv_sizes(heads, kv, ffn):
    b, s, layers, h, vocab = 3, 48, 2, 96, 512
    cfg = saved_run_config(dict(global_batch_size=b, seq_length=s, num_layers=layers,
                                hidden_size=h, num_attention_heads=heads, kv_channels=kv,
                                ffn_hidden_size=ffn, padded_vocab_size=vocab, world_size=1))
    expected = _matmul_flops_general(b, s, layers, h, heads, kv, ffn, vocab)
    assert model_flops_per_step(cfg) == pytest.approx(expected, rel=1e-12)


GIB = 2**30


@pytest.mark.parametrize("name,memory,dtype,tf32,peak", [
    ("NVIDIA H100 80GB HBM3", 80 * GIB, "bfloat16", False, 989.0),
    ("NVIDIA H100 80GB HBM3", 80 * GIB, "float32", True, 494.0),
    ("NVIDIA H100 80GB HBM3", 80 * GIB, "float32", False, 67.0),
    ("NVIDIA H100 PCIe", 80 * GIB, "float16", False, 756.0),
    ("NVIDIA H100 PCIe", 80 * GIB, "float32", True, 378.0),
    ("NVIDIA H100 NVL", 94 * GIB, "bfloat16", False, 835.0),
    ("NVIDIA H100", 94 * GIB, "bfloat16", False, 835.0),       # NVL told by its memory
    ("NVIDIA H200", 141 * GIB, "bfloat16", False, 989.0),
    ("NVIDIA A100-SXM4-40GB", 40 * GIB, "bfloat16", False, 312.0),
    ("NVIDIA A100 80GB PCIe", 80 * GIB, "float16", False, 312.0),
    ("NVIDIA A100-SXM4-80GB", 80 * GIB, "float32", True, 156.0),
    ("Some Future GPU", 80 * GIB, "bfloat16", False, None),
])
def test_mfu_peak_of_the_emulated_device_and_precision(monkeypatch, name, memory, dtype, tf32,
                                                       peak):
    """peak_tflops(cfg) reads torch.cuda's device properties (emulated here) and the run's
    compute dtype; MFU divides by that peak, and --peak-tflops overrides it."""
    import types

    import torch

    from megatron.observability import training_log

    props = types.SimpleNamespace(name=name, total_memory=memory)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)
    monkeypatch.setattr(torch, "get_float32_matmul_precision",
                        lambda: "high" if tf32 else "highest")
    sizes = dict(global_batch_size=2, seq_length=16, num_layers=1, hidden_size=32,
                 padded_vocab_size=64, world_size=1)
    cfg = saved_run_config(dict(sizes, compute_dtype=dtype))
    assert training_log.peak_tflops(cfg) == peak
    _, tflops, mfu = throughput(cfg, 1e-3)
    assert mfu == (pytest.approx(tflops / peak) if peak else None)
    override = saved_run_config(dict(sizes, compute_dtype=dtype, peak_tflops=123.0))
    assert training_log.peak_tflops(override) == 123.0


# ---------------------------------------------------------------- node 0 shows the run
#: torch.distributed's collectives and point-to-point calls, counted per step below
#: (``isend`` / ``irecv`` through ``batch_isend_irecv``: a ``P2POp`` takes only the originals).
_COUNTED = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce",
            "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single", "barrier",
            "broadcast_object_list", "all_gather_object", "gather", "scatter", "send", "recv",
            "batch_isend_irecv")


def _counted_run(argv):
    """Rank body: ``pretrain_gpt2.main(argv)`` with every call of :data:`_COUNTED` counted
    per training step (a step: from its ``train_step`` to the next one's, so the log flush
    after step k counts in step k); the losses this rank holds and what it printed."""
    import collections

    import torch.distributed as dist

    import pretrain_gpt2
    from megatron.training import loop

    steps, originals = [], {}

    def counted(name, original):
        def call(*args, **kwargs):
            if steps:
                src = kwargs.get("src", args[1] if len(args) > 1 else None)
                steps[-1][f"{name}(src={src})" if name == "broadcast" else name] += 1
            return original(*args, **kwargs)
        return call

    def step(*args, **kwargs):
        steps.append(collections.Counter())
        return original_step(*args, **kwargs)

    for name in _COUNTED:
        originals[name] = getattr(dist, name)
        setattr(dist, name, counted(name, originals[name]))
    original_step, loop.train_step = loop.train_step, step
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            state = pretrain_gpt2.main(argv)
    finally:
        loop.train_step = original_step
        for name, original in originals.items():
            setattr(dist, name, original)
    return [dict(c) for c in steps], state.losses, out.getvalue()


def test_node_first_process_prints_the_last_stages_losses_shared_once_per_interval(
        gpt2_data, tmp_path):
    """At pp 2 the losses exist on the last stage only; rank 0 (the node's first process)
    prints the training lines, the validation line and the closing line with the last
    stage's values, and the last rank prints none of them. What it takes: the last rank's
    stats shared once at each log interval (their names, then their values), nothing in
    the steps between (every torch.distributed call counted per step: a step between log
    lines makes the very calls of another, a logging step those and the sharing more)."""
    argv = gpt2_argv(gpt2_data, "--pipe-parallel-size", "2", "--batch-size", "2", "--gas", "2",
                     "--train-iters", "6", "--log-interval", "2", "--eval-interval", "6",
                     "--hidden-dropout", "0", "--attention-dropout", "0",
                     "--save", str(tmp_path / "ckpt"), "--save-interval", "100")
    (steps0, losses0, out0), (steps1, losses1, out1) = run_distributed(_counted_run, 2, argv,
                                                                       timeout=300)
    for steps in (steps0, steps1):
        assert len(steps) == 6
        quiet, logging = steps[2], steps[3]  # step 3: between lines; step 4: a line
        assert steps[4] == quiet and steps[1] == logging, steps
        extra = {k: logging.get(k, 0) - quiet.get(k, 0) for k in set(logging) | set(quiet)}
        # at a line: the loss stage's stats shared over the pipeline group (their count
        # and names, then their values: StepBackend.share_stats) and the divergence
        # check's agreement (megatron/training/divergence.py); nothing per step
        assert {k: v for k, v in extra.items() if v} == {"broadcast_object_list": 1,
                                                         "broadcast(src=1)": 1,
                                                         "all_reduce": 1}, extra
    assert len(losses1) == 6 and losses0 == losses1  # every rank has the last stage's
    printed = [float(x) for x in re.findall(r"iteration\s+\d+/\s+6 \|.*?lm loss: (\S+)", out0)]
    assert printed == pytest.approx([sum(losses1[i:i + 2]) / 2 for i in (0, 2, 4)], rel=1e-6)
    assert "validation loss at iteration 6" in out0
    assert re.search(r"> run ended at iteration 6: checkpoint \S+iter_0000006 \|", out0), out0
    for sign in ("iteration ", "validation loss", "run ended"):
        assert sign not in out1, (sign, out1[-2000:])


def test_the_closing_line_names_only_what_exists(tmp_path, monkeypatch):
    """A checkpoint folder, log file or event file that is not there is not named as if it
    were; a run with --tensorboard-dir that wrote no events says why."""
    from megatron.observability import run_summary

    save, events, log = tmp_path / "ckpt", tmp_path / "tb" / "events.out.x", tmp_path / "n0.log"
    cfg = saved_run_config(dict(save=str(save), tensorboard_dir=str(tmp_path / "tb")))
    monkeypatch.setenv(run_summary.LOG_FILE_ENV, str(log))
    line = run_summary.closing_line(cfg, 3, None)
    assert "no checkpoint" in line and "log: this output only" in line, line
    assert f"no TensorBoard events in {tmp_path / 'tb'}" in line, line
    (save / "iter_0000003").mkdir(parents=True)
    (save / "latest_checkpointed_iteration.txt").write_text("3")
    log.write_text("x")
    events.parent.mkdir()
    events.write_text("x")
    line = run_summary.closing_line(cfg, 3, str(events))
    assert line == (f"> run ended at iteration 3: checkpoint {save / 'iter_0000003'} | log "
                    f"{log} (this node's) | TensorBoard events {events}"), line
    elsewhere = run_summary.closing_line(cfg, 3, str(tmp_path / "other" / "events.out.y"))
    assert "events.out.y (on the last rank's node)" in elsewhere, elsewhere
    monkeypatch.setattr(run_summary.importlib.util, "find_spec", lambda name: None)
    assert "no TensorBoard events (tensorboard is not installed: pip install tensorboard)" \
        in run_summary.closing_line(cfg, 3, None)


def test_compile_time_is_the_union_of_the_ranks_compile_spans():
    """A pipeline's stages compile one after another (each waits for the last): the
    interval's compile time is the wall time in which some rank compiled, not the most of
    one rank; overlapping spans count once."""
    from megatron.observability.compile_watch import union_seconds

    stage0, stage1 = [(0.0, 40.0), (95.0, 100.0)], [(40.0, 90.0)]  # forward, backward
    assert union_seconds(stage0 + stage1) == pytest.approx(95.0)
    assert union_seconds([(0.0, 10.0), (2.0, 5.0), (8.0, 12.0)]) == pytest.approx(12.0)
    assert union_seconds([]) == 0.0
