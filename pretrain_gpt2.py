"""Pretrain GPT-2: the three providers, then megatron.training.pretrain().

    torchrun --nproc_per_node 4 pretrain_gpt2.py --model-parallel-size 2 ... (see examples/)
"""
import torch

from megatron import mpu
from megatron.errors import run_main
from megatron.families.gpt2 import FAMILY as GPT2
from megatron.global_vars import get_args, get_tokenizer
from megatron.model.utils import get_ltor_masks_and_position_ids
from megatron.training import pretrain
from megatron.utils import print_rank_0


def model_provider(pipeline=False):
    """GPT2Model, or GPT2ModelPipe when the training backend runs pipeline stages."""
    print_rank_0("> building GPT-2 model")
    model = GPT2.build_model(get_args(), pipeline)
    if pipeline:
        model._megatron_batch_fn = get_batch_pipe  # tds reads it on the first/last stage
    return model


def _unpack(data):
    """Broadcast tp rank 0's batch to its group; build inputs, labels and masks."""
    args, tokenizer = get_args(), get_tokenizer()
    text = mpu.broadcast_data(["text"], data, torch.int64)["text"]  # [b, s + 1]
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens, tokenizer.eod, args.eod_mask_loss)
    return tokens, labels, loss_mask, attention_mask, position_ids


def get_batch(data_iterator):
    """Read on tensor-parallel rank 0 (others pass None) and share the batch.

    Returns:
        tokens, labels, loss_mask, position_ids (``[b, s]``) and attention_mask
        (``[1, 1, s, s]``, True = masked).
    """
    return _unpack(next(data_iterator) if data_iterator is not None else None)


def get_batch_pipe(data):
    """tds batch function: raw batch -> ((tokens, position_ids, mask), (labels, loss_mask))."""
    tokens, labels, loss_mask, attention_mask, position_ids = _unpack(data)
    return (tokens, position_ids, attention_mask), (labels, loss_mask)


def forward_step(data_iterator, model):
    """Mean next-token loss over the micro-batch's unmasked tokens."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    losses = model(tokens, position_ids, attention_mask, labels=labels)  # [b, s]
    loss = (losses.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def train_valid_test_datasets_provider(train_valid_test_num_samples):
    print_rank_0("> building GPT-2 datasets")
    return GPT2.build_datasets(get_args(), get_tokenizer(), train_valid_test_num_samples)


def main(argv=None):
    return pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
                    family=GPT2, argv=argv)


if __name__ == "__main__":
    run_main(main)
