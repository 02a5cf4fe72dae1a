"""tools/check_cpm1_checkout.py, without a CPM-1 checkout (no network).

The tool's machinery (its launcher, serial reference, weight loading and renaming for the
pipeline, CPM-1-style training through ``deepspeed.initialize``, the comparison and the
table) runs on the repository's CPM-1-style models (tests/compat_models/cpm1_models.py),
which stand in for the checkout's ``model_provider`` / ``forward_step``:
- GPT-2 at pp=2 (dp 2) with activation checkpointing: the tool says ok (losses within 1e-5
  of serial, every serial weight loaded, recompute taken);
- the same with the two transformer layers' weights swapped on loading: the tool fails
  the case (it can fail);
- ``compare`` turns a loss difference, a missing weight and a recompute that did not
  happen into failures.
"""
import json
import os
import random
import sys

import pytest

from compat_models import cpm1_models
from test_mpu_cpm import _loss, gpt2_batch, t5_batch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import check_cpm1_checkout as tool  # noqa: E402


class CompatSource:
    """tests/compat_models/cpm1_models.py in the place of a CPM-1 checkout: CPM-1's
    initialisation (mpu with a DeepSpeed topology when pp > 0), model_provider and
    forward_step, written after CPM-1's."""
    prefixes = {"embedding": "embedding.", "final_norm": "final_layernorm."}

    def __init__(self, seed):
        self.seed = self.data_seed = seed

    def setup(self, case, config_path):
        import torch.distributed as dist
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        from megatron.mpu import cpm

        dist.init_process_group("gloo")  # env://, from the tool's launcher
        dp = case.world // (case.tp * max(case.pp, 1))
        topo = PipeModelDataParallelTopology(num_pp=case.pp, num_mp=case.tp, num_dp=dp) \
            if case.pp else None
        cpm.initialize_model_parallel(case.tp, topology=topo)
        self.cfg = cpm1_models.config(seed=self.seed, checkpoint_activations=case.ckpt)
        self.batch_fn = gpt2_batch if case.model == "gpt2" else t5_batch
        return cpm

    def model(self, case):
        if not case.pp:
            return (cpm1_models.GPT2Model if case.model == "gpt2" else
                    cpm1_models.T5Model)(self.cfg)
        build = cpm1_models.gpt2_model_pipe if case.model == "gpt2" else \
            cpm1_models.t5_model_pipe
        model = build(self.cfg)
        model._megatron_batch_fn = self.batch_fn  # as CPM-1's model_provider sets it
        return model

    def forward_step(self, model, raw):
        return _loss(model, raw, self.batch_fn)

    def ds_kwargs(self, config_path):
        with open(config_path) as f:
            return {"config": json.load(f)}

    def layer_prefix(self, case, k):
        if case.model == "gpt2":
            return f"layers.{k}."
        n = self.cfg.num_layers
        return f"encoder.{k}." if k < n else f"decoder.{k - n}."


class SwappedLayers(CompatSource):
    """Loads serial layer 1 into pipeline layer 0 and back: wrong weights on purpose."""

    def layer_prefix(self, case, k):
        return super().layer_prefix(case, 1 - k)


STEPS = 3


@pytest.fixture(scope="module")
def gpt2_pp2(tmp_path_factory):
    """The tool on GPT-2 at pp=2 (dp 2) with recompute: its rows, then the same case with
    the layers swapped on loading, compared with the same serial run."""
    seed = int(os.environ.get("MEGATRON_TEST_SEED") or random.SystemRandom().randrange(2**31))
    print(f"seed={seed} (rerun with MEGATRON_TEST_SEED={seed})")
    root, case = str(tmp_path_factory.mktemp("cpm1_tool")), tool.Case("gpt2", 1, 2, True)
    rows = tool.run_all(CompatSource(seed), [case], STEPS, root, timeout=120,
                        log=lambda s: None)
    try:
        swapped = tool.run_case(SwappedLayers(seed), case, STEPS, root, timeout=120)
    except RuntimeError as exc:
        swapped = exc
    return rows, swapped


@pytest.mark.slow
def test_tool_passes_cpm1_style_gpt2_at_pp2_with_recompute(gpt2_pp2):
    rows, _ = gpt2_pp2
    table = tool.format_table(rows)
    assert [r["case"] for r in rows] == ["gpt2-serial", "gpt2-pp2-ckpt"], table
    serial, row = rows
    assert serial["ok"] and min(serial["serial"]["norms"]) > 1.0, table  # clipping acts
    assert row["ok"], table + "\n" + "\n".join(row["problems"])
    assert row["engine"] == "PipelineEngine" and row["recompute"] > 0, table
    assert row["diff"] <= 1e-5 and len(row["losses"]) == STEPS
    assert "| gpt2-pp2-ckpt | PipelineEngine |" in table


@pytest.mark.slow
def test_tool_fails_when_the_weights_are_wrong(gpt2_pp2):
    rows, swapped = gpt2_pp2
    assert not isinstance(swapped, Exception), swapped
    row = tool.compare(tool.Case("gpt2", 1, 2, True), rows[0]["serial"], swapped)
    assert not row["ok"] and row["diff"] > 1e-3, row
    assert "FAIL" in tool.format_row(row)


def test_compare_fails_on_difference_missing_weight_and_recompute():
    case = tool.Case("gpt2", 1, 2, True)
    serial = {"losses": [4.0, 3.0], "params": ["a", "b"]}
    good = {"losses": [4.0 + 5e-6, 3.0], "loaded": ["a", "b"], "recompute": 4,
            "engine": "tds.pipe.engine.PipelineEngine"}
    assert tool.compare(case, serial, [good, good])["ok"]
    far = dict(good, losses=[4.0, 3.0 + 2e-5])
    assert not tool.compare(case, serial, [good, far])["ok"]
    partial = dict(good, loaded=["a"])
    assert "serial weights no rank loaded: ['b']" in \
        tool.compare(case, serial, [partial, partial])["problems"]
    idle = dict(good, recompute=0)
    assert not tool.compare(case, serial, [idle, idle])["ok"]
    assert not tool.compare(case._replace(ckpt=False), serial, [good, good])["ok"]
