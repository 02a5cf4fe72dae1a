"""Deferred weight gradients (zero-bubble B / W split, megatron/mpu/weight_grad.py).

Reference: today's path (``F.linear`` + autograd, deferral off) on the same module, the
same fresh random inputs and output gradients. Two modes with deferral on: ``unsplit``
(backward outside ``record``) and ``split`` (B of micro-batch 0, B of 1, then flush 0,
flush 1). In fp32 every gradient (input, weight, bias) must be bit-identical
(``torch.equal``) for every layer, with activation recompute (mpu's and DeepSpeed's
reentrant checkpoint, torch's non-reentrant one) and under bf16 autocast. One exception,
by construction: a tied embedding weight gets its lookup gradient in B and its output-layer
gradient in W, so over several micro-batches the additions run in another order
(``((e0 + e1) + o0) + o1`` instead of ``(e0 + o0) + (e1 + o1)``): within 1e-6 there, exact
with one micro-batch (``e + o == o + e``).
"""
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from harness import run_distributed
from megatron import mpu

H, S, B, V = 32, 8, 2, 64
DEFERRED_NODES = ("LinearWithDeferredWeightGradBackward",
                  "_SequenceParallelLinearDeferredWeightGradBackward")


def _graph_names(tensor):
    """Type names of every autograd node behind ``tensor``."""
    names, todo, seen = set(), [tensor.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return names


# ------------------------------------------------------------------ in-process (no ranks)
class _Lin(nn.Module):
    """The smallest deferrable layer: ``mpu.deferrable_linear`` on its own weight."""
    weight_grad_deferrable = True

    def __init__(self, bias, device):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(24, 16, device=device))
        self.bias = nn.Parameter(torch.randn(24, device=device)) if bias else None

    def forward(self, x):
        return mpu.deferrable_linear(x, self.weight, self.bias)


LAYOUTS = {  # the input layouts aten::linear treats differently
    "3d": lambda d: torch.randn(S, B, 16, device=d),
    "2d": lambda d: torch.randn(S * B, 16, device=d),
    "2d-col-major": lambda d: torch.randn(16, S * B, device=d).t(),
    "3d-transposed": lambda d: torch.randn(B, S, 16, device=d).transpose(0, 1),
    "3d-strided": lambda d: torch.randn(S, B, 32, device=d)[..., ::2],
}


def _three_ways(module, inputs, dys, autocast, device):
    """{mode: [(output, input grad) per micro-batch] + [param grads]} for the 3 modes."""
    results = {}
    for mode in ("plain", "unsplit", "split"):
        module.zero_grad(set_to_none=True)
        store = mpu.set_weight_grad_deferral(module, enabled=mode != "plain")
        outs = []
        for mb, (x0, dy) in enumerate(zip(inputs, dys)):
            x = x0.detach().requires_grad_()
            with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
                y = module(x)
            assert (DEFERRED_NODES[0] in _graph_names(y)) == (mode != "plain"), mode
            with store.record(mb) if mode == "split" else contextlib.nullcontext():
                y.backward(dy.to(y.dtype))
            outs.append((y.detach(), x.grad))
        if mode == "split":
            assert module.weight.grad is None  # deferred, not computed in B
            assert [store.flush(mb) for mb in range(len(inputs))] == [1] * len(inputs)
            store.check_flushed()
        results[mode] = outs + [p.grad for p in module.parameters()]
    mpu.set_weight_grad_deferral(module, enabled=False)
    return results


def _flat(entries):
    for e in entries:
        yield from (e if isinstance(e, tuple) else (e,))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_deferrable_linear_is_bit_identical_to_f_linear(layout, bias, autocast, device):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA")
    module = _Lin(bias, device)
    inputs = [LAYOUTS[layout](device) for _ in range(2)]
    dys = [torch.randn(*x.shape[:-1], 24, device=device) for x in inputs]
    res = _three_ways(module, inputs, dys, autocast, device)
    for mode in ("unsplit", "split"):
        for i, (ref, got) in enumerate(zip(_flat(res["plain"]), _flat(res[mode]))):
            assert ref.dtype == got.dtype and torch.equal(ref, got), (mode, i)
    assert module.weight.grad.dtype == torch.float32  # fp32 weights get fp32 grads


