"""``--compile`` gives one graph per transformer layer: counted with ``torch._dynamo.explain``.

Each layer class the compile wraps (GPT-2's ``ParallelTransformerLayer``, T5's encoder and
decoder layers, and at tp = 1 their pipeline-stage subclasses) is traced once, forward only, on fresh random inputs. At tensor-parallel
size 1, with dropout 0 and 0.1: one graph, no break (the fused kernels are custom operators,
the RNG tracker is not forked). At size 2, on two gloo ranks: one graph at dropout 0 (dynamo
traces the mpu collectives), and at dropout 0.1 the count docs/training.md gives
(:data:`TP2_DROPOUT_GRAPHS`: each fork of the RNG tracker is a break; eager forks exactly where
a per-rank dropout mask is drawn). Each break is reported
with its reason, so a new one names the line that caused it.

Then whole models, compiled as one region as ``--compile`` does (``aot_eager`` backend:
dynamo and AOTAutograd with eager kernels, so the dropout draws are eager's), must give
eager's losses and weights over two SGD steps at dropout 0.1, at tp 1 and 2: the forks still
give each rank its own stream; one graph at tp 1, and at tp 2 the declared fork breaks only
(:data:`REGION_GRAPHS_TP2_DROPOUT`). And in eager, the RNG tracker is forked exactly where a
per-rank mask is drawn.
"""
import os
import random

import pytest
import torch

from harness import run_distributed

HIDDEN, HEADS, SEQ, DEC_SEQ, BATCH, VOCAB = 32, 4, 16, 8, 2, 64

#: Graphs per layer at tp = 2 with dropout 0.1 and the default SDPA attention: a fork of
#: the RNG tracker around each per-rank dropout (GPT-2: attention; T5: each attention and
#: the MLP) breaks the graph once in each frame that encloses it (docs/training.md).
TP2_DROPOUT_GRAPHS = {"gpt2": 6, "t5_encoder": 9, "t5_decoder": 12}
#: Graphs of a whole tiny model compiled as one region (``--compile``) at tp = 2 with dropout
#: 0.1: each fork breaks the region in every frame around it (GPT-2: 2 layers, 2 forks;
#: T5: 2 + 2 layers, 10 forks). One graph at tp = 1 or dropout 0 (docs/training.md).
REGION_GRAPHS_TP2_DROPOUT = {"gpt2": 9, "t5": 27}


def _gpt2_config(dropout, backend):
    from megatron.model.transformer import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
                             kv_channels=HIDDEN // HEADS, ffn_hidden_size=2 * HIDDEN,
                             hidden_dropout=dropout, attention_dropout=dropout,
                             attention_backend=backend)


def _gpt2_case(dropout, backend):
    from megatron.model.transformer import ParallelTransformerLayer

    layer = ParallelTransformerLayer(_gpt2_config(dropout, backend), 1)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    return layer, (torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True), mask)


def _t5_config(dropout, backend):
    from megatron.model.t5_layers import T5TransformerConfig

    return T5TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               kv_channels=HIDDEN // HEADS, ffn_hidden_size=2 * HIDDEN,
                               vocab_size=64, hidden_dropout=dropout, attention_dropout=dropout,
                               attention_backend=backend)


def _padding_mask(sq, sk):
    keep = torch.rand(BATCH, sk) > 0.3
    keep[:, 0] = True
    return (~keep)[:, None, None, :].expand(BATCH, 1, sq, sk)


def _t5_encoder_case(dropout, backend):
    from megatron.model.t5_layers import RelativePositionBias, T5EncoderLayer

    config = _t5_config(dropout, backend)
    layer = T5EncoderLayer(config, 1)
    bias = RelativePositionBias(config, bidirectional=True)(SEQ, SEQ).detach()
    return layer, (torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True),
                   _padding_mask(SEQ, SEQ), bias)


def _t5_decoder_case(dropout, backend):
    from megatron.model.t5_layers import RelativePositionBias, T5DecoderLayer

    config = _t5_config(dropout, backend)
    layer = T5DecoderLayer(config, 1)
    bias = RelativePositionBias(config, bidirectional=False)(DEC_SEQ, DEC_SEQ).detach()
    causal = torch.ones(DEC_SEQ, DEC_SEQ, dtype=torch.bool).triu(1)[None, None]
    return layer, (torch.randn(DEC_SEQ, BATCH, HIDDEN, requires_grad=True), causal, bias,
                   torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True),
                   _padding_mask(DEC_SEQ, SEQ))


CASES = {"gpt2": _gpt2_case, "t5_encoder": _t5_encoder_case, "t5_decoder": _t5_decoder_case}


