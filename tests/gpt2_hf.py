"""Test helpers: a small random Hugging Face GPT-2 (the reference), and GPT2Model logits in ranks.

transformers is a test-only reference: models are built from a GPT2Config with random
weights and saved with save_pretrained (nothing is downloaded).
"""
import torch

#: Small enough to run in seconds, with a vocabulary that needs padding at tp=1 and tp=2.
HF_SIZES = dict(n_layer=2, n_embd=64, n_head=4, n_positions=48)


def make_hf_gpt2(path, seed, vocab_size=300, eos=None, **sizes):
    """Save a random ``GPT2LMHeadModel`` to ``path``; returns the model (eval, fp32).

    Every tensor is random (biases and LayerNorms too), so a wrong mapping cannot hide
    behind zero biases or unit norms.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    eos = vocab_size - 1 if eos is None else eos
    config = GPT2Config(vocab_size=vocab_size, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                        **{**HF_SIZES, **sizes})
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or \
                    name.endswith("ln_f.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.1)
    model.save_pretrained(str(path))
    return model


def hf_logits(model, ids):
    """``[b, s, vocab]`` logits of the HF model."""
    with torch.no_grad():
        return model(input_ids=ids).logits


def native_logits(ckpt_dir, ids):
    """Rank body: load ``ckpt_dir`` at this group's tp; ``[b, s, v_pad]`` gathered logits.

    Returned as NumPy (by value): a tensor sent from a rank is a shared-memory handle that
    can vanish with the rank process.
    """
    import torch.distributed as dist

    from megatron import mpu
    from megatron.generation.inference import load_gpt2_for_inference
    from megatron.model.utils import causal_attention_mask

    mpu.initialize_model_parallel(dist.get_world_size(), 1)
    mpu.model_parallel_cuda_manual_seed(1)
    model, _ = load_gpt2_for_inference(ckpt_dir)
    b, s = ids.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    with torch.no_grad():
        return model(ids, positions, causal_attention_mask(s, ids.device)).numpy()
