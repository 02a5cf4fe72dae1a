"""Rank bodies for the Llama example's tests (examples/llama/llama_model.py)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples", "llama"))


def llama_argv(data, tp, pp, *extra, vpp=1, steps=8, micro=2, global_batch=8):
    """Flags for a dropout-free 4-layer Llama run at (tp, pp, v) (dp = what is left)."""
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
            "--num-key-value-heads", "2", "--ffn-hidden-size", "48", "--seq-length", "32",
            "--max-position-embeddings", "32", "--data-path", data["prefix"],
            "--vocab-file", data["vocab"], "--merge-file", data["merges"],
            "--split", "98,2,0", "--make-vocab-size-divisible-by", "64", "--lr", "5e-3",
            "--min-lr", "5e-4", "--warmup", "2", "--log-interval", "4",
            "--eval-interval", "1000", "--eval-iters", "1", "--seed", "1234",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            *(["--virtual-pipeline-model-parallel-size", str(vpp)] if vpp > 1 else []),
            "--micro-batch-size", str(micro), "--global-batch-size", str(global_batch),
            "--train-iters", str(steps), *extra]


def train_llama(argv, family=None):
    """Rank body: pretrain the example (or ``family``); return the per-step losses."""
    from llama_model import LLAMA
    from megatron.training import pretrain

    return pretrain(family=family or LLAMA, argv=argv).losses


def _gather_full(model, true_vocab):
    """Whole tensors of a tensor-parallel model (every rank's shards, by their record)."""
    import torch.distributed as dist

    from megatron import mpu
    from megatron.checkpoint.sharding import merge_recorded, sharding_record

    mine = (model.state_dict(), sharding_record(model))
    every = [None] * mpu.get_tensor_model_parallel_world_size()
    dist.all_gather_object(every, mine, group=mpu.get_tensor_model_parallel_group())
    return merge_recorded({(t, 0): sd for t, (sd, _) in enumerate(every)},
                          {(t, 0): rec for t, (_, rec) in enumerate(every)}, true_vocab, "model")


def hf_logit_errors(seed):
    """Rank body (2 ranks): ``{tp: errors}`` for tp 1 and 2 (:func:`_hf_errors_at`)."""
    from megatron import mpu

    out = {}
    for tp in (1, 2):
        out[tp] = _hf_errors_at(tp, seed)
        mpu.destroy_model_parallel()
    return out


def _hf_errors_at(tp, seed):
    """Largest |logit| difference (ours vs transformers' LlamaForCausalLM) with HF's random
    weights loaded into ours at ``tp``, and with ours written out to HF; the logits' scale."""
    import dataclasses

    import torch
    from transformers import LlamaForCausalLM

    from llama_model import (LlamaConfig, LlamaModel, from_hf, generate_greedy, hf_config,
                             to_hf)
    from megatron import mpu
    from megatron.checkpoint.sharding import sharding_record, slice_recorded
    from megatron.model.utils import causal_attention_mask

    mpu.initialize_model_parallel(tp, 1)
    vocab = 100
    config = LlamaConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                         num_key_value_heads=2, ffn_hidden_size=48, vocab_size=128,
                         true_vocab_size=vocab, rope_theta=5000.0, seed=seed)
    torch.manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, 16))

    def ours(model, text=tokens):
        mask = causal_attention_mask(text.shape[1], text.device)
        logits = model(text, None, mask)  # [b, s, v/tp]
        return mpu.gather_from_tensor_model_parallel_region(logits.contiguous())[..., :vocab]

    hf = LlamaForCausalLM(hf_config(config)).eval()  # the same random weights on each rank
    model = LlamaModel(config).eval()
    model.load_state_dict(slice_recorded(from_hf(hf.state_dict(), config),
                                         sharding_record(model), tp,
                                         mpu.get_tensor_model_parallel_rank(), 128, "hf"))
    with torch.no_grad():
        into_ours = (ours(model) - hf(tokens).logits).abs().max().item()
        mine = LlamaModel(dataclasses.replace(config, seed=seed + 1)).eval()  # ours, fresh
        back = LlamaForCausalLM(hf_config(config)).eval()
        back.load_state_dict(to_hf(_gather_full(mine, vocab), config))
        into_hf = (ours(mine) - back(tokens).logits).abs().max().item()
        scale = hf(tokens).logits.abs().max().item()
        prompt = tokens[:, :6]
        # no end-of-text token: LlamaConfig's default (id 2) would be barred from the first
        # min_new_tokens by generate() while our greedy loop may pick it
        hf.generation_config.eos_token_id = None
        theirs = hf.generate(prompt, max_new_tokens=8, do_sample=False)
        same_text = _same_greedy_text(generate_greedy(model, prompt, 8), theirs,
                                      lambda text: ours(model, text))
    return into_ours, into_hf, scale, same_text


def _same_greedy_text(mine, theirs, logits_of, tie=1e-4):
    """Greedy texts agree: equal, or they part where the two choices are a tie (random
    weights give near-equal top logits now and then; the logits agree to 1e-5, so argmax
    may fall either way there). Anything else (a wrong rotary, a wrong cache) parts with a
    clear margin."""
    import torch

    if torch.equal(mine, theirs):
        return True
    row, col = (mine != theirs).nonzero()[0].tolist()  # the first token where they part
    logits = logits_of(theirs[row:row + 1, :col])[0, -1]  # [v]: after the common text
    return abs(logits[mine[row, col]] - logits[theirs[row, col]]).item() < tie


def compile_counts(seed):
    """Rank body: layers ``compile_layers`` compiles in the example's serial model (its
    family's classes), and dynamo's graphs / breaks for one of them."""
    import torch

    from llama_model import LLAMA, LlamaConfig, LlamaModel
    from megatron import mpu
    from megatron.model.compile import compile_layers
    from megatron.model.utils import causal_attention_mask

    mpu.initialize_model_parallel(1, 1)
    config = LlamaConfig(num_layers=3, hidden_size=32, num_attention_heads=4,
                         num_key_value_heads=2, ffn_hidden_size=48, vocab_size=64, seed=seed)
    model = LlamaModel(config)
    compiled = compile_layers(model, LLAMA.compile_classes, backend="eager")
    layer = getattr(model, "1")
    hidden = torch.randn(16, 2, 32, requires_grad=True)  # [s, b, h]
    torch._dynamo.reset()
    result = torch._dynamo.explain(layer._orig_mod if hasattr(layer, "_orig_mod") else
                                   layer.forward)((hidden, causal_attention_mask(16, None)))
    return compiled, result.graph_count, result.graph_break_count
