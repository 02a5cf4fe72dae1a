"""Context parallelism in the planner and the step-time model: the planner offers cp where a
run allows it and ranks it against tensor parallelism; for the Llama example at 32k tokens
on 8 x 80 GiB GPUs no layout without it fits unless it recomputes every layer, and it picks
cp > 1 (docs/measurements/memory.md quotes this run). The memory figures themselves are
held to measured peaks in tests/test_memory_peak_cp.py."""
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILY = "examples.llama.llama_model:LLAMA"
#: Llama-2 7B's shape (docs/memory.md), 32k tokens a sample, bf16.
LLAMA_7B_32K = ("num_layers: 32\nhidden_size: 4096\nnum_attention_heads: 32\n"
                "num_key_value_heads: 32\nffn_hidden_size: 11008\nseq_length: 32768\n"
                "max_position_embeddings: 32768\nbatch_size: 1\nglobal_batch_size: 8\n"
                "lr: 3.0e-4\ntrain_iters: 100\nbf16: true\nattention_dropout: 0.0\n"
                "hidden_dropout: 0.0\ntokenizer_type: GPT2BPETokenizer\n")


def _plan(tmp_path, text, *flags):
    config = tmp_path / "run.yaml"
    config.write_text(text)
    out = subprocess.run([sys.executable, os.path.join(REPO, "tools", "plan_layout.py"),
                          "--config", str(config), "--family", FAMILY, "--gpus", "8",
                          "--gpu-memory", "80GiB", "--vocab-size", "32000", "--json", *flags],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_the_planner_picks_cp_for_llama_at_32k_tokens(tmp_path):
    plan = _plan(tmp_path, LLAMA_7B_32K)
    layouts = plan["layouts"]
    best = layouts[0]
    assert best["cp"] > 1, best
    # tensor parallelism alone (any tp up to 8 with or without SP, any pipeline, ZeRO)
    # fits only by recomputing every layer, and is slower
    alone = [x for x in layouts if x["cp"] == 1]
    assert alone and all(x["recompute"] == "full" for x in alone), alone[:3]
    assert alone[0]["tokens_per_gpu_s"] < best["tokens_per_gpu_s"]
    assert not any(x["cp"] == 1 and x["recompute"] == "none" for x in layouts)
    for x in layouts:  # what the run's validation allows: 2 cp chunks, whole heads for a2a
        assert x["tp"] * x["cp"] * x["pp"] * x["dp"] == 8
        assert 32768 % (2 * x["cp"]) == 0 and x["peak_bytes"] <= plan["usable_bytes"]
        if x["cp_comm_type"] == "a2a":
            assert (32 // x["tp"]) % x["cp"] == 0
    assert {x["cp_comm_type"] for x in layouts if x["cp"] > 1} == {"p2p", "a2a"}
    print(f"best {best['tp']=} {best['cp']=} {best['pp']=} {best['dp']=} "
          f"{best['recompute']=}: {best['tokens_per_gpu_s']:.0f} tok/s/GPU, peak "
          f"{best['peak_bytes'] / 2**30:.1f} GiB; best cp 1: {alone[0]['tp']=} "
          f"{alone[0]['pp']=} {alone[0]['recompute']=} "
          f"{alone[0]['tokens_per_gpu_s']:.0f} tok/s/GPU")


def _spec(**kw):
    from megatron.memory.spec import MemorySpec

    base = dict(family="gpt2", num_layers=4, hidden=1024, heads=16, kv_channels=64,
                ffn=4096, vocab=32000, seq=32768, micro_batch=1, num_micro_batches=4,
                attention_dropout=0.0, dtype="bf16", backend="engine")
    return MemorySpec(**{**base, **kw})


def test_cp_is_offered_only_where_the_run_allows_it():
    from megatron.common.errors import ConfigError
    from megatron.memory.planner import Hardware, layouts

    hw = Hardware(gpus=8, gpu_memory=80 * 2**30)
    offered = {(s.cp, s.cp_comm) for s in layouts(_spec(), hw, 8)}
    assert {(2, "p2p"), (8, "p2p"), (8, "a2a")} <= offered
    assert {s.cp for s in layouts(_spec(attention_dropout=0.1), hw, 8)} == {1}
    assert {s.cp for s in layouts(_spec(seq=12), hw, 8)} == {1, 2}  # 12 = 2 x 2 x 3
    for bad, match in ((dict(cp=3), "does not cut into 2 x cp = 6"),
                       (dict(cp=4, tp=8, cp_comm="a2a"), "whole heads"),
                       (dict(cp=2, attention_dropout=0.1), "attention dropout"),
                       (dict(cp=2, cp_comm="ring"), "choose p2p")):
        with pytest.raises(ConfigError, match=match):
            _spec(**bad).check()


def test_the_ring_hides_its_sends_behind_the_attention_blocks():
    """p2p: each of the ``cp - 1`` key / value sends overlaps one block's attention, so on
    NVLink at 32k tokens only the fp32 dK / dV accumulators' last trip home shows; on a
    slow link the sends show, growing with their bytes. all_gather and a2a are not
    overlapped: they cost more than the ring's exposed part on the same link."""
    from megatron.memory.step_time import H100, _cp_comm, _core_forward

    spec = _spec(cp=4)
    tokens = spec.seq_local
    core = sum(_core_forward(spec, H100, tokens, spec.seq, False))
    total, forward = _cp_comm(spec, H100, tokens, 8, core)
    grads = 2 * tokens * spec.kv_proj * 4 / (H100.intra_gbps * 1e9) + H100.latency_s
    assert forward == 0 and total == pytest.approx(grads)
    slow = replace(H100, intra_gbps=1.0)
    slow_total, slow_forward = _cp_comm(spec, slow, tokens, 8, core)
    assert slow_forward > 0 and slow_total > 10 * total
    for comm in ("all_gather", "a2a"):
        assert _cp_comm(replace(spec, cp_comm=comm), H100, tokens, 8, core)[0] > total
    assert _cp_comm(_spec(), H100, tokens, 8, core) == (0.0, 0.0)
