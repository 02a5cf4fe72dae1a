"""The planner's step-time model against a published table: Narayanan et al. 2021 (SC'21,
arXiv 2104.04473), Table 1, GPT 1.7B-1T on 32-3072 A100s. Each row's own layout, evaluated
with the A100 preset and the planner's default model constants (one set for all rows),
must give TFLOP/s per GPU (the paper's Eq. 3 count) within 20% of the published figure."""
import dataclasses

import pytest

from megatron.memory.published import (NARAYANAN_2021, eq2_params, eq3_flops, format_table,
                                       predict_table, row_spec)
from megatron.memory.step_time import A100, H100, Device, _score_bytes


@pytest.fixture(scope="module")
def table():
    return predict_table()


def test_every_row_within_20_percent_of_the_published_tflops(table):
    ratios = [p.ratio for p in table]
    assert len(ratios) == 10
    assert all(0.8 <= r <= 1.2 for r in ratios), "\n" + format_table(table)


def test_the_layouts_fit_and_run_the_paper_schedule(table):
    """The memory model agrees each published layout fits an 80 GB A100 (Selene), and the
    pipelined rows pay a bubble that falls with interleaving as the paper's
    (p - 1) / (v m + p - 1)."""
    for p in table:
        r, spec = p.row, p.plan.spec
        assert p.plan.peak < 80 * 2**30, "\n" + format_table(table)
        assert spec.world == r.gpus and spec.recompute == "full"
        assert spec.micro_batch * spec.num_micro_batches * spec.dp == r.global_batch
        m, pp, v = spec.num_micro_batches, spec.pp, spec.vpp
        textbook = (pp - 1) / (v * m + pp - 1)
        # the head makes the last stage the slowest: a little under the equal-stage figure
        assert textbook * 0.8 <= p.plan.bubble <= textbook + 1e-9, (r.params_b, p.plan.bubble)


def test_one_set_of_constants_only_hardware_facts_differ():
    """The A100 preset changes the peak, HBM and link speeds; every fitted-looking constant
    (GEMM efficiency, tile, attention efficiency, HBM efficiency, floors, latency) is the
    planner's default."""
    differ = {f.name for f in dataclasses.fields(Device)
              if getattr(A100, f.name) != getattr(H100, f.name)}
    assert differ == {"peak_tflops", "hbm_gbps", "intra_gbps", "inter_gbps"}
    assert (A100.peak_tflops, A100.hbm_gbps, A100.intra_gbps, A100.inter_gbps) == \
        (312.0, 2039.0, 300.0, 25.0)


def test_the_transcribed_rows_are_the_papers_models():
    """Eq. 2's parameter count from (layers, hidden) gives the params column (the table
    rounds 1.65B to 1.7B), and TFLOP/s x GPUs its aggregate PFLOP/s column."""
    aggregate = [4.4, 8.8, 18.2, 34.6, 70.8, 143.8, 227.1, 297.4, 410.2, 502.0]
    for r, pflops in zip(NARAYANAN_2021, aggregate):
        assert eq2_params(r.layers, r.hidden) / 1e9 == pytest.approx(r.params_b, rel=0.03)
        assert r.tflops * r.gpus / 1e3 == pytest.approx(pflops, rel=0.01)
        assert r.hidden % r.heads == 0 and r.heads % r.tp == 0


def test_eq3_is_three_passes_plus_recompute_of_the_model_flops():
    """Eq. 3 = the family's model count (forward + backward, attention width h and
    feed-forward 4h) with the layers' forward once more (recompute) and the logits not:
    96 B s l h^2 (1 + s / 6h) + 6 B s h V."""
    from types import SimpleNamespace

    from megatron.config.run_config import MoESettings
    from megatron.families.gpt2 import flops_per_step

    r = NARAYANAN_2021[4]
    cfg = SimpleNamespace(batch=SimpleNamespace(global_batch_size=r.global_batch,
                                                seq_length=2048),
                          model=SimpleNamespace(hidden_size=r.hidden, padded_vocab_size=51200,
                                                ffn_hidden_size=4 * r.hidden,
                                                num_attention_heads=r.heads,
                                                kv_channels=r.hidden // r.heads,
                                                num_layers=r.layers),
                          moe=MoESettings.from_values({}))  # dense layers
    model = flops_per_step(cfg)
    head = 6.0 * r.global_batch * 2048 * r.hidden * 51200
    assert eq3_flops(r.global_batch, 2048, r.layers, r.hidden, 51200) == \
        pytest.approx((model - head) * 4 / 3 + head, rel=1e-9)


def test_unfused_attention_moves_its_scores_through_hbm_and_sdpa_does_not():
    """The term that brought the small models (s / h large) within range: the unfused
    path's [b, a/t, s, s] tensors, 6 e + 1 bytes per element forward with attention
    dropout (scores written; softmax read, write; dropout read, write, 1-byte mask; context
    bmm read), 4 e without; none under SDPA."""
    spec = row_spec(NARAYANAN_2021[0])
    elements = spec.micro_batch * spec.heads / spec.tp * 2048 * 2048
    assert _score_bytes(spec, 2048, 2048) == pytest.approx(elements * 13)
    assert _score_bytes(dataclasses.replace(spec, attention_dropout=0.0), 2048, 2048) == \
        pytest.approx(elements * 8)
    assert _score_bytes(dataclasses.replace(spec, attention="sdpa"), 2048, 2048) == 0


def test_the_cli_prints_the_table_and_needs_a_config_otherwise(capsys):
    import os
    import sys

    from megatron.common.errors import ConfigError

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "tools"))
    import plan_layout

    assert plan_layout.main(["--paper", "narayanan2021"]) == 0
    out = capsys.readouterr().out
    assert "| 1008 | 8 | 64 | 6 | 1 | 1 | 3072 | 3072 |" in out
    assert out.count("\n| ") == 11  # the header and ten rows
    with pytest.raises(ConfigError, match="give --config and --gpus"):
        plan_layout.main(["--gpus", "8"])
    # the preset fills the hardware flags a user leaves out, and only those
    args = plan_layout._args(["--gpu", "a100", "--hbm-gbps", "1555", "--paper", "narayanan2021"])
    assert (args.peak_tflops, args.hbm_gbps, args.intra_node_gbps, args.inter_node_gbps) == \
        (312.0, 1555.0, 300.0, 25.0)


def test_hardware_of_a_device_keeps_it_or_refuses():
    from megatron.memory.planner import Hardware

    hw = Hardware.of(A100, gpus=16, gpu_memory=80 * 2**30, nodes=2)
    assert hw.device() == A100 and hw.per_node == 8
    with pytest.raises(ValueError, match="other constants are the defaults"):
        Hardware.of(dataclasses.replace(A100, attention_efficiency=0.6), 16, 80 * 2**30, 2)
