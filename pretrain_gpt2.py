"""Pretrain GPT-2: the three providers, then megatron.training.pretrain().

    torchrun --nproc_per_node 4 pretrain_gpt2.py --model-parallel-size 2 ... (see examples/)
"""
import torch

from megatron import mpu
from megatron.errors import run_main
from megatron.global_vars import get_args, get_tokenizer
from megatron.model.utils import get_ltor_masks_and_position_ids
from megatron.training import pretrain
from megatron.utils import print_rank_0


def model_provider():
    """GPT2Model, or GPT2ModelPipe when the run has pipeline stages."""
    args = get_args()
    print_rank_0("> building GPT-2 model")
    if args.pipeline_model_parallel_size > 1:
        from megatron.model.gpt2_model_pipe import GPT2ModelPipe

        model = GPT2ModelPipe.from_args(args)
        model._megatron_batch_fn = get_batch_pipe  # tds reads it on the first/last stage
        return model
    from megatron.model.gpt2_model import GPT2Model

    return GPT2Model.from_args(args)


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
    from megatron.data.gpt2_dataset import build_train_valid_test_datasets

    args = get_args()
    print_rank_0("> building GPT-2 datasets")
    return build_train_valid_test_datasets(
        data_prefix=args.data_path, splits_string=args.split,
        train_valid_test_num_samples=train_valid_test_num_samples,
        seq_length=args.seq_length, seed=args.seed)


def main(argv=None):
    return pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
                    args_defaults={"tokenizer_type": "GPT2BPETokenizer"}, argv=argv)


if __name__ == "__main__":
    run_main(main)
