"""The memory model's whole per-stage peak against the real peak of a training step (CPU,
gloo), for 1F1B, interleaved, ZB-H1 and ZB-V pipelines, sequence parallelism, full
(uniform and block) and selective recompute, bf16 with both of DeepSpeed's gradient
accumulation dtypes, and DeepSpeed's engine without a pipeline (whose peak is its
optimizer step).

Measured on each rank (tests/peak_tracker.py): every tensor storage alive at once, each
counted once however many views share it, from the first op to the last of the second of
two steps: the weights and optimizer state, every micro-batch's saved activations, the
stage outputs and masks the engine keeps, the logits and the loss, every gradient the
backward makes, the gather buffers of sequence parallelism, the gradient reductions'
flattened buckets and the optimizer step's temporaries. Held to 5% of the model's
``states + activations + buffers + transient`` (less the gradients not yet allocated when
the activations peak) or, where it is larger, ``states + the step's temporaries``; the
step's own peak is held to 5% of the whole. The vocabulary is 16 x the hidden size, so the
logits, their gradient copy and the output layer's weight gradient weigh as much as in a
real model. Not seen: memory outside tensor storages (gloo's, the allocator's), a kernel's
scratch space freed inside the op. tds's pipeline runner keeps each micro-batch's loss
detached (with its graph it would hold the last stage's received inputs and their gradients
until the next step), and the test asserts that nothing is kept that way
(memory_peak_runs._kept_by_runner walks the kept losses' graphs).
"""
import json
import random

import pytest

from harness import run_distributed
from memory_peak_runs import measure_peaks

TOL = 0.05
VOCAB = 1024  # 16 x the hidden size (GPT-2 small: 65 x)


def _base(micro, layers, seq=64, attention_dropout=0.0):
    return ["--num-layers", str(layers), "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--batch-size",
            str(micro), "--train-iters", "2", "--lr", "1e-3", "--attention-dropout",
            str(attention_dropout), "--gas", "4"]


def _layouts(micro, ds_fp32_accumulation):
    """``{name: argv}`` of the layouts measured."""
    interleaved = ["--virtual-pipeline-model-parallel-size", "2"]
    tp_sp = ["--model-parallel-size", "2", "--pipe-parallel-size", "2", "--sequence-parallel"]
    bf16 = ["--pipe-parallel-size", "2", "--bf16"]
    selective = ["--recompute-granularity", "selective", "--attention-backend", "unfused"]
    return {"pp4 1F1B": _base(micro, 4) + ["--pipe-parallel-size", "4"],
            # full recompute: a group's activations come back, with its backward on top
            "tp2 pp2 SP 1F1B recompute": _base(micro, 4) + tp_sp + ["--checkpoint-activations"],
            "tp2 pp2 SP v2": _base(micro, 4) + tp_sp + interleaved,
            # zero bubble: a micro-batch held until its weight pass (the deferred GEMMs'
            # inputs and output gradients); ZB-V's rank 0 holds the first and last chunk
            "pp4 ZB-V": _base(micro, 8) + ["--pipe-parallel-size", "4",
                                           "--pipeline-schedule", "zbv"],
            "tp2 pp2 SP ZB-H1": _base(micro, 4) + tp_sp + ["--pipeline-schedule", "zb-h1"],
            # selective recompute: the unfused path's s x s tensors come back in the backward
            "tp2 pp2 SP 1F1B selective": _base(micro, 4, attention_dropout=0.1) + tp_sp +
            selective,
            # the project's step in bf16: autocast over fp32 weights (their bf16 copies held
            # once per step), the fp32 gradient buffer; attention dropout: the CPU's SDPA
            # math path, which computes in fp32
            "bf16 pp2 dp2": _base(micro, 4, attention_dropout=0.1) + bf16,
            # the distributed optimizer (the JSON's ZeRO stage 1 without --deepspeed): Adam's
            # moments of half the parameters, gloo's bucket copy in its collectives
            "bf16 pp2 dp2 distributed optimizer": _base(micro, 4) + bf16 + [
                "--deepspeed_config", ds_fp32_accumulation],
            # DeepSpeed's engine, ZeRO-1 with data_types.grad_accum_dtype fp32: its
            # BF16_Optimizer, the flat gradient buffer in fp32
            "bf16 dp4 DeepSpeed ZeRO-1 fp32-acc": _base(1, 4, seq=32) + [
                "--deepspeed", "--bf16", "--deepspeed_config", ds_fp32_accumulation],
            # no pipeline, bf16: DeepSpeed's unfused optimizer copies every gradient to
            # fp32 for the step, which is this run's peak
            "bf16 dp4 (no pipeline)": _base(1, 4, seq=32) + ["--deepspeed", "--bf16"]}