def test_store_errors_name_the_keys():
    module = _Lin(True, "cpu")
    store = mpu.set_weight_grad_deferral(module)
    with pytest.raises(mpu.WeightGradStoreError, match=r"flush\(\(0, 5\)\): nothing recorded"):
        store.flush((0, 5))
    for mb in range(2):
        with store.record((1, mb)):
            module(torch.randn(S, B, 16)).sum().backward()
    assert store.pending_keys() == [(1, 0), (1, 1)]
    with pytest.raises(mpu.WeightGradStoreError, match=r"\(1, 0\): 1, \(1, 1\): 1"):
        store.check_flushed()
    with store.record((2, 0)):
        with pytest.raises(mpu.WeightGradStoreError, match="already recording"):
            with store.record((2, 1)):
                pass
        with pytest.raises(mpu.WeightGradStoreError, match="still recording"):
            store.flush((2, 0))
    store.flush((1, 0))
    with pytest.raises(mpu.WeightGradStoreError, match=r"flush\(\(1, 0\)\)"):
        store.flush((1, 0))  # each key once
    assert sorted(store.clear()) == [(1, 1), (2, 0)]
    store.check_flushed()
    # a saved input changed in place between B and W (e.g. a reused receive buffer)
    hidden = torch.randn(S, B, 16, requires_grad=True) * 1.0
    with store.record("mb"):
        module(hidden).sum().backward()
    hidden.add_(1.0)  # what a recycled receive buffer would do
    with pytest.raises(mpu.WeightGradStoreError, match="modified in place between B and W"):
        store.flush("mb")


def test_accumulate_grad_matches_autograd():
    """First gradient kept in the parameter's layout, then added in place, cast to its dtype."""
    param = nn.Parameter(torch.randn(6, 4))
    g1 = torch.randn(4, 6).t()  # non-contiguous: copied into the parameter's layout
    mpu.accumulate_grad(param, g1)
    assert param.grad.is_contiguous() and torch.equal(param.grad, g1)
    g2 = torch.randn(6, 4, dtype=torch.bfloat16)
    mpu.accumulate_grad(param, g2)
    ref = nn.Parameter(param.detach().clone())
    (ref * g1).sum().backward()
    (ref.to(torch.bfloat16) * g2).sum().backward()
    assert param.grad.dtype == torch.float32 and torch.equal(param.grad, ref.grad)


def _compiled_deferral(reuse_buffers):
    """Three GPT-2 layers compiled (inductor) with deferral on, B then W: their gradients
    against the same layers' unsplit eager backward (max relative error)."""
    from megatron.model.transformer import ParallelTransformer, TransformerConfig

    mpu.initialize_model_parallel(1, 1)
    config = TransformerConfig(num_layers=3, hidden_size=H, num_attention_heads=4,
                               kv_channels=H // 4, ffn_hidden_size=2 * H, hidden_dropout=0.0,
                               attention_dropout=0.0)
    model = ParallelTransformer(config)
    x = torch.randn(S, B, H, requires_grad=True)
    mask = torch.ones(1, 1, S, S, dtype=torch.bool).triu(1)
    dy = torch.randn(S, B, H)
    model(x, mask).backward(dy)
    ref = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    store = mpu.set_weight_grad_deferral(model)
    options = {} if reuse_buffers else mpu.WEIGHT_GRAD_COMPILE_OPTIONS
    compiled = torch.compile(lambda t, m: model(t, m), options=options, dynamic=False)
    with store.record(0):
        compiled(x, mask).backward(dy)
    left = [p.grad for p in model.parameters() if p.dim() == 2 and p.grad is not None]
    store.flush(0)
    got = [p.grad for p in model.parameters()] + [x.grad]
    return left, max(((a - b).abs().max() / a.abs().max()).item() for a, b in zip(ref, got))


