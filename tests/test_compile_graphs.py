"""``--compile`` gives one graph per transformer layer: counted with ``torch._dynamo.explain``.

Each layer class the compile wraps (GPT-2's ``ParallelTransformerLayer``, T5's encoder and
decoder layers) is traced once, forward only, on fresh random inputs, at tensor-parallel
size 1 with dropout 0 and 0.1 (one graph, no break: the fused kernels are custom operators,
the RNG tracker is not forked) and at size 2 on two gloo ranks, where the count is the one
docs/training.md gives (:data:`TP2_GRAPHS`). Each break is reported with its reason, so a
new one names the line that caused it.
"""
import pytest
import torch

from harness import run_distributed

HIDDEN, HEADS, SEQ, DEC_SEQ, BATCH = 32, 4, 16, 8, 2

#: Graphs per layer at tp = 2 with dropout 0 (docs/training.md, "Compiling").
TP2_GRAPHS = {"gpt2": None, "t5_encoder": None, "t5_decoder": None}


def _gpt2_case(dropout, backend):
    from megatron.model.transformer import ParallelTransformerLayer, TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               kv_channels=HIDDEN // HEADS, ffn_hidden_size=2 * HIDDEN,
                               hidden_dropout=dropout, attention_dropout=dropout,
                               attention_backend=backend)
    layer = ParallelTransformerLayer(config, 1)
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


def _explain(tp, seed, runs):
    """``(name, dropout, backend) -> (graphs, breaks, reasons)`` for each run on this rank."""
    from megatron import mpu

    mpu.initialize_model_parallel(tp, 1)
    mpu.model_parallel_cuda_manual_seed(seed)
    counts = {}
    for name, dropout, backend in runs:
        torch.manual_seed(seed)
        layer, inputs = CASES[name](dropout, backend)
        torch._dynamo.reset()
        result = torch._dynamo.explain(layer)(*inputs)
        reasons = [f"{r.reason.splitlines()[0]} at " +
                   "; ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"
                             for f in r.user_stack[-2:]) for r in result.break_reasons]
        counts[(name, dropout, backend)] = (result.graph_count, result.graph_break_count,
                                            reasons)
    return counts


def test_one_graph_per_layer_at_tp1(seed):
    runs = [(name, dropout, "sdpa") for name in CASES for dropout in (0.0, 0.1)]
    runs += [(name, 0.1, "unfused") for name in CASES]  # bmm + fused softmax + dropout
    counts = run_distributed(_explain, 1, 1, seed, runs, timeout=300)[0]
    for run, (graphs, breaks, reasons) in counts.items():
        assert (graphs, breaks) == (1, 0), f"{run}: {graphs} graphs, breaks: {reasons}"