def _table(names, results):
    """One line per layout and stage: of its tensor- and data-parallel ranks, the one the
    model misses most."""
    mib, rows = 2 ** 20, {}
    for per_layout in results:
        for name, r in zip(names, per_layout):
            pred, kept = r["predicted"], r["kept_by_runner"]["peak"]
            low = r["peak"] - kept
            error = pred["peak"] / low - 1
            at = "step" if pred["step_peak"] > pred["schedule_peak"] else "micro-batches"
            line = (f"{name:29s} {r['stage']:5d}  {low / mib:8.3f} ({kept / mib:5.3f})  "
                    f"{pred['peak'] / mib:8.3f}  {error:+6.2%}  {at}")
            key = (name, r["stage"])
            if key not in rows or abs(error) > rows[key][0]:
                rows[key] = (abs(error), line)
    head = ("layout                        stage  measured MiB (runner-kept)  predicted  "
            "error  peak at")
    return "\n".join([head] + [line for _, line in rows.values()])


def _more_layouts(micro):
    """Selective recompute under ZB-H1, interleaved at pp 4 (the default run's interleaved
    layout is tp 2 x pp 2), with block recompute too (-m exhaustive)."""
    tp_sp = ["--model-parallel-size", "2", "--pipe-parallel-size", "2", "--sequence-parallel"]
    selective = ["--recompute-granularity", "selective", "--attention-backend", "unfused"]
    return {"tp2 pp2 SP ZB-H1 selective": _base(micro, 4, attention_dropout=0.1) + tp_sp +
            selective + ["--pipeline-schedule", "zb-h1"],
            "pp4 v2": _base(micro, 8) + ["--pipe-parallel-size", "4",
                                         "--virtual-pipeline-model-parallel-size", "2"],
            "pp4 v2 block": _base(micro, 8) + ["--pipe-parallel-size", "4",
                                               "--virtual-pipeline-model-parallel-size", "2",
                                               "--recompute-granularity", "full",
                                               "--recompute-method", "block"]}


@pytest.mark.exhaustive  # ~40 s: three more engines
def test_more_recompute_layouts_match_the_real_peak():
    _check_peaks(_more_layouts(random.choice([1, 2])))


@pytest.mark.slow  # 45-90 s: nine engines built and stepped twice on 4 ranks
def test_stage_peaks_match_the_real_peak_of_a_step(tmp_path):
    micro = random.choice([1, 2])
    ds_json = tmp_path / "ds_fp32_accumulation.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"stage": 1},
                                   "data_types": {"grad_accum_dtype": "fp32"}}))
    layouts = _layouts(micro, str(ds_json))
    results, without_transients = _check_peaks(layouts)
    # the terms this test is for: without the transients and the step the model would miss
    assert max(without_transients) > 2 * TOL, without_transients
    # DeepSpeed's fp32 accumulation: the flat gradient buffer is 4 bytes a parameter, not 2
    fp32_acc = [r for per in results for r in per
                if "--deepspeed_config" in r["argv"] and "--deepspeed " in r["argv"]]
    params = [r["predicted"]["states"]["params"] for r in fp32_acc]
    assert fp32_acc and all(r["states"]["optimizer"] > 1.1 * (2 * n + 12 * n / 4)
                            for r, n in zip(fp32_acc, params)), fp32_acc
    # the distributed optimizer: the moments of 1 / dp of the parameters
    sharded = [r for per in results for r in per
               if "--deepspeed_config" in r["argv"] and "--deepspeed " not in r["argv"]]
    assert sharded and all(abs(r["states"]["optimizer"] - 8 * n / 2) < 0.01 * 8 * n / 2
                           for r, n in ((r, r["predicted"]["states"]["params"])
                                        for r in sharded)), sharded
    print(f"(micro-batch {micro})")


