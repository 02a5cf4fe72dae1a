"""Context parallelism in training: GPT-2 and the Llama example at cp 2 and 4, beside tensor,
pipeline (1F1B, ZB-V) and data parallelism, sequence parallelism and recompute, with the
ring (p2p), all-gather and all-to-all forms, with and without document masking: per-step
losses equal the serial run's within 1e-5 over 8 steps (fp32, clipping on); checkpoints
resume at another cp (and tp, pp) exactly; a bad cp is refused before any group is built,
on every rank; validation losses equal too; a context-parallel step reads nothing from the
device outside logging.

The default run has one 8-rank launch covering those cases (and one serial launch for the
references); ``-m exhaustive`` runs the whole matrix (family x cp x layout x comm type x
document masking).
"""
import itertools

import pytest

from cp_training_runs import AT, relative_error, run_argv, train_runs
from harness import run_distributed

TOL = 1e-5


def _serial(data, keys):
    """{(family, documents): (serial per-step losses, {iteration: validation loss})}, in
    one 1-rank launch."""
    runs = [(family, run_argv(data, family, 1, 1, 1, 1, documents=documents), None)
            for family, documents in keys]
    results = run_distributed(train_runs, 1, runs, timeout=600)[0]
    assert all(status == "ok" for status, *_ in results), results
    return {key: (losses, dict(evals)) for key, (_, losses, evals) in zip(keys, results)}


def _check(result, reference, first=0, where=()):
    """One run's losses (from step ``first`` on) and validation losses equal the serial's."""
    status, losses, evals = result[:3]
    assert status == "ok", (where, result)
    serial, serial_evals = reference
    assert relative_error(losses, serial[first:]) < TOL, (where, losses, serial)
    assert evals and all(it > first for it, _ in evals), (where, evals)
    assert relative_error([e for _, e in evals], [serial_evals[it] for it, _ in evals]) < TOL, \
        (where, evals, serial_evals)


@pytest.mark.slow
def test_context_parallel_equals_serial_resumes_at_another_cp_and_refuses_bad_sizes(
        gpt2_data, tmp_path):
    serial = _serial(gpt2_data, [("gpt2", True), ("llama", False), ("llama", True)])
    a, d = str(tmp_path / "gpt2_cp2"), str(tmp_path / "llama_cp1")
    save = ("--save-interval", str(AT), "--save")
    runs = [
        # a refused size: the sequence of 32 does not cut into 2 x 3 chunks, nor 8 ranks by 3
        ("gpt2", run_argv(gpt2_data, "gpt2", 1, 1, 3, 1), None),
        ("gpt2", run_argv(gpt2_data, "gpt2", 2, 2, 2, 1, "--sequence-parallel",
                          "--checkpoint-activations", *save, a, documents=True), None),
        # cp 2 -> cp 1, pp 2 -> 4
        ("gpt2", run_argv(gpt2_data, "gpt2", 2, 4, 1, 1, "--load", a, documents=True),
         (a, AT)),
        ("llama", run_argv(gpt2_data, "llama", 1, 2, 4, 1, "--pipeline-schedule", "zbv",
                           comm="a2a", documents=True), None),
        ("llama", run_argv(gpt2_data, "llama", 2, 2, 1, 2, *save, d), None),
        # cp 1 -> cp 4, tp 2 -> 1, pp 2 -> 1, onto DeepSpeed's ZeRO-1 over data x context
        ("llama", run_argv(gpt2_data, "llama", 1, 1, 4, 2, "--deepspeed", "--zero-stage", "1",
                           "--checkpoint-activations", "--load", d, comm="all_gather"), (d, AT)),
    ]
    per_rank = run_distributed(train_runs, 8, runs, (3,), timeout=900)
    wanted = [None, (("gpt2", True), 0), (("gpt2", True), AT), (("llama", True), 0),
              (("llama", False), 0), (("llama", False), AT)]
    for rank, results in enumerate(per_rank):
        status, message, groups_built = results[0]
        assert status == "error" and not groups_built, (rank, results[0])
        assert "--seq-length (32) is not divisible by 6" in message, message
        assert "world size (8) is not divisible by" in message, message
        for number, (result, (key, first)) in enumerate(zip(results[1:], wanted[1:])):
            _check(result, serial[key], first, (rank, number + 1))
        # no host-device sync in a step (the ring, the chunked batch, the token layout, the
        # loss over cp) but the first (start-up) and the logging ones (4 and 8: --log-interval
        # and the evaluations)
        syncs = results[3][3]
        assert len(syncs) == 8 and [syncs[i] for i in (1, 2, 4, 5, 6)] == [0] * 5, (rank, syncs)
        assert syncs[3] > 0 and syncs[7] > 0, (rank, syncs)  # the counter is live: the logs