def _pipe_case(name):
    """The pipeline stage's layer (tds layer spec): one tuple in, one out; T5's layers
    compute the shared relative bias inside the compiled region."""
    def case(dropout, backend):
        from megatron.model import gpt2_model_pipe, t5_model_pipe
        from megatron.model.t5_layers import RelativePositionBias

        _, inputs = CASES[name](dropout, backend)
        if name == "gpt2":
            config = _gpt2_config(dropout, backend)
            return gpt2_model_pipe.ParallelTransformerLayerPipe(config, 1), (inputs,)
        config, shared = _t5_config(dropout, backend), t5_model_pipe.SharedBias()
        shared.module = RelativePositionBias(config, bidirectional=name == "t5_encoder")
        if name == "t5_encoder":
            pipe = t5_model_pipe.T5EncoderLayerPipe(config, 1, shared)
            hidden, mask, _ = inputs
            dec = torch.randn(DEC_SEQ, BATCH, HIDDEN)
            causal = torch.ones(DEC_SEQ, DEC_SEQ, dtype=torch.bool).triu(1)[None, None]
            return pipe, ((hidden, mask, dec, causal, _padding_mask(DEC_SEQ, SEQ)),)
        pipe = t5_model_pipe.T5DecoderLayerPipe(config, 1, shared)
        dec, causal, _, enc, cross = inputs
        return pipe, ((enc, _padding_mask(SEQ, SEQ), dec, causal, cross),)

    return case


PIPE_CASES = {f"{name}_pipe": _pipe_case(name) for name in CASES}


def _explain(tp, seed, runs):
    """``(name, dropout, backend) -> (graphs, breaks, reasons)`` for each run on this rank."""
    from megatron import mpu
    from megatron.model.compile import prepare_for_compile

    prepare_for_compile()  # what --compile (compile_layers) does first
    mpu.initialize_model_parallel(tp, 1)
    mpu.model_parallel_cuda_manual_seed(seed)
    counts = {}
    for name, dropout, backend in runs:
        torch.manual_seed(seed)
        layer, inputs = {**CASES, **PIPE_CASES}[name](dropout, backend)
        torch._dynamo.reset()
        result = torch._dynamo.explain(layer)(*inputs)
        reasons = [f"{r.reason.splitlines()[0]} at " +
                   "; ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                             for f in r.user_stack[-2:]) for r in result.break_reasons]
        counts[(name, dropout, backend)] = (result.graph_count, result.graph_break_count,
                                            reasons)
    return counts


def _everything(tp, seed, count_layers=True):
    """Graph counts and compiled/eager training on this rank (one process per tp: dynamo's
    start-up is paid once). ``count_layers=False``: no per-layer graph counts (at tp 2 only
    the exhaustive run asks for them)."""
    runs = [(name, dropout, "sdpa") for name in CASES for dropout in (0.0, 0.1)]
    if tp == 1:
        runs += [(name, 0.1, "unfused") for name in CASES]  # bmm + fused softmax + dropout
        runs += [(name, 0.1, "sdpa") for name in PIPE_CASES]
    counts = _explain(tp, seed, runs if count_layers else [])
    return counts, _compiled_and_eager(seed), _forks(seed)


def _forks(seed):
    """``(name, dropout, training) -> (forks, stream advanced)`` in one eager forward and
    backward of each layer."""
    from megatron import mpu

    tracker, forks, seen = mpu.get_cuda_rng_tracker(), [], {}
    original = tracker.fork
    tracker.fork = lambda *a, **k: forks.append(1) or original(*a, **k)
    try:
        for name in CASES:
            for dropout, training in ((0.0, True), (0.1, False), (0.1, True)):
                layer, inputs = CASES[name](dropout, "sdpa")
                layer.train(training)
                before, forks[:] = tracker.get_states(), []
                layer(*inputs).sum().backward()
                after = tracker.get_states()
                seen[(name, dropout, training)] = (len(forks), not all(
                    torch.equal(before[k], after[k]) for k in before))
    finally:
        del tracker.fork
    return seen


@pytest.fixture(scope="module")
def results():
    """(tp, count_layers) -> per-rank results of :func:`_everything`, computed on first use
    (a run that counted the layers serves a test that does not ask for them)."""
    seed = int(os.environ.get("MEGATRON_TEST_SEED") or random.SystemRandom().randrange(2**31))
    print(f"seed={seed} (rerun with MEGATRON_TEST_SEED={seed})")
    cache = {}

    def get(tp, count_layers=True):
        if (tp, True) in cache:
            return cache[(tp, True)]
        if (tp, count_layers) not in cache:
            cache[(tp, count_layers)] = run_distributed(_everything, tp, tp, seed, count_layers,
                                                        timeout=600)
        return cache[(tp, count_layers)]

    return get


def test_one_graph_per_layer_at_tp1(results):
    counts = results(1)[0][0]
    assert {name for name, _, _ in counts} == set(CASES) | set(PIPE_CASES)
    for run, (graphs, breaks, reasons) in counts.items():
        assert (graphs, breaks) == (1, 0), f"{run}: {graphs} graphs, breaks: {reasons}"


@pytest.mark.slow
@pytest.mark.exhaustive  # the default run: tp 1's graphs and the tracker-fork test at tp 2
def test_graphs_per_layer_at_tp2(results):
    per_rank = [rank[0] for rank in results(2)]
    assert per_rank[0] == per_rank[1]
    for (name, dropout, _), (graphs, breaks, reasons) in per_rank[0].items():
        want = 1 if dropout == 0 else TP2_DROPOUT_GRAPHS[name]
        assert (graphs, breaks) == (want, want - 1), f"{name} p={dropout}: {reasons}"
        assert all("in_model_parallel_stream" in r or "disable" in r for r in reasons), reasons


# ---------------------------------------------------------------- compiled == eager
def _gpt2_model(dropout):
    from megatron.model.gpt2_model import GPT2Model
    from megatron.model.transformer import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               kv_channels=HIDDEN // HEADS, ffn_hidden_size=2 * HIDDEN,
                               hidden_dropout=dropout, attention_dropout=dropout)
    model = GPT2Model(config, VOCAB, SEQ)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=gen)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).triu(1)
    pos = torch.arange(SEQ).expand(BATCH, SEQ)
    return model, lambda m: m(ids[:, :-1], pos, mask, labels=ids[:, 1:]).mean()


