"""--sequence-parallel: the mapping functions against plain tensor ops, the activation bytes
saved for backward (measured with saved-tensor hooks), a clear error for a bad length.
End-to-end layout equivalence lives in test_sequence_parallel_training.py.
"""
import pytest
import torch
import torch.distributed as dist

from harness import run_distributed
from megatron import mpu

TOL = 1e-6


def _mappings(seed):
    """Forward and backward of the three sequence-parallel maps on fresh random tensors."""
    mpu.initialize_model_parallel(dist.get_world_size(), 1)
    tp, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(seed)
    s, b, h = 4 * tp, 3, 5
    # Every rank draws every rank's tensors, so each can build the reference alone.
    full = [torch.randn(s, b, h, generator=gen) for _ in range(tp)]  # per-rank inputs
    grad = [torch.randn(s, b, h, generator=gen) for _ in range(tp)]
    part = s // tp
    mine = slice(rank * part, (rank + 1) * part)
    errs = {}

    x = full[0].clone().requires_grad_()  # the same replicated input on every rank
    y = mpu.scatter_to_sequence_parallel_region(x)
    y.backward(grad[rank][mine])
    errs["scatter fwd"] = (y - full[0][mine]).abs().max().item()
    errs["scatter bwd"] = (x.grad - torch.cat([g[r * part:(r + 1) * part]
                                               for r, g in enumerate(grad)])).abs().max().item()

    x = full[rank][mine].clone().requires_grad_()
    y = mpu.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True)
    y.backward(grad[rank])
    errs["gather fwd"] = (y - torch.cat([f[r * part:(r + 1) * part]
                                         for r, f in enumerate(full)])).abs().max().item()
    errs["gather bwd"] = (x.grad - sum(grad)[mine]).abs().max().item()  # reduce-scatter

    x = full[rank].clone().requires_grad_()
    y = mpu.reduce_scatter_to_sequence_parallel_region(x)
    y.backward(grad[rank][mine])
    errs["reduce-scatter fwd"] = (y - sum(full)[mine]).abs().max().item()
    expected = torch.cat([g[r * part:(r + 1) * part] for r, g in enumerate(grad)])
    errs["reduce-scatter bwd"] = (x.grad - expected).abs().max().item()

    w = torch.randn(h, generator=gen).requires_grad_()
    (mpu.sequence_parallel_param(w) * grad[rank][0, 0]).sum().backward()
    errs["param grad all-reduce"] = (w.grad - sum(g[0, 0] for g in grad)).abs().max().item()
    return errs


@pytest.mark.parametrize("tp", [2, 4])
def test_mappings_match_plain_tensor_ops(tp):
    seed = int(torch.randint(0, 2**31, ()).item())
    for errs in run_distributed(_mappings, tp, seed):
        assert max(errs.values()) < TOL, (seed, errs)


def _saved_bytes(sequence_parallel, seed):
    """Activation bytes saved for backward inside the LayerNorm and dropout modules of one
    GPT-2 block (parameters excluded), on this rank."""
    from megatron.model.transformer import ParallelTransformerLayer, TransformerConfig
    from megatron.model.utils import causal_attention_mask

    mpu.initialize_model_parallel(dist.get_world_size(), 1)
    mpu.model_parallel_cuda_manual_seed(seed)  # the tracker stream the sharded dropout uses
    tp = dist.get_world_size()
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4,
                               kv_channels=16, ffn_hidden_size=256, hidden_dropout=0.1,
                               attention_dropout=0.1, sequence_parallel=sequence_parallel)
    layer = ParallelTransformerLayer(config, 1)
    s, b = 64, 2
    hidden = torch.randn(s, b, 64, generator=torch.Generator().manual_seed(seed))
    if sequence_parallel:
        hidden = mpu.scatter_to_sequence_parallel_region(hidden)
    hidden.requires_grad_()
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    counted, depth = {}, [0]

    def enter(*_):
        depth[0] += 1

    def leave(*_):
        depth[0] -= 1

    regions = [layer.input_layernorm, layer.post_attention_layernorm, layer.hidden_dropout]
    for module in regions:
        module.register_forward_pre_hook(enter)
        module.register_forward_hook(leave)

    def pack(t):
        # Whole storages, each once: a shard that is a view of the full tensor saves nothing.
        storage = t.untyped_storage()
        if depth[0] and storage.data_ptr() not in params:
            counted[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(hidden, causal_attention_mask(s, hidden.device))
    out.sum().backward()  # the graph is usable
    return sum(counted.values()), tp


@pytest.mark.parametrize("tp", [2, 4])
def test_layernorm_and_dropout_saved_bytes_fall_by_tp(tp):
    seed = int(torch.randint(0, 2**31, ()).item())
    plain = run_distributed(_saved_bytes, tp, False, seed)
    sharded = run_distributed(_saved_bytes, tp, True, seed)
    for (off, _), (on, _) in zip(plain, sharded):
        assert off > 0 and on * tp == off, (tp, off, on)


def test_length_not_divisible_by_tp_is_a_clear_error(gpt2_data):
    from gpt2_runs import gpt2_argv, run_script

    argv = ["pretrain_gpt2.py", *gpt2_argv(gpt2_data, "--model-parallel-size", "4",
                                           "--sequence-parallel", "--batch-size", "2",
                                           "--train-iters", "1", seq=30)]
    result = run_script(argv, nproc=4)
    assert result.returncode != 0
    assert "--seq-length (30) is not divisible by 4" in result.stderr + result.stdout
