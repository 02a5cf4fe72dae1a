"""GPT-2 with MoE layers end to end through pretrain(): layouts against the serial run.

The serial reference runs the same micro-batches (2 samples each; gas = dp of the other run's
total), so every routing loss sees the same tokens. What runs today: expert parallelism 1
(experts replicated) and ep > 1, pipelines, routing losses in the log, through the one
training step (docs/moe.md), and resumes at another ep (each ep rank's experts in its own
checkpoint folder: docs/moe.md, "Checkpoints and Hugging Face").
"""
import pytest

from gpt2_runs import gpt2_argv, train_gpt2
from harness import run_distributed

STEPS = 8
MICRO = 2
GLOBAL = 8
MOE = ["--num-experts", "8", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
       "--moe-z-loss-coeff", "1e-3", "--moe-ffn-hidden-size", "48"]


def _argv(data, tp=1, pp=1, dp=1, cp=1, ep=1, *extra, global_batch=GLOBAL):
    gas = global_batch // (MICRO * dp)
    return gpt2_argv(data, "--num-layers", "4", "--model-parallel-size", str(tp),
                     "--pipe-parallel-size", str(pp), "--context-parallel-size", str(cp),
                     "--expert-model-parallel-size", str(ep), "--batch-size", str(MICRO),
                     "--gas", str(gas), "--train-iters", str(STEPS), "--hidden-dropout", "0",
                     "--attention-dropout", "0", "--log-interval", "1", *MOE, *extra)