#: name -> (tp, pp, dp, extra flags) beside cp; "alone" is cp by itself
MATRIX_LAYOUTS = {
    "alone": (1, 1, 1, ()),
    "tp2": (2, 1, 1, ()),
    "pp2 1f1b": (1, 2, 1, ("--pipeline-schedule", "1f1b")),
    "pp2 zbv": (1, 2, 1, ("--pipeline-schedule", "zbv")),
    "dp2": (1, 1, 2, ()),
    "tp2 sp recompute": (2, 1, 1, ("--sequence-parallel", "--checkpoint-activations")),
}


def _matrix(family, data):
    """Every (cp, layout, comm type, document masking), by world size; a2a where the heads
    divide (4 heads: not at tp 2 x cp 4, where all_gather runs instead)."""
    by_world = {}
    for cp, name, comm, documents in itertools.product((2, 4), MATRIX_LAYOUTS, ("p2p", "a2a"),
                                                       (False, True)):
        tp, pp, dp, extra = MATRIX_LAYOUTS[name]
        if comm == "a2a" and (4 // tp) % cp:
            comm = "all_gather"
        by_world.setdefault(tp * pp * dp * cp, []).append(
            ((cp, name, comm, documents),
             run_argv(data, family, tp, pp, cp, dp, *extra, comm=comm, documents=documents)))
    return by_world


@pytest.mark.slow
@pytest.mark.exhaustive
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_context_parallel_matrix_equals_serial(family, gpt2_data):
    serial = _serial(gpt2_data, [(family, False), (family, True)])
    for world, cases in sorted(_matrix(family, gpt2_data).items()):
        runs = [(family, argv, None) for _, argv in cases]
        per_rank = run_distributed(train_runs, world, runs, timeout=3000)
        for rank, results in enumerate(per_rank):
            for (case, _), result in zip(cases, results):
                _check(result, serial[(family, case[3])], 0, (world, rank, case))


@pytest.mark.slow
@pytest.mark.exhaustive
def test_compiled_context_parallel_equals_serial_and_breaks_only_at_the_attention(gpt2_data):
    """--compile at cp 2 (GPT-2 one region for the whole model, the Llama example one per
    pipeline chunk): the serial losses; dynamo's graph breaks are all the one eager call of
    the context-parallel attention, made in the first step (measured: GPT-2 4 layers 9
    graphs, 5 breaks; Llama pp 2: 4 breaks per stage of 2 layers) and in the first
    evaluation (its own regions), nothing compiles later and every region compiled once."""
    from compile_runs import train_runs as compiled_runs

    serial = _serial(gpt2_data, [("gpt2", True), ("llama", True)])
    for family, pp in (("gpt2", 1), ("llama", 2)):
        argv = run_argv(gpt2_data, family, 1, pp, 2, 1, "--compile", documents=True)
        for ((losses, steps, entries, reasons),) in run_distributed(
                compiled_runs, 2 * pp, family, [argv], timeout=900):
            assert relative_error(losses, serial[(family, True)][0]) < TOL, (family, losses)
            # compiled in step 1 (training) and at the evaluation of step 4 (its regions),
            # nothing after: the counts change only there
            assert steps[0][2] > 0 and all(s == steps[0] for s in steps[:AT]), (family, steps)
            assert all(s == steps[AT] for s in steps[AT:]), (family, steps)
            assert len(reasons) == 1 and "torch.compiler.disable" in reasons[0], reasons
            assert 1 in entries.values() and set(entries.values()) <= {0, 1}, entries
