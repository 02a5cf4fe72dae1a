"""Hugging Face both ways for the MoE models: tiny random ``MixtralForCausalLM`` and
``SwitchTransformersForConditionalGeneration`` loaded into the Llama example / T5 at tp 1 x ep 1
and tp 2 x ep 2, and our models written out to them: logits within 1e-5 both directions."""
import torch
import torch.distributed as dist

from harness import run_distributed
from llama_runs import llama_argv  # noqa: F401 (puts examples/llama on the path)
from megatron import mpu

VOCAB, PADDED = 100, 128
LAYOUTS = [(1, 1), (2, 2)]


def _gathered_logits(logits):
    return mpu.gather_from_tensor_model_parallel_region(logits.contiguous())[..., :VOCAB]


def _whole(model):
    from megatron.checkpoint.sharding import merge_recorded, sharding_record

    st = mpu.get_parallel_state()
    mine = (st.tp_rank, st.ep_rank, st.edp_rank, model.state_dict(), sharding_record(model))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    files = {(t, 0, e): (sd, rec) for t, e, edp, sd, rec in every if edp == 0}
    return merge_recorded({k: v[0] for k, v in files.items()},
                          {k: v[1] for k, v in files.items()}, VOCAB, "test")


def _load(model, whole, tp, ep):
    from megatron.checkpoint.sharding import sharding_record, slice_recorded

    st = mpu.get_parallel_state()
    model.load_state_dict(slice_recorded(whole, sharding_record(model), tp, st.tp_rank, PADDED,
                                         "hf", ep, st.ep_rank))


# ---------------------------------------------------------------- Mixtral
def _mixtral_errors(seed):
    import dataclasses

    from transformers import MixtralForCausalLM

    import mixtral_hf
    from llama_model import LlamaConfig, LlamaModel
    from megatron.model.utils import causal_attention_mask
    from megatron.mpu import moe

    out = []
    for tp, ep in LAYOUTS:
        mpu.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
        block = moe.MoEConfig(num_experts=4, topk=2, hidden_size=32, ffn_hidden_size=32,
                              activation="swiglu", grouped_gemm=True)
        config = mixtral_hf.with_all_moe(LlamaConfig(
            num_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
            ffn_hidden_size=32, vocab_size=PADDED, true_vocab_size=VOCAB, rope_theta=5000.0,
            seed=seed), block)
        torch.manual_seed(seed)
        tokens = torch.randint(0, VOCAB, (2, 12))
        mask = causal_attention_mask(12, None)
        hf = MixtralForCausalLM(mixtral_hf.hf_config(config)).eval()
        with torch.no_grad():
            for p in hf.parameters():  # weights large enough that routing matters
                p.normal_(0.0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        model = LlamaModel(config).eval()
        _load(model, mixtral_hf.from_hf(hf.state_dict(), config), tp, ep)
        mine = LlamaModel(dataclasses.replace(config, seed=seed + 1)).eval()
        back = MixtralForCausalLM(mixtral_hf.hf_config(config)).eval()
        back.load_state_dict(mixtral_hf.to_hf(_whole(mine), config))
        with torch.no_grad():
            want = hf(tokens).logits
            out.append(((tp, ep), (_gathered_logits(model(tokens, None, mask)) - want).abs().max()
                        .item(), (_gathered_logits(mine(tokens, None, mask)) -
                                  back(tokens).logits).abs().max().item(), want.abs().max().item()))
        mpu.destroy_model_parallel()
    return out


def _both_models(seed):
    return _mixtral_errors(seed), _switch_errors(seed)


def test_mixtral_and_switch_transformers_both_ways(seed):
    """One launch for both (the ranks' transformers import is most of the time)."""
    for mixtral, switch in run_distributed(_both_models, 4, seed, timeout=400):
        for layout, into_ours, into_hf, scale in mixtral:
            assert into_ours < 1e-5 * max(1.0, scale) and into_hf < 1e-5 * max(1.0, scale), \
                ("mixtral", layout, into_ours, into_hf, scale)
        for layout, into_ours, into_hf, scale, pattern in switch:
            assert pattern == [False, True]
            assert into_ours < 1e-5 * max(1.0, scale) and into_hf < 1e-5 * max(1.0, scale), \
                ("switch", layout, into_ours, into_hf, scale)


# ---------------------------------------------------------------- Switch Transformers
def _switch_model(args, pattern, tp, ep, seed):
    from megatron.model.t5_layers import T5TransformerConfig
    from megatron.model.t5_model import T5Model
    from megatron.mpu import moe

    block = moe.MoEConfig(num_experts=args["num_experts"], topk=1, pre_softmax=True,
                          hidden_size=args["hidden_size"], ffn_hidden_size=args["ffn_hidden_size"],
                          activation="relu")
    config = T5TransformerConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"],
        num_attention_heads=args["num_attention_heads"], kv_channels=args["kv_channels"],
        ffn_hidden_size=args["ffn_hidden_size"], vocab_size=PADDED, true_vocab_size=VOCAB,
        hidden_dropout=0.0, attention_dropout=0.0, seed=seed,
        num_buckets=args["relative_attention_num_buckets"],
        max_distance=args["relative_attention_max_distance"],
        tie_embeddings=not args["untie_embeddings"], moe=block, moe_layers=tuple(pattern))
    return T5Model(config).eval()