def _rel(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def train_with_routing(argv):
    """Rank body: ``(losses, routing losses per logged step)``; the step logs them as
    ``state.routing_stats`` (a list of ``{kind: float}``, one per log line)."""
    import pretrain_gpt2

    state = pretrain_gpt2.main(argv)
    return state.losses, getattr(state, "routing_stats")


@pytest.mark.slow
def test_moe_tp2_equals_serial(gpt2_data):
    """ep 1 at tp 2 (each expert's FFN split over tp, gas 1): the serial losses."""
    runs = [run_distributed(train_gpt2, tp, _argv(gpt2_data, tp, global_batch=MICRO),
                            timeout=300)[0][0] for tp in (1, 2)]
    assert len(runs[0]) == STEPS and runs[0][-1] < runs[0][0]
    assert _rel(runs[1], runs[0]) < 1e-5, runs


def _serial(data):
    return run_distributed(train_with_routing, 1, _argv(data), timeout=400)[0]


def _assert_equal_to_serial(serial, per_rank):
    losses, routing = per_rank[0]
    assert len(losses) == STEPS and _rel(losses, serial[0]) < 1e-5, (losses, serial[0])
    assert len(routing) == STEPS
    for got, want in zip(routing, serial[1]):
        for kind in want:
            assert abs(got[kind] - want[kind]) <= 1e-5 * max(1.0, abs(want[kind])), (kind, got,
                                                                                    want)


#: (tp, pp, cp, ep, extra flags) of a 4-rank run; the default run's covering subset.
LAYOUTS = [(1, 1, 1, 2, ()), (1, 2, 1, 2, ())]
MORE_LAYOUTS = [(1, 1, 1, 4, ()), (2, 1, 1, 2, ()), (1, 2, 1, 2, ("--pipeline-schedule", "zbv")),
                (1, 1, 2, 2, ()), (1, 1, 1, 2, ("--use-distributed-optimizer",)),
                (1, 1, 1, 2, ("--compile",))]


def _run_layouts(data, layouts):
    serial = _serial(data)
    for tp, pp, cp, ep, extra in layouts:
        dp = 4 // (tp * pp * cp)
        argv = _argv(data, tp, pp, dp, cp, ep, *extra)
        _assert_equal_to_serial(serial, run_distributed(train_with_routing, 4, argv,
                                                        timeout=600))


@pytest.mark.slow
def test_expert_parallel_layouts_equal_serial(gpt2_data):
    """Per-step losses and routing losses within 1e-5 of serial (fp32, dropless, clipping)."""
    _run_layouts(gpt2_data, LAYOUTS)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_expert_parallel_layouts_equal_serial_matrix(gpt2_data):
    """ep 4, ep 2 x tp 2, ep 2 x pp 2 ZB-V, ep 2 x cp 2, the distributed optimizer, ZeRO-1,
    --compile."""
    _run_layouts(gpt2_data, MORE_LAYOUTS)


def train_t5_with_routing(argv):
    import pretrain_t5

    state = pretrain_t5.main(argv)
    return state.losses, getattr(state, "routing_stats")


def train_mixtral_with_routing(argv):
    from llama_runs import train_llama  # noqa: F401 (puts examples/llama on the path)
    from llama_model import LLAMA
    from megatron.training import pretrain

    state = pretrain(family=LLAMA, argv=argv)
    return state.losses, getattr(state, "routing_stats")


SWITCH = ["--num-experts", "4", "--moe-router-topk", "1", "--moe-router-pre-softmax",
          "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3", "--moe-layer-freq", "2"]


@pytest.mark.slow
def test_t5_switch_ep2_pp2_equals_serial(t5_data):
    """T5 as the Switch Transformer (top-1, every other layer) at ep 2 x pp 2."""
    from t5_runs import t5_argv

    def argv(pp, dp):
        return t5_argv(t5_data, "--num-layers", "2", "--pipe-parallel-size", str(pp),
                       "--expert-model-parallel-size", str(dp), "--batch-size", str(MICRO),
                       "--gas", str(GLOBAL // (MICRO * dp)), "--train-iters", str(STEPS),
                       "--hidden-dropout", "0", "--attention-dropout", "0",
                       "--log-interval", "1", *SWITCH)

    serial = run_distributed(train_t5_with_routing, 1, argv(1, 1), timeout=400)[0]
    _assert_equal_to_serial(serial, run_distributed(train_t5_with_routing, 4, argv(2, 2),
                                                    timeout=600))


@pytest.mark.slow
def test_llama_as_mixtral_ep2_tp2_equals_serial(gpt2_data):
    from llama_runs import llama_argv

    mixtral = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
               "--moe-grouped-gemm", "--log-interval", "1"]
    serial_argv = llama_argv(gpt2_data, 1, 1, *mixtral, global_batch=GLOBAL)  # gas 4
    serial = run_distributed(train_mixtral_with_routing, 1, serial_argv, timeout=400)[0]
    argv = llama_argv(gpt2_data, 2, 1, "--expert-model-parallel-size", "2", *mixtral,
                      global_batch=GLOBAL)  # dp 2: gas 2
    _assert_equal_to_serial(serial, run_distributed(train_mixtral_with_routing, 4, argv,
                                                    timeout=600))


# ---------------------------------------------------------------- balancing on the real corpus
BALANCE_STEPS = 200
#: The balanced run's max/mean tokens per expert (mean over its last 50 steps) must be below
#: this fraction of the unbalanced run's. Measured: docs/benchmarks.md, "MoE balancing".
BALANCE_MARGIN = 0.75


def _imbalance(argv):
    """Rank body: max/mean tokens per expert (averaged over the MoE layers), read after each
    step through the routing statistics, averaged over the first 10 and the last 50 of the
    200 steps."""
    import pretrain_gpt2
    from megatron.mpu import moe
    from megatron.training import loop

    ratios = []
    original = loop.train_step

    def step_and_read(forward_step_func, data_iterator, backend):
        out = original(forward_step_func, data_iterator, backend)
        stats = moe.routing_statistics(backend.model, num_layers=4)
        moe_rows = stats["tokens_per_expert_mean"] > 0
        ratios.append(float((stats["tokens_per_expert_max"][moe_rows] /
                             stats["tokens_per_expert_mean"][moe_rows]).mean()))
        return out

    loop.train_step = step_and_read
    try:
        pretrain_gpt2.main(argv)
    finally:
        loop.train_step = original
    return sum(ratios[:10]) / 10, sum(ratios[-50:]) / 50


def _balance_argv(data, *flags):
    return gpt2_argv(data, "--num-layers", "4", "--batch-size", "4", "--gas", "1",
                     "--train-iters", str(BALANCE_STEPS), "--hidden-dropout", "0",
                     "--attention-dropout", "0", "--log-interval", "50", "--num-experts", "8",
                     "--moe-router-topk", "2", "--moe-layer-freq", "2", "--lr", "3e-3", *flags)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_aux_loss_balances_the_experts(gpt2_data):
    none, aux = (run_distributed(_imbalance, 1, _balance_argv(gpt2_data, *flags),
                                 timeout=900)[0]
                 for flags in ([], ["--moe-aux-loss-coeff", "1e-1"]))
    print(f"max/mean tokens per expert (first 10 / last 50 steps): none {none}, aux {aux}")
    assert aux[1] < BALANCE_MARGIN * none[1], (aux, none)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_expert_bias_balances_the_experts(gpt2_data):
    none, bias = (run_distributed(_imbalance, 1, _balance_argv(gpt2_data, *flags),
                                  timeout=900)[0]
                  for flags in ([], ["--moe-router-enable-expert-bias",
                                     "--moe-router-score-function", "sigmoid",
                                     "--moe-router-bias-update-rate", "1e-2"]))
    print(f"max/mean tokens per expert (first 10 / last 50 steps): none {none}, bias {bias}")
    assert bias[1] < BALANCE_MARGIN * none[1], (bias, none)


# ---------------------------------------------------------------- resume
@pytest.mark.slow
def test_moe_resume_is_exact(gpt2_data, tmp_path):
    """N steps, save, resume, M steps == N + M steps (ep 1, gas 1: today's step)."""
    from gpt2_runs import full_and_resumed

    argv = _argv(gpt2_data, global_batch=MICRO)
    full, resumed = full_and_resumed(train_gpt2, 1, argv, str(tmp_path / "ckpt"), STEPS // 2)
    assert len(resumed[0]) == STEPS
    assert max(abs(a - b) for a, b in zip(full[0], resumed[0])) <= 1e-6, (full, resumed)


def _resume_at(data, tmp_path, source, target, *extra):
    """Train 4 steps at ``source`` (tp, pp, ep), save; resume 4 more at ``target``; compare
    with 8 uninterrupted steps at ``source`` (``extra`` flags in both runs)."""
    ckpt = str(tmp_path / "ckpt")

    def argv(tp, pp, ep, *more):
        dp = 4 // (tp * pp)
        return _argv(data, tp, pp, dp, 1, ep, *extra, *more)

    full = run_distributed(train_gpt2, 4, argv(*source, "--save", ckpt, "--save-interval", "4"),
                           timeout=600)[0][0]
    with open(f"{ckpt}/latest_checkpointed_iteration.txt", "w") as handle:
        handle.write("4")
    later = run_distributed(train_gpt2, 4, argv(*target, "--load", ckpt), timeout=600)[0][0]
    assert _rel(full[:4] + later, full) < 1e-5, (full, later)


@pytest.mark.slow
def test_resume_ep2_as_ep1_with_a_tp_change(gpt2_data, tmp_path):
    _resume_at(gpt2_data, tmp_path, (1, 1, 2), (2, 1, 1))


@pytest.mark.slow
@pytest.mark.exhaustive
def test_resume_ep1_as_ep4_with_a_pp_change(gpt2_data, tmp_path):
    _resume_at(gpt2_data, tmp_path, (1, 2, 1), (1, 1, 4))


@pytest.mark.slow
@pytest.mark.exhaustive
def test_resume_from_a_distributed_optimizer_checkpoint_at_another_ep(gpt2_data, tmp_path):
    _resume_at(gpt2_data, tmp_path, (1, 1, 2), (1, 1, 4), "--use-distributed-optimizer")


@pytest.mark.slow
@pytest.mark.exhaustive
def test_moe_pipeline_without_routing_losses_equals_serial(gpt2_data):
    """MoE layers on pipeline stages, ep 1, no routing loss: the serial losses (refused with
    today's pipeline engine, DeepSpeed's, which takes the experts for its own MoE's)."""
    plain = [a for a in MOE if a not in ("--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff",
                                         "1e-3")]

    def argv(pp):
        return gpt2_argv(gpt2_data, "--num-layers", "4", "--pipe-parallel-size", str(pp),
                         "--batch-size", str(MICRO), "--gas", "4", "--train-iters", str(STEPS),
                         "--hidden-dropout", "0", "--attention-dropout", "0", *plain)

    serial, piped = (run_distributed(train_gpt2, pp, argv(pp), timeout=600)[0][0]
                     for pp in (1, 2))
    assert len(piped) == STEPS and _rel(piped, serial) < 1e-5, (piped, serial)


@pytest.mark.slow
@pytest.mark.exhaustive
def test_moe_resume_at_another_tp(gpt2_data, tmp_path):
    """Saved at tp 1, resumed at tp 2 (ep 1, gas 1): the experts' tp split comes from the
    sharding record; the losses continue the uninterrupted run."""
    ckpt = str(tmp_path / "ckpt")
    full = run_distributed(train_gpt2, 1, _argv(gpt2_data, global_batch=MICRO) +
                           ["--save", ckpt, "--save-interval", "4"], timeout=300)[0][0]
    with open(f"{ckpt}/latest_checkpointed_iteration.txt", "w") as handle:
        handle.write("4")
    later = run_distributed(train_gpt2, 2, _argv(gpt2_data, 2, global_batch=MICRO) +
                            ["--load", ckpt], timeout=300)[0][0]
    assert _rel(full[:4] + later, full) < 1e-5, (full, later)
