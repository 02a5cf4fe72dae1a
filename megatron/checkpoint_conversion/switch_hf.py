"""Hugging Face Switch Transformers (``SwitchTransformersForConditionalGeneration``) <-> the
T5 family with MoE layers: whole state dicts and args, both ways.

Everything but the feed-forward maps as T5 does (:mod:`.t5_hf`). HF's sparse layers are
layers ``i`` with ``i % sparse_step == 1`` (every layer at step 1), ours those
``--moe-layer-freq`` lists (written here as a 0/1 list); HF's ``router.classifier`` is our
``mlp.router.weight``, its ``experts.expert_{e}.wi`` / ``wo`` stack into
``mlp.experts.weight1 [E, f, h]`` / ``weight2 [E, h, f]``; its dense layers' ``mlp.wi`` /
``wo`` are our ``mlp.dense_h_to_ff`` / ``dense_ff_to_h``. The router is top-1 over a softmax
of all experts (``--moe-router-topk 1 --moe-router-pre-softmax``). HF's ``expert_capacity``
counts tokens per sequence, ours is a factor per rank: the conversion is dropless (HF's
capacity is written large enough for any sequence: compare logits where nothing drops).

The functions take the T5 converter (``t5``: :mod:`.t5_hf`, which calls them for a Switch
directory) for everything but the feed-forward.
"""
import torch

from ..checkpoint import t5_keys
from ..common.errors import CheckpointError

#: HF's capacity written for a dropless model (tokens per sequence per expert).
DROPLESS_CAPACITY = 2 ** 20


def _pattern(step, layers):
    return [bool(step > 0 and (i % step == 1 or step == 1)) for i in range(layers)]


def _step(config, stack):
    """HF's sparse step of a stack: ``layers // num_sparse_<stack>_layers`` (what its config
    computes), or the saved ``<stack>_sparse_step``."""
    layers = config["num_layers"] if stack == "encoder" else \
        config.get("num_decoder_layers") or config["num_layers"]
    sparse = config.get(f"num_sparse_{stack}_layers")
    if sparse is None:
        return config.get(f"{stack}_sparse_step", 1)
    return layers // sparse if sparse > 0 else layers


def hf_args(config: dict, t5) -> dict:
    """``(native args with the MoE flags, MoE layer pattern)`` of an HF ``config.json``."""
    if config.get("model_type") != "switch_transformers":
        raise CheckpointError(f"not a Switch Transformers config: {config.get('model_type')!r}")
    act = config.get("dense_act_fn", "relu")
    if act != "relu":
        raise CheckpointError(f"dense_act_fn {act!r}: the Switch experts here are ReLU")
    layers = config["num_layers"]
    steps = (_step(config, "encoder"), _step(config, "decoder"))
    if _pattern(steps[0], layers) != _pattern(steps[1], layers):
        raise CheckpointError(f"encoder and decoder sparse steps differ {steps}: "
                              f"--moe-layer-freq applies to both stacks")
    pattern = _pattern(steps[0], layers)
    args = t5.hf_args({**config, "feed_forward_proj": "relu"})
    args.update({"num_experts": config["num_experts"], "moe_router_topk": 1,
                 "moe_router_pre_softmax": True,
                 "moe_aux_loss_coeff": config.get("router_aux_loss_coef", 0.0),
                 "moe_z_loss_coeff": config.get("router_z_loss_coef", 0.0),
                 "moe_layer_freq": "[" + ",".join(str(int(p)) for p in pattern) + "]",
                 "moe_ffn_hidden_size": config["d_ff"], "moe_expert_capacity_factor": None})
    return args, pattern


