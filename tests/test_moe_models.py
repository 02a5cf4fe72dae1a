"""GPT-2 MoE, T5 as the Switch Transformer and the Llama example as Mixtral, built at ep 2
(dp 4) and at tp 2 x ep 2 (dp 2), against the same model built serially from the same seed:
each rank's loss on its samples, and every gradient after the reduction the training step
does (dense parameters: mean over dp x cp; expert parameters: sum over the expert-data-
parallel group / (dp x cp)), sliced as the rank holds it (expert dim 0, tp dim and stride).
No training step runs: the model code, the groups and the expert dispatch are what is tested.
"""
import os
import sys

import torch
import torch.distributed as dist

from harness import run_distributed
from megatron import mpu
from megatron.mpu import moe

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples", "llama"))
V, S, B = 128, 8, 2  # vocabulary, tokens, samples per rank


def _moe(activation, topk, **kw):
    return moe.MoEConfig(num_experts=4, topk=topk, hidden_size=32, ffn_hidden_size=32,
                         aux_loss_coeff=0.01, z_loss_coeff=0.001, activation=activation,
                         init_method_std=0.05, **kw)


def _gpt2():
    from megatron.model.gpt2_model import GPT2Model
    from megatron.model.transformer import TransformerConfig

    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, kv_channels=8,
                               ffn_hidden_size=64, hidden_dropout=0.0, attention_dropout=0.0,
                               moe=_moe("gelu", 2, shared_expert_intermediate_size=16),
                               moe_layers=(True, False))
    return GPT2Model(config, V, S)


def _t5():
    from megatron.model.t5_layers import T5TransformerConfig
    from megatron.model.t5_model import T5Model

    config = T5TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                 kv_channels=8, ffn_hidden_size=64, vocab_size=V,
                                 hidden_dropout=0.0, attention_dropout=0.0,
                                 moe=_moe("relu", 1, pre_softmax=True), moe_layers=(False, True))
    return T5Model(config)


def _mixtral():
    from llama_model import LlamaConfig, LlamaModel

    config = LlamaConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                         num_key_value_heads=2, ffn_hidden_size=32, vocab_size=V,
                         moe=_moe("swiglu", 2, grouped_gemm=True), moe_layers=(True, True))
    return LlamaModel(config)


def _loss(name, model, ids):
    from megatron.model.language_model import masked_lm_loss
    from megatron.model.utils import causal_attention_mask

    labels = (ids.roll(-1, 1), torch.ones(ids.shape, dtype=torch.float32))
    mask = causal_attention_mask(ids.shape[1], ids.device)
    if name == "gpt2":
        pos = torch.arange(ids.shape[1])[None].expand_as(ids)
        return model(ids, pos, mask, labels=labels[0]).mean()
    if name == "mixtral":
        return masked_lm_loss(model(ids, None, mask), labels)
    from megatron.model.t5_model import t5_attention_masks

    real = torch.ones(ids.shape, dtype=torch.bool)
    masks = t5_attention_masks(real, real)
    return model(ids, ids.flip(1), *masks, labels=labels[0]).mean()


BUILD = {"gpt2": _gpt2, "t5": _t5, "mixtral": _mixtral}


def _expected_slice(param, full):
    if moe.is_expert_parameter(param):
        per = full.shape[0] // mpu.get_expert_model_parallel_world_size()
        first = mpu.get_expert_model_parallel_rank() * per
        full = full[first:first + per]
    if getattr(param, "tensor_model_parallel", False):
        tp, r = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
        chunks = torch.chunk(full, tp * param.partition_stride, dim=param.partition_dim)
        full = torch.cat(chunks[r::tp], dim=param.partition_dim)
    return full


def _compare(name, tp, ep, seed):
    world = dist.get_world_size()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V - 8, (world // tp, B, S), generator=gen)  # per data-parallel rank
    mpu.initialize_model_parallel(1, 1)
    torch.manual_seed(seed)
    serial = BUILD[name]()
    moe.set_aux_loss_scale(tp / world)  # the mean of the shards: the step's 1 / gas
    try:
        shard_losses = [_loss(name, serial, ids[d]) for d in range(world // tp)]
        (sum(shard_losses) / len(shard_losses)).backward()
    finally:
        moe.set_aux_loss_scale(1.0)
    mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    st = mpu.get_parallel_state()
    torch.manual_seed(seed)
    model = BUILD[name]()
    loss = _loss(name, model, ids[st.dp_rank])
    loss.backward()
    worst = {"loss": abs(loss.item() - shard_losses[st.dp_rank].item())}
    full = dict(serial.named_parameters())
    for pname, param in model.named_parameters():
        group = st.edp_group if moe.is_expert_parameter(param) else st.dp_cp_group
        grad = param.grad.clone()
        dist.all_reduce(grad, group=group)
        grad /= st.dp_size * st.cp_size
        want = _expected_slice(param, full[pname].grad)
        assert want.shape == grad.shape, (pname, want.shape, grad.shape)
        same_weight = (param.detach() - _expected_slice(param, full[pname].detach())).abs().max()
        worst[pname] = max(float((grad - want).abs().max()), float(same_weight))
    mpu.destroy_model_parallel()
    return worst


def _all_models(layouts, seed):
    return [(name, tp, ep, _compare(name, tp, ep, seed + i))
            for i, (name, tp, ep) in enumerate(layouts)]


def test_models_at_ep2_and_tp2_ep2_equal_serial(seed):
    layouts = [("gpt2", 1, 2), ("t5", 2, 2), ("mixtral", 2, 2), ("gpt2", 2, 2), ("t5", 1, 4)]
    for per_rank in run_distributed(_all_models, 4, layouts, seed, timeout=300):
        for name, tp, ep, worst in per_rank:
            bad = {k: v for k, v in worst.items() if v > 2e-6}
            assert not bad, (name, tp, ep, bad)