def _check_peaks(layouts):
    """Each layout's measured peaks against the model's on 4 ranks (see the module
    docstring); prints the table; returns the per-rank results and each rank-layout's
    ``measured / (states + activations + buffers) - 1``."""
    results = run_distributed(measure_peaks, 4, list(layouts.values()), VOCAB,
                              random.randrange(2**31), timeout=600)
    errors = {"peak": [], "step": [], "optimizer state": []}
    without_transients = []
    for rank, per_layout in enumerate(results):
        for r in per_layout:
            pred, measured, kept = r["predicted"], r["peak"], r["kept_by_runner"]
            where = (rank, r["argv"], measured, kept, pred)
            # the runner once kept each loss's graph (the received inputs and their
            # gradients) until the next step; it keeps the detached loss now: nothing
            assert kept["peak"] == kept["step"] == 0, where
            low = measured
            assert (1 - TOL) * low <= pred["peak"] <= (1 + TOL) * measured, where
            step = r["phases"]["step"]
            assert abs(pred["step_peak"] - step) <= TOL * measured, where
            optimizer = r["states"]["optimizer"]
            assert abs(pred["states"]["optimizer_bytes"] - optimizer) <= 0.01 * optimizer, where
            assert r["states"]["weights"] == pred["states"]["weight_bytes"], where
            errors["peak"].append(pred["peak"] / low - 1)
            errors["step"].append(pred["step_peak"] / step - 1)
            errors["optimizer state"].append(pred["states"]["optimizer_bytes"] / optimizer - 1)
            states = sum(pred["states"][k] for k in ("weight_bytes", "grad_bytes",
                                                     "optimizer_bytes"))
            without_transients.append(low / (states + pred["activations"] + pred["buffers"]) - 1)
    for what, values in errors.items():
        worst = max(values, key=abs)
        print(f"{what}: {len(values)} rank-layouts, largest relative error {worst:+.2%}")
    print(f"measured peak / (states + activations + buffers) - 1: up to "
          f"{max(without_transients):+.1%}")
    print(_table(list(layouts), results))
    return results, without_transients


def _moe_layouts(micro):
    """``{name: argv}`` of the MoE layouts measured: a GPT-2 of 8 experts, top-2, every
    layer MoE, fp32, at ep 1, 2 and 4 over dp 4 (dropless, the all-to-all dispatcher and
    the per-expert loop), and a capacity-mode layout with the distributed optimizer, which
    shards the expert buffer over the expert-data-parallel ranks (dp / ep) and the dense
    one over dp."""
    moe = _base(micro, 2) + ["--gas", "1", "--num-experts", "8", "--moe-router-topk", "2"]
    ep = ["--expert-model-parallel-size"]
    return {"MoE ep1 dropless": moe + ep + ["1"],
            "MoE ep2 dropless": moe + ep + ["2"],
            "MoE ep4 dropless": moe + ep + ["4"],
            "MoE ep2 capacity, dist. opt.": moe + ep + ["2", "--moe-expert-capacity-factor",
                                                         "1.0", "--use-distributed-optimizer"]}


@pytest.mark.slow  # ~40 s: four engines built and stepped twice on 4 ranks
def test_moe_peaks_match_the_real_peak_of_a_step():
    """The model's per-rank peak of an MoE GPT-2 within 5% of the measured one at ep 1, 2
    and 4, dropless and in capacity mode with the distributed optimizer; the expert
    parameters per rank are ``E / ep`` experts (the weights are asserted equal to the
    model's). Dropless, the model is given the rows this rank's experts really computed
    (``moe_rows_factor``, counted by hooks on the experts: a freshly initialised router
    sends 3-8% more rows than the balanced ``T k`` to the busiest rank); the balanced
    figure's error is printed next to it."""
    micro = random.choice([1, 2])
    layouts = _moe_layouts(micro)
    results, _ = _check_peaks(layouts)
    print("dropless, balanced routing assumed (the start-up check's and the planner's "
          "figure) against the measured routing's:")
    for rank, per_layout in enumerate(results):
        for name, r in zip(layouts, per_layout):
            if r["balanced_peak"] is not None:
                print(f"  rank {rank} {name:22s} rows / balanced {r['rows_factor']:.3f}  "
                      f"balanced error {r['balanced_peak'] / r['peak'] - 1:+.2%}")
    # at ep 1 a rank's experts compute all its own rows: exactly the balanced count
    assert all(per[0]["rows_factor"] == 1.0 for per in results), results
    by_name = dict(zip(layouts, results[0]))
    weights = [by_name[f"MoE ep{ep} dropless"]["states"]["weights"] for ep in (1, 2, 4)]
    # ep 1 -> 2 drops 4 experts a layer, 2 -> 4 two more: the measured weights say so
    assert weights[0] - weights[1] == 2 * (weights[1] - weights[2]) > 0, weights
    sharded = by_name["MoE ep2 capacity, dist. opt."]["states"]["optimizer"]
    whole = by_name["MoE ep2 dropless"]["states"]["optimizer"]
    expert = weights[0] - weights[1]  # fp32 bytes of the 4 experts a layer an ep 2 rank keeps
    dense = weights[1] - expert
    # Adam's two moments of 1 / dp of the dense and 1 / (dp / ep) of the expert parameters
    # (sharding both over dp would be 2 * 1466880 / 4 = 733440 bytes)
    assert abs(sharded - 2 * (dense / 4 + expert / 2)) < 0.01 * sharded, (sharded, whole)
    print(f"(micro-batch {micro})")