def test_compiled_layers_defer_their_weight_gemms_and_match_the_eager_backward():
    """Compiled, the B pass is one graph that calls the deferring operator; W runs the store's
    GEMMs. Without mpu.WEIGHT_GRAD_COMPILE_OPTIONS inductor reuses the memory of a tensor the
    store holds for W (measured here with torch 2.13: 8e-3 relative error); with them the
    gradients are the eager backward's (float rounding: compiled kernels)."""
    left, error = run_distributed(_compiled_deferral, 1, False, timeout=600)[0]
    assert left == []  # no weight gradient before W: all deferred
    assert error < 1e-5, error

def _layer(kind, col, row):
    """One linear layer; ``col`` / ``row``: the sequence-parallel keyword, if any."""
    if kind == "column-gather":
        return mpu.ColumnParallelLinear(H, 2 * H, gather_output=True)
    if kind == "column-nobias":
        return mpu.ColumnParallelLinear(H, 2 * H, bias=False, gather_output=False, **col)
    if kind == "column-skip-bias":
        return mpu.ColumnParallelLinear(H, 2 * H, gather_output=False, skip_bias_add=True,
                                        **col)
    if kind == "row-scatter":
        return mpu.RowParallelLinear(2 * H, H)
    if kind == "row-parallel-nobias":
        return mpu.RowParallelLinear(2 * H, H, bias=False, input_is_parallel=True, **row)
    return mpu.RowParallelLinear(2 * H, H, input_is_parallel=True, skip_bias_add=True, **row)


class _Case(nn.Module):
    """One layer (or an MLP, or an LM with a tied output layer) and how to run it."""

    def __init__(self, kind, sp):
        super().__init__()
        self.kind, self.sp, self.recompute = kind, sp, None
        tp = mpu.get_tensor_model_parallel_world_size()
        col = {"sequence_parallel": True} if sp else {}
        row = {"sequence_parallel": True} if sp else {}
        if kind == "mlp" or kind == "lm":
            self.fc1 = mpu.ColumnParallelLinear(H, 4 * H, gather_output=False, **col)
            self.fc2 = mpu.RowParallelLinear(4 * H, H, input_is_parallel=True, **row)
        if kind == "lm":
            self.embedding = mpu.VocabParallelEmbedding(V, H)
        if kind not in ("mlp", "lm"):
            self.layer = _layer(kind, col, row)
        seq = S // tp if sp else S
        width = {"row-scatter": 2 * H, "row-parallel-nobias": 2 * H // tp,
                 "row-skip-bias": 2 * H // tp}.get(kind, H)
        self.input_shape = (B, S) if kind == "lm" else (seq, B, width)

    def body(self, x):
        if self.kind in ("mlp", "lm"):
            return x + self.fc2(F.gelu(self.fc1(x)[0]))[0]
        out, bias = self.layer(x)
        return out if bias is None else out + bias

    def forward(self, x, labels=None):
        if self.kind != "lm":
            return self.body(x) if self.recompute is None else self.recompute(self.body, x)
        from megatron.model.language_model import parallel_lm_logits

        hidden = self.embedding(x).transpose(0, 1).contiguous()  # [s, b, h]
        if self.sp:
            hidden = mpu.scatter_to_sequence_parallel_region(hidden)
        hidden = self.body(hidden) if self.recompute is None else \
            self.recompute(self.body, hidden)
        logits = parallel_lm_logits(hidden, self.embedding.weight, True,
                                    sequence_parallel=self.sp)  # [s, b, v/tp]
        return mpu.vocab_parallel_cross_entropy(logits.float(), labels).mean()


def _recompute(name):
    if name == "mpu":
        return mpu.checkpoint
    if name == "deepspeed":
        from deepspeed.runtime.activation_checkpointing import checkpointing

        return checkpointing.checkpoint
    if name == "torch":
        return lambda fn, x: torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False)
    return None


