"""Test helpers: a small random Hugging Face T5 (the reference) and T5Model runs in ranks.

transformers is a test-only reference: models are built from a T5Config with random
weights and saved with save_pretrained (nothing is downloaded).
"""
import torch

VOCAB = 300  # pads to 384 at tp=1 and 512 at tp=2 (--make-vocab-size-divisible-by 128)
SIZES = dict(d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4,
             relative_attention_num_buckets=8, relative_attention_max_distance=20)


def make_hf_t5(path, seed, v1_1=False, vocab_size=VOCAB):
    """Save a random ``T5ForConditionalGeneration`` to ``path``; returns it reloaded (eval).

    v1.0: ReLU, output tied to the embedding and scaled by d_model^-0.5. v1.1: gated-GeLU and
    an lm_head with its own random weights, unscaled. Norm weights are random too, so a
    wrong mapping cannot hide behind unit norms; short bucket distances make the log-spaced
    buckets matter at these lengths.
    """
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=vocab_size, dropout_rate=0.0, pad_token_id=0, eos_token_id=1,
                      decoder_start_token_id=0,
                      feed_forward_proj="gated-gelu" if v1_1 else "relu",
                      tie_word_embeddings=not v1_1, **SIZES)
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(config)
    with torch.no_grad():
        if v1_1:  # HF >= 5 ties lm_head to shared unless the saved values differ
            model.lm_head.weight = torch.nn.Parameter(torch.randn(vocab_size, SIZES["d_model"]))
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(str(path))
    return T5ForConditionalGeneration.from_pretrained(str(path)).eval()


def random_batch(seed, b=3, se=17, sd=9, vocab=VOCAB):
    """Ids, real-token lengths and bool masks (True = masked) with padding in every stack."""
    g = torch.Generator().manual_seed(seed)
    enc = torch.randint(2, vocab, (b, se), generator=g)
    dec = torch.randint(2, vocab, (b, sd), generator=g)
    dec[:, 0] = 0  # decoder start = pad, as in T5
    enc_len = torch.randint(se // 3, se + 1, (b,), generator=g)
    enc_len[0] = se
    dec_len = torch.randint(sd // 3, sd + 1, (b,), generator=g)
    dec_len[0] = sd
    er = torch.arange(se)[None] < enc_len[:, None]  # [b, se] real
    dr = torch.arange(sd)[None] < dec_len[:, None]  # [b, sd] real
    causal = torch.ones(sd, sd, dtype=torch.bool).tril()
    masks = (~(er[:, None, :, None] & er[:, None, None, :]),
             ~(causal & dr[:, None, :, None] & dr[:, None, None, :]),
             ~(dr[:, None, :, None] & er[:, None, None, :]))
    return {"enc": enc, "dec": dec, "enc_real": er, "dec_real": dr, "masks": masks}


def hf_logits(model, batch):
    """``[b, sd, vocab]`` logits of the HF model (HF masks keys only; rows past a sequence's
    end are not compared)."""
    with torch.no_grad():
        return model(input_ids=batch["enc"], attention_mask=batch["enc_real"].long(),
                      decoder_input_ids=batch["dec"],
                      decoder_attention_mask=batch["dec_real"].long()).logits


def native_logits(ckpt_dir, batch):
    """Rank body: load ``ckpt_dir`` (native or HF) at this group's tp; gathered logits
    ``[b, sd, v_pad]`` as NumPy (tensors from ranks can vanish with the rank process)."""
    import torch.distributed as dist

    from megatron import mpu
    from megatron.generation.inference import load_t5_for_inference

    mpu.initialize_model_parallel(dist.get_world_size(), 1)
    mpu.model_parallel_cuda_manual_seed(1)
    model, _ = load_t5_for_inference(ckpt_dir)
    with torch.no_grad():
        return model(batch["enc"], batch["dec"], *batch["masks"]).numpy()


def native_generate(source, enc, enc_real, max_new_tokens):
    """Rank body: greedy ids with the KV cache and with full recompute, as NumPy."""
    import torch.distributed as dist

    from megatron import mpu
    from megatron.generation.inference import load_t5_for_inference
    from megatron.generation.t5_generation import greedy_generate

    mpu.initialize_model_parallel(dist.get_world_size(), 1)
    mpu.model_parallel_cuda_manual_seed(1)
    model, args = load_t5_for_inference(source)
    kwargs = dict(eos_id=1, pad_id=0, vocab_size=args["true_vocab_size"])
    cached = greedy_generate(model, enc, enc_real, max_new_tokens, **kwargs)
    full = greedy_generate(model, enc, enc_real, max_new_tokens, use_cache=False, **kwargs)
    return cached.numpy(), full.numpy()


def load_into_pipe(ckpt_dir):
    """Rank body (tp x pp ranks): build T5ModelPipe at the checkpoint's layout and load this
    rank's converted file strictly; returns the loaded keys."""
    import torch.distributed as dist

    from megatron import mpu
    from megatron.checkpoint.format import load_rank_file, rank_files
    from megatron.families import get_family
    from megatron.checkpoint.format import iteration_dir
    from megatron.model.t5_model_pipe import T5ModelPipe
    from tds.pipe import PipeModelDataParallelTopology

    import tds

    files = rank_files(iteration_dir(ckpt_dir, 0))
    args = load_rank_file(files[(0, 0)])["args"]
    tp, pp = args["tensor_model_parallel_size"], args["pipeline_model_parallel_size"]
    assert dist.get_world_size() == tp * pp
    tds.init_distributed(dist_backend="gloo")
    mpu.initialize_model_parallel(tp, pp)
    mpu.model_parallel_cuda_manual_seed(1)
    model = T5ModelPipe(get_family("t5").config_from_saved(args),
                        PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=1))
    state = load_rank_file(files[(mpu.get_tensor_model_parallel_rank(),
                                  mpu.get_pipeline_model_parallel_rank())])["model"]
    model.load_state_dict(state, strict=True)
    return sorted(state)
