"""Sequence parallelism saves the *sharded* input of the column-parallel layers (QKV, fc1,
the LM head) and all-gathers it again in the backward (megatron/mpu/sequence_parallel_linear.py).

- Bytes saved for the backward by one GPT-2 layer (saved-tensor hooks, each storage once,
  parameters and the attention mask excluded) against Korthikanti et al. 2022's
  ``s b h (34 / t + 5 a s / (h t))`` (eager attention with dropout) and the selective-
  recompute figure ``34 s b h / t`` (SDPA), scaled to the element sizes used: in fp32 on
  the CPU every activation and every dropout mask is 4 bytes, so 34 = 16 x 2 + 2 x 1
  becomes 16 x 4 + 2 x 4 and 5 = 2 x 2 + 1 becomes 2 x 4 + 4.
- Loss and gradients of two layers and the LM head with SP equal those without SP (same tp,
  same weights, dropout 0) within 1e-6 in fp32, and within bf16 rounding under autocast.
"""
import pytest
import torch
import torch.distributed as dist

from harness import run_distributed
from megatron import mpu

TOL = 1e-6
S, B, H, HEADS, V = 64, 2, 128, 4, 256


def _config(sp, backend, dropout, layers=1):
    from megatron.model.transformer import TransformerConfig

    return TransformerConfig(num_layers=layers, hidden_size=H, num_attention_heads=HEADS,
                             kv_channels=H // HEADS, ffn_hidden_size=4 * H,
                             hidden_dropout=dropout, attention_dropout=dropout if
                             backend == "unfused" else 0.0, sequence_parallel=sp,
                             attention_backend=backend)


def _layer_saved_bytes(backend, seed):
    """Bytes one SP layer saves for its backward on this rank."""
    from megatron.model.transformer import ParallelTransformerLayer
    from megatron.model.utils import causal_attention_mask

    layer = ParallelTransformerLayer(_config(True, backend, 0.1), 1)
    hidden = torch.randn(S, B, H, generator=torch.Generator().manual_seed(seed))
    hidden = mpu.scatter_to_sequence_parallel_region(hidden).detach().requires_grad_()
    mask = causal_attention_mask(S, hidden.device)
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    skip.add(mask.untyped_storage().data_ptr())
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(hidden, mask)
    out.sum().backward()  # the graph is usable: the shards gather again
    return sum(seen.values())


def _stack_loss_and_grads(sp, seed):
    """Two layers, the final LN and the LM head's loss; (loss, {name: grad}, input grad)."""
    from megatron.model.language_model import parallel_lm_logits
    from megatron.model.transformer import ParallelTransformer
    from megatron.model.utils import causal_attention_mask

    torch.manual_seed(seed)  # the same master weights in both runs
    stack = ParallelTransformer(_config(sp, "sdpa", 0.0, layers=2))
    gen = torch.Generator().manual_seed(seed + 1)
    emb = torch.randn(V, H, generator=gen)  # [v, h]
    labels = torch.randint(0, V, (S, B), generator=gen)
    full = torch.randn(S, B, H, generator=gen)
    tp, rank = dist.get_world_size(), dist.get_rank()
    rows = V // tp
    weight = emb[rank * rows:(rank + 1) * rows].clone().requires_grad_()  # [v/tp, h]
    hidden = (full.chunk(tp)[rank] if sp else full).clone().requires_grad_()
    out = stack(hidden, causal_attention_mask(S, hidden.device))
    logits = parallel_lm_logits(out, weight, True, sequence_parallel=sp)  # [s, b, v/tp]
    loss = mpu.vocab_parallel_cross_entropy(logits, labels).mean()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in stack.named_parameters()}
    grads["lm_head"] = weight.grad
    grad_in = hidden.grad  # SP: this rank's [s/tp, b, h]
    return loss.detach(), grads, grad_in


def _rank(seed):
    mpu.initialize_model_parallel(dist.get_world_size(), 1)
    mpu.model_parallel_cuda_manual_seed(seed)
    tp, rank = dist.get_world_size(), dist.get_rank()
    saved = {b: _layer_saved_bytes(b, seed) for b in ("unfused", "sdpa")}
    loss0, grads0, gin0 = _stack_loss_and_grads(False, seed)
    loss1, grads1, gin1 = _stack_loss_and_grads(True, seed)
    errs = {"loss": (loss0 - loss1).abs().item(),
            "input grad": (gin0.chunk(tp)[rank] - gin1).abs().max().item()}
    for name, g in grads0.items():
        errs[name] = (g - grads1[name]).abs().max().item()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the autocast branch: casts outside
        bf0, bgrads0, _ = _stack_loss_and_grads(False, seed)
        bf1, bgrads1, _ = _stack_loss_and_grads(True, seed)
    bf16 = {"loss": abs(bf0.item() / bf1.item() - 1)}
    for name, g in bgrads0.items():  # fp32 weights get fp32 gradients in both runs
        assert g.dtype == bgrads1[name].dtype == torch.float32, name
        bf16[name] = ((g - bgrads1[name]).norm() / g.norm()).item()
    return saved, errs, loss0.item(), bf16


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_layer_saves_korthikanti_bytes_and_matches_no_sp(tp):
    seed = int(torch.randint(0, 2**31, ()).item())
    sbh = S * B * H
    e = m = 4  # fp32 activations; the CPU's dropout masks are the tensor's dtype
    eager = sbh * ((16 * e + 2 * m) / tp + HEADS * S / H * (2 * e + m) / tp)
    selective = sbh * (16 * e + 2 * m) / tp
    for saved, errs, loss, bf16 in run_distributed(_rank, tp, seed):
        for measured, expected in ((saved["unfused"], eager), (saved["sdpa"], selective)):
            print(f"tp {tp}: measured / Korthikanti {measured / expected:.4f}")
            assert abs(measured / expected - 1) < 0.05, (seed, tp, saved, eager, selective)
        assert loss > 1.0  # a real loss (log 256 ~ 5.5), not a degenerate one
        assert max(errs.values()) < TOL, (seed, errs)
        # bf16 autocast: the same within bf16 rounding (2^-8 relative per op)
        print(f"tp {tp}: bf16 autocast, largest relative difference {max(bf16.values()):.4f}")
        assert max(bf16.values()) < 0.05, (seed, bf16)