def _data(case, n_mb, gen):
    if case.kind == "lm":
        return [(torch.randint(0, V, case.input_shape, generator=gen),
                 torch.randint(0, V, (S, B), generator=gen)) for _ in range(n_mb)]
    return [(torch.randn(case.input_shape, generator=gen), None) for _ in range(n_mb)]


def _run_mode(case, data, dys, mode, autocast):
    """Backward of each micro-batch (split: B for all, then W for all); the grads."""
    case.zero_grad(set_to_none=True)
    store = mpu.set_weight_grad_deferral(case, enabled=mode in ("unsplit", "split"))
    input_grads, names, pending = [], set(), []
    for mb, ((x, labels), dy) in enumerate(zip(data, dys)):
        if x.is_floating_point():
            x = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = case(x, labels)
        names |= _graph_names(out)
        loss = out if dy is None else (out.float() * dy).sum()
        with store.record((0, mb)) if mode == "split" else contextlib.nullcontext():
            loss.backward()
        input_grads.append(x.grad)
    if mode == "split":
        pending = [store.flush((0, mb)) for mb in range(len(data))]
        store.check_flushed()
    grads = {n: p.grad for n, p in case.named_parameters()}
    return input_grads, grads, names, pending


def _compare(tag, case, ref, got, n_mb, mode, problems, notes=None):
    ref_in, ref_grads = ref[:2]
    got_in, got_grads = got[:2]
    for mb, (a, b) in enumerate(zip(ref_in, got_in)):
        if a is not None and not torch.equal(a, b):
            problems.append(f"{tag} {mode}: input grad of micro-batch {mb} differs")
    for name, a in ref_grads.items():
        b = got_grads[name]
        tied = name == "embedding.weight" and mode == "split" and n_mb > 1
        if tied:  # B and W contributions summed in another order: within 1e-6
            err = ((a - b).abs().max() / a.abs().max()).item()
            if notes is not None:
                notes.append(err)
            if err > 1e-6:
                problems.append(f"{tag} {mode}: tied {name} relative error {err:.2e}")
        elif a.dtype != b.dtype or not torch.equal(a, b):
            problems.append(f"{tag} {mode}: {name} grad differs "
                            f"(max {(a.float() - b.float()).abs().max().item():.2e})")


def _check_case(kind, sp, recompute, autocast, n_mb, seed, notes=None):
    torch.manual_seed(seed)  # the same master weights on every rank
    case = _Case(kind, sp)
    with torch.no_grad():  # non-zero biases (the bias-in-matmul path adds them)
        for name, p in case.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    case.recompute = _recompute(recompute)
    gen = torch.Generator().manual_seed(seed + 1 + dist.get_rank())
    data = _data(case, n_mb, gen)
    dys = [None] * n_mb
    if kind != "lm":
        with torch.no_grad():
            shape = case(data[0][0]).shape
        dys = [torch.randn(shape, generator=gen) for _ in range(n_mb)]
    tag = f"{kind} sp={sp} recompute={recompute} bf16={autocast} mbs={n_mb}"
    problems = []
    results = {m: _run_mode(case, data, dys, m, autocast) for m in ("plain", "unsplit", "split")}
    after = _run_mode(case, data, dys, "off-again", autocast)
    deferred = set(DEFERRED_NODES)
    if recompute is None:  # the graph behind a checkpoint is built in the backward
        plain_graph = results["plain"][2]
        if plain_graph & deferred or plain_graph != after[2]:
            problems.append(f"{tag}: deferral off changed the graph {after[2] ^ plain_graph}")
        if not results["unsplit"][2] & deferred:
            problems.append(f"{tag}: deferral on but no deferrable Function in the graph")
    linears = sum(isinstance(m, (mpu.ColumnParallelLinear, mpu.RowParallelLinear))
                  for m in case.modules()) + (kind == "lm")
    if results["split"][3] != [linears] * n_mb:
        problems.append(f"{tag}: {results['split'][3]} GEMMs deferred per micro-batch, "
                        f"expected {linears}")
    for mode in ("unsplit", "split"):
        _compare(tag, case, results["plain"], results[mode], n_mb, mode, problems, notes)
    _compare(tag, case, results["plain"], after, n_mb, "off-again", problems)
    return problems