def hf_to_full(config: dict, weights: dict, t5):
    """``(whole state dict in our names, real vocabulary rows; args)``."""
    args, pattern = hf_args(config, t5)
    shared = weights["shared.weight"].float()
    state = {t5_keys.WORD_EMBEDDINGS: shared}
    e = config["num_experts"]
    for stack in t5_keys.STACKS:
        bias = f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
        state[f"{stack}.relative_bias.weight"] = weights[bias]
        ff_index = 2 if stack == "decoder" else 1
        for i in range(args["num_layers"]):
            ours = f"{stack}.layers.{i}."
            for key, tensor in t5._hf_layer(weights, stack, i, "relu", args["kv_channels"],
                                            mlp=False).items():
                state[ours + key] = tensor
            mlp = f"{stack}.block.{i}.layer.{ff_index}.mlp."
            if pattern[i]:
                state[ours + "mlp.router.weight"] = weights[mlp + "router.classifier.weight"]
                for n, part in (("1", "wi"), ("2", "wo")):
                    state[ours + f"mlp.experts.weight{n}"] = torch.stack(
                        [weights[f"{mlp}experts.expert_{x}.{part}.weight"] for x in range(e)])
            else:
                state[ours + "mlp.dense_h_to_ff.weight"] = weights[mlp + "wi.weight"]
                state[ours + "mlp.dense_ff_to_h.weight"] = weights[mlp + "wo.weight"]
        state[f"{stack}.final_layernorm.weight"] = weights[f"{stack}.final_layer_norm.weight"]
    if args["untie_embeddings"]:
        state[t5_keys.LM_HEAD] = weights.get("lm_head.weight", shared)
    return {k: v.float().contiguous() for k, v in state.items()}, args


def full_to_hf(state: dict, args: dict, pattern, vocab_size: int, t5, pad_id=0, eos_id=1):
    """``(config dict, HF weights)`` of our whole T5 + MoE state dict.

    Args:
        state: whole tensors (our names).
        args: the model's args (T5's, plus ``num_experts`` and the MoE flags).
        pattern: per layer of each stack, whether it is an MoE layer (HF's rule must hold:
            layer i is sparse when ``i % step == 1``, or every layer).
        vocab_size: the real vocabulary rows.
        t5: the T5 converter (:mod:`.t5_hf`).
        pad_id, eos_id: the tokenizer's.
    """
    layers = args["num_layers"]
    step = next((s for s in (1, *range(2, layers + 2)) if _pattern(s, layers) == list(pattern)),
                None)
    if step is not None and layers // max(sum(pattern), 1) != step:
        step = None  # HF derives the step from the count of sparse layers
    if step is None:
        raise CheckpointError(f"MoE layers {list(pattern)} do not follow Switch Transformers' "
                              f"rule (layer i sparse when i % step == 1): HF cannot hold them")
    config, weights = t5.full_to_hf(_dense_stand_ins(state, pattern, layers), args,
                                    vocab_size, pad_id, eos_id)
    weights = {k: v for k, v in weights.items() if "DenseReluDense" not in k}
    for stack in t5_keys.STACKS:
        ff_index = 2 if stack == "decoder" else 1
        for i in range(layers):
            ours, mlp = f"{stack}.layers.{i}.", f"{stack}.block.{i}.layer.{ff_index}.mlp."
            if pattern[i]:
                weights[mlp + "router.classifier.weight"] = state[ours + "mlp.router.weight"]
                for n, part in (("1", "wi"), ("2", "wo")):
                    for x, tensor in enumerate(state[ours + f"mlp.experts.weight{n}"]):
                        weights[f"{mlp}experts.expert_{x}.{part}.weight"] = tensor.contiguous()
            else:
                weights[mlp + "wi.weight"] = state[ours + "mlp.dense_h_to_ff.weight"]
                weights[mlp + "wo.weight"] = state[ours + "mlp.dense_ff_to_h.weight"]
    config.update({"architectures": ["SwitchTransformersForConditionalGeneration"],
                   "model_type": "switch_transformers", "num_experts": args["num_experts"],
                   "expert_capacity": DROPLESS_CAPACITY, "encoder_sparse_step": step,
                   "decoder_sparse_step": step, "dense_act_fn": "relu",
                   "router_z_loss_coef": args.get("moe_z_loss_coeff") or 0.0,
                   "router_aux_loss_coef": args.get("moe_aux_loss_coeff") or 0.0,
                   "router_jitter_noise": 0.0, "router_dtype": "float32",
                   "num_sparse_encoder_layers": sum(pattern),
                   "num_sparse_decoder_layers": sum(pattern)})
    config.pop("feed_forward_proj", None)
    return config, weights


def _dense_stand_ins(state, pattern, layers):
    """T5's converter wants a dense MLP in every layer: zeros where the layer is MoE (the
    tensors it makes from them are dropped)."""
    out = dict(state)
    h = state[t5_keys.WORD_EMBEDDINGS].shape[1]
    for stack in t5_keys.STACKS:
        for i in range(layers):
            if pattern[i]:
                out[f"{stack}.layers.{i}.mlp.dense_h_to_ff.weight"] = torch.zeros(1, h)
                out[f"{stack}.layers.{i}.mlp.dense_ff_to_h.weight"] = torch.zeros(h, 1)
    return out
