"""Vocabulary padding is invisible to the numbers.

- GPT-2 losses (2 SGD steps, fp32, dropout 0) at tp 1, 2, 4 with a vocabulary of 8000 and
  ``--make-vocab-size-divisible-by`` 1 and 128 (8000, 8064, 8192 rows) agree to 1e-6
  relative, although the padded rows hold large random weights that differ per layout;
  without the model knowing its true vocabulary they do not (so the check can fail).
- Converted HF GPT-2 and HF T5: the loss equals transformers' loss to 1e-5 relative, at
  tp 1 and 2 (the vocabulary of 300 is padded to 384 / 512).
"""
import pytest
import torch

from gpt2_hf import make_hf_gpt2
from harness import run_distributed
from t5_hf import VOCAB as VOCAB_T5
from t5_hf import make_hf_t5, random_batch

VOCAB = 8000
HIDDEN = 32


def _gpt2_losses(seed, masked, tps=(1, 2, 4)):
    """Rank body: {(tp, divisible_by): [loss per step]} for every layout of ``tps``."""
    from megatron import mpu
    from megatron.model.gpt2_model import GPT2Model
    from megatron.model.transformer import TransformerConfig
    from megatron.model.utils import causal_attention_mask
    from megatron.tokenizer import vocab_size_with_padding

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 17), generator=g)
    inputs, labels = ids[:, :-1], ids[:, 1:]
    positions = torch.arange(16)[None].expand(2, 16)
    mask = causal_attention_mask(16, inputs.device)
    out = {}
    for tp in tps:
        mpu.initialize_model_parallel(tp, 1)
        mpu.model_parallel_cuda_manual_seed(seed)
        for divisible_by in (1, 128):
            padded = vocab_size_with_padding(VOCAB, divisible_by, tp)
            config = TransformerConfig(num_layers=2, hidden_size=HIDDEN, num_attention_heads=4,
                                       kv_channels=8, ffn_hidden_size=64, hidden_dropout=0.0,
                                       attention_dropout=0.0, seed=seed,
                                       true_vocab_size=VOCAB if masked else None)
            model = GPT2Model(config, padded, 16)
            weight = model.word_embeddings_weight()  # [padded / tp, h]
            start = model.embedding.word_embeddings.vocab_start_index
            # Large random padded rows, different in every layout (the real rows come from
            # the model's own layout-invariant initialisation).
            rows = torch.arange(start, start + weight.shape[0]) >= VOCAB
            with torch.no_grad():
                weight[rows] = 3.0 * torch.randn(int(rows.sum()), HIDDEN)
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            losses = []
            for _ in range(2):
                loss = model(inputs, positions, mask, labels).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            out[(tp, divisible_by)] = losses
        mpu.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_gpt2_loss_does_not_depend_on_tp_or_padding(seed):
    per_rank = run_distributed(_gpt2_losses, 4, seed, True, timeout=300)
    reference = torch.tensor(per_rank[0][(1, 1)])  # no padding at all
    for rank_out in per_rank:
        for layout, losses in rank_out.items():
            rel = ((torch.tensor(losses) - reference).abs() / reference).max().item()
            assert rel < 1e-6, (layout, losses, reference.tolist())


def test_without_the_true_vocab_the_padding_changes_the_loss(seed):
    """The control: the layouts above only agree because the padded logits are masked."""
    out = run_distributed(_gpt2_losses, 1, seed, False, (1,), timeout=300)[0]
    out = {layout: losses[0] for layout, losses in out.items()}
    assert abs(out[(1, 128)] - out[(1, 1)]) / out[(1, 1)] > 1e-3, out


def _native_gpt2_loss(ckpt_dir, ids):
    import torch.distributed as dist

    from megatron import mpu
    from megatron.generation.inference import load_gpt2_for_inference
    from megatron.model.utils import causal_attention_mask

    mpu.initialize_model_parallel(dist.get_world_size(), 1)
    mpu.model_parallel_cuda_manual_seed(1)
    model, _ = load_gpt2_for_inference(ckpt_dir)
    b, s = ids.shape[0], ids.shape[1] - 1
    positions = torch.arange(s)[None].expand(b, s)
    with torch.no_grad():
        return model(ids[:, :-1], positions, causal_attention_mask(s, ids.device),
                     ids[:, 1:]).mean().item()


@pytest.mark.parametrize("tp", [1, 2])
def test_converted_hf_gpt2_loss_equals_transformers(tmp_path, seed, tp):
    from megatron.checkpoint_conversion import ConversionRequest, run_conversion

    model = make_hf_gpt2(tmp_path / "hf", seed, 300)
    run_conversion(ConversionRequest(str(tmp_path / "hf"), str(tmp_path / "native"), tp=tp))
    ids = torch.randint(0, 300, (3, 21), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids).loss.item()
    for loss in run_distributed(_native_gpt2_loss, tp, str(tmp_path / "native"), ids):
        assert abs(loss - expected) / expected < 1e-5, (loss, expected)


def _native_t5_loss(ckpt_dir, batch, labels):
    import torch.distributed as dist

    from megatron import mpu
    from megatron.generation.inference import load_t5_for_inference

    mpu.initialize_model_parallel(dist.get_world_size(), 1)
    mpu.model_parallel_cuda_manual_seed(1)
    model, _ = load_t5_for_inference(ckpt_dir)
    with torch.no_grad():
        losses = model(batch["enc"], batch["dec"], *batch["masks"], labels=labels)  # [b, sd]
    return losses.mean().item()


@pytest.mark.parametrize("tp", [1, 2])
def test_converted_hf_t5_loss_equals_transformers(tmp_path, seed, tp):
    from megatron.checkpoint_conversion.t5_convert import T5ConversionRequest, run_t5_conversion

    model = make_hf_t5(tmp_path / "hf", seed)
    run_t5_conversion(T5ConversionRequest(str(tmp_path / "hf"), str(tmp_path / "native"), tp=tp))
    # Full-length sequences (no padding): HF's loss then averages every decoder position.
    batch = random_batch(seed, b=2, se=12, sd=7)
    batch["masks"] = _full_masks(batch["enc"].shape[1], batch["dec"].shape[1])
    labels = torch.randint(2, VOCAB_T5, batch["dec"].shape,
                           generator=torch.Generator().manual_seed(seed + 1))
    with torch.no_grad():
        expected = model(input_ids=batch["enc"], decoder_input_ids=batch["dec"],
                         labels=labels).loss.item()
    for loss in run_distributed(_native_t5_loss, tp, str(tmp_path / "native"), batch, labels):
        assert abs(loss - expected) / expected < 1e-5, (loss, expected)


def _full_masks(se, sd):
    """Masks (True = masked) with every token real: none in the encoder, causal decoder."""
    causal = torch.ones(sd, sd, dtype=torch.bool).triu(1)
    return (torch.zeros(1, 1, se, se, dtype=torch.bool), causal[None, None],
            torch.zeros(1, 1, sd, se, dtype=torch.bool))