LAYER_KINDS = ("column-gather", "column-nobias", "column-skip-bias", "row-scatter",
               "row-parallel-nobias", "row-skip-bias", "mlp", "lm")
SP_KINDS = ("column-nobias", "column-skip-bias", "row-parallel-nobias", "row-skip-bias",
            "mlp", "lm")


def _rank_layers(seed, with_sp):
    mpu.initialize_model_parallel(dist.get_world_size(), 1)
    problems, tied = [], []
    runs = [(k, False) for k in LAYER_KINDS] + ([(k, True) for k in SP_KINDS] if with_sp else [])
    for i, (kind, sp) in enumerate(runs):
        for recompute in (None, "mpu"):
            problems += _check_case(kind, sp, recompute, False, 2, seed + 10 * i, tied)
    for kind, sp in [("mlp", False), ("lm", False)] + ([("mlp", True), ("lm", True)]
                                                       if with_sp else []):
        problems += _check_case(kind, sp, None, False, 1, seed)  # the tied weight: exact
        problems += _check_case(kind, sp, None, True, 2, seed)  # bf16 autocast
        for recompute in ("deepspeed", "torch"):
            problems += _check_case(kind, sp, recompute, False, 2, seed, tied)
    return problems, tied


@pytest.mark.parametrize("tp", [1, 2])
def test_layers_bit_identical_split_and_unsplit(tp):
    """Column / Row (every mode) and the tied output layer, with and without sequence
    parallelism, recompute and bf16 autocast: plain == unsplit == split (B0 B1 W0 W1)."""
    seed = int(torch.randint(0, 2**31 - 1000, ()).item())
    for problems, tied in run_distributed(_rank_layers, tp, seed, True, timeout=600):
        assert not problems, (seed, problems)
        assert tied  # the tied weight's two-micro-batch order was measured
        print(f"tp {tp}: tied weight, 2 micro-batches, split vs plain: largest relative "
              f"difference {max(tied):.1e} ({sum(e == 0 for e in tied)}/{len(tied)} exact)")


def _recorded_in_rank_order(seed):
    """Two sequence-parallel column layers of the same shape, their backward recorded under
    one key in opposite orders on the two tp ranks (as a compiled backward may run
    independent branches); the flushed weight gradients against the undeferred ones."""
    mpu.initialize_model_parallel(dist.get_world_size(), 1)
    torch.manual_seed(seed)  # the same weights and inputs on both ranks, then their shards
    layers = nn.ModuleList(mpu.ColumnParallelLinear(H, 2 * H, gather_output=False,
                                                    sequence_parallel=True) for _ in range(2))
    rank, tp = dist.get_rank(), dist.get_world_size()
    xs = [torch.randn(S, B, H).chunk(tp)[rank].contiguous() for _ in layers]
    dys = [torch.randn(S, B, 2 * H // tp) for _ in layers]

    def backward(order):
        for i in order:
            out, _ = layers[i](xs[i])
            (out * dys[i]).sum().backward()

    backward([0, 1])  # deferral off: the reference
    ref = [layer.weight.grad.clone() for layer in layers]
    layers.zero_grad(set_to_none=True)
    store = mpu.set_weight_grad_deferral(layers)
    with store.record("mb"):
        backward([0, 1] if rank == 0 else [1, 0])
    store.flush("mb")
    return [torch.equal(a, layer.weight.grad) for a, layer in zip(ref, layers)]


def test_flush_gathers_in_the_same_order_on_every_tensor_parallel_rank():
    """A W pass gathers each sequence-parallel input over the tp group: run in recording
    order, a rank that recorded the layers in another order swaps the shards (same shapes:
    wrong gradients, silently; other shapes: a collective of mismatched sizes, the crash of
    T5 with ZB-H1 + SP + recompute under --compile). Flushed in layer order, both exact."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    for exact in run_distributed(_recorded_in_rank_order, 2, seed, timeout=300):
        assert exact == [True, True], (seed, exact)