def _t5_model(dropout):
    from megatron.model.t5_model import T5Model, t5_attention_masks

    model = T5Model(_t5_config(dropout, "sdpa"))
    gen = torch.Generator().manual_seed(7)
    enc, dec = (torch.randint(VOCAB, (BATCH, n), generator=gen) for n in (SEQ, DEC_SEQ))
    labels = torch.randint(VOCAB, (BATCH, DEC_SEQ), generator=gen)
    enc_real, dec_real = torch.rand(BATCH, SEQ, generator=gen) > 0.2, \
        torch.ones(BATCH, DEC_SEQ, dtype=torch.bool)
    enc_real[:, 0] = True
    masks = t5_attention_masks(enc_real, dec_real)
    return model, lambda m: m(enc, dec, *masks, labels=labels).mean()


def _train(family, compiled, seed, steps=2, lr=0.5):
    from megatron import mpu
    from megatron.model.compile import compile_model, compiler

    from torch._dynamo.utils import counters

    mpu.model_parallel_cuda_manual_seed(seed)
    model, loss_fn = (_gpt2_model if family == "gpt2" else _t5_model)(0.1)
    if compiled:  # the whole model one region, as --compile (dynamo + AOTAutograd, eager kernels)
        torch._dynamo.reset()
        counters.clear()
        compile_model(model, None, compiler(backend="aot_eager"))
    losses = []
    for _ in range(steps):
        loss = loss_fn(model)
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
                p.grad = None
        losses.append(loss.item())
    # numpy: a queue shares tensors through the rank's process, which exits after reporting
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    breaks = sorted({str(k).splitlines()[0][:100] for k in counters["graph_break"]})
    return losses, weights, (counters["stats"]["unique_graphs"], breaks) if compiled else 0


def _compiled_and_eager(seed):
    return {family: (_train(family, False, seed), _train(family, True, seed))
            for family in ("gpt2", "t5")}


@pytest.mark.slow
def test_compiled_models_train_like_eager_with_dropout(results):
    for tp in (1, 2):
        counts, trained = results(tp, count_layers=tp == 1)[0][:2]
        for family, ((eager, w_eager, _), (compiled, w_compiled, graphs)) in trained.items():
            # the model one region: one graph at tp 1; at tp 2 each fork breaks it (declared)
            count, breaks = graphs
            assert count == (1 if tp == 1 else REGION_GRAPHS_TP2_DROPOUT[family]), \
                (family, tp, graphs)
            assert all("disable()" in b for b in breaks), breaks
            torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager),
                                       rtol=1e-5, atol=0, msg=f"{family} tp={tp}")
            torch.testing.assert_close(torch.from_numpy(w_compiled), torch.from_numpy(w_eager),
                                       rtol=1e-5, atol=1e-6, msg=f"{family} tp={tp}")


#: Dropouts on split activations per layer: attention (GPT-2, each T5 attention), T5's MLP.
PER_RANK_DROPOUTS = {"gpt2": 1, "t5_encoder": 2, "t5_decoder": 3}


def test_tracker_is_forked_only_where_a_per_rank_mask_is_drawn(results):
    for tp in (1, 2):
        for (name, dropout, training), (forks, advanced) in \
                results(tp, count_layers=tp == 1)[0][2].items():
            drawn = tp > 1 and dropout > 0 and training
            assert forks == (PER_RANK_DROPOUTS[name] if drawn else 0), (tp, name, dropout)
            assert advanced == drawn, (tp, name, dropout, training)