def _switch_errors(seed):
    from transformers import (SwitchTransformersConfig,
                              SwitchTransformersForConditionalGeneration as Switch)

    from megatron.checkpoint_conversion import switch_hf, t5_hf
    from megatron.model.t5_model import t5_attention_masks

    hf_config = SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2,
        num_heads=4, num_experts=4, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
        expert_capacity=64, relative_attention_num_buckets=8,
        relative_attention_max_distance=20, dropout_rate=0.0, router_jitter_noise=0.0)
    out = []
    for tp, ep in LAYOUTS:
        mpu.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
        torch.manual_seed(seed)
        hf = Switch(hf_config).eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "layer_norm" in name:
                    p.uniform_(0.5, 1.5)
        enc, dec = torch.randint(2, VOCAB, (2, 13)), torch.randint(2, VOCAB, (2, 7))
        masks = t5_attention_masks(torch.ones_like(enc, dtype=torch.bool),
                                   torch.ones_like(dec, dtype=torch.bool))
        whole, args = switch_hf.hf_to_full(hf_config.to_dict(), hf.state_dict(), t5_hf)
        pattern = [bool(int(c)) for c in args["moe_layer_freq"].strip("[]").split(",")]
        model = _switch_model(args, pattern, tp, ep, seed)
        _load(model, whole, tp, ep)
        mine = _switch_model(args, pattern, tp, ep, seed + 1)
        config, weights = switch_hf.full_to_hf(_whole(mine), args, pattern, VOCAB, t5_hf)
        back = Switch(SwitchTransformersConfig(**config)).eval()
        missing, unexpected = back.load_state_dict(weights, strict=False)
        tied = ("embed_tokens", "lm_head")  # tied to shared.weight
        assert not unexpected and all(k.split(".")[-2] in tied for k in missing), missing
        with torch.no_grad():
            want = hf(input_ids=enc, decoder_input_ids=dec).logits
            into_ours = (_gathered_logits(model(enc, dec, *masks)) - want).abs().max().item()
            into_hf = (_gathered_logits(mine(enc, dec, *masks)) -
                       back(input_ids=enc, decoder_input_ids=dec).logits).abs().max().item()
        out.append(((tp, ep), into_ours, into_hf, want.abs().max().item(), pattern))
        mpu.destroy_model_parallel()
    return out


def test_switch_files_round_trip_through_the_t5_adapter(tmp_path, seed):
    """The T5 family's HF adapter reads and writes Switch Transformers directories (the
    conversion tool's path): the written model's logits equal the original's."""
    from transformers import (SwitchTransformersConfig,
                              SwitchTransformersForConditionalGeneration as Switch)

    from megatron.checkpoint_conversion import t5_hf

    torch.manual_seed(seed)
    config = SwitchTransformersConfig(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                                      num_decoder_layers=2, num_heads=4, num_experts=4,
                                      num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
                                      dropout_rate=0.0, router_jitter_noise=0.0)
    original = Switch(config).eval()
    original.save_pretrained(str(tmp_path / "hf"))
    ckpt = t5_hf.read_hf(str(tmp_path / "hf"))
    assert ckpt.args["num_experts"] == 4 and ckpt.args["moe_layer_freq"] == "[0,1]"
    t5_hf.write_hf(ckpt, str(tmp_path / "back"))
    back = Switch.from_pretrained(str(tmp_path / "back")).eval()
    enc, dec = torch.randint(2, VOCAB, (2, 9)), torch.randint(2, VOCAB, (2, 5))
    with torch.no_grad():
        want = original(input_ids=enc, decoder_input_ids=dec).logits
        got = back(input_ids=enc, decoder_input_ids=dec).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
