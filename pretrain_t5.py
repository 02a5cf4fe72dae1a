"""Pretrain T5 (span corruption): the three providers, then megatron.training.pretrain().

    torchrun --nproc_per_node 4 pretrain_t5.py --model-parallel-size 2 \\
        --enc-seq-length 512 --dec-seq-length 128 ... (see examples/run_t5.sh)

Works at every layout: T5Model without pipeline stages (``--pipe-parallel-size 1``),
T5ModelPipe through tds's pipeline engine otherwise. T5 flags: megatron/families/t5.py.
"""
import torch

from megatron import mpu
from megatron.errors import run_main
from megatron.families.t5 import FAMILY as T5
from megatron.global_vars import get_args, get_tokenizer
from megatron.model.t5_model import t5_attention_masks
from megatron.training import pretrain
from megatron.utils import print_rank_0

BATCH_KEYS = ("text_enc", "text_dec", "labels", "loss_mask", "enc_real")


def model_provider(pipeline=False):
    """T5Model, or T5ModelPipe when the training backend runs pipeline stages."""
    print_rank_0("> building T5 model")
    model = T5.build_model(get_args(), pipeline)
    if pipeline:
        model._megatron_batch_fn = get_batch_pipe  # tds reads it on the first/last stage
    return model


def _unpack(data):
    """Broadcast tp rank 0's batch to its group (one int64 broadcast of ``[b, s]`` tensors)
    and build the attention masks on the device."""
    batch = mpu.broadcast_data(list(BATCH_KEYS), data, torch.int64)
    masks = t5_attention_masks(batch["enc_real"].bool(), batch["loss_mask"].bool())
    return (batch["text_enc"], batch["text_dec"], batch["labels"],
            batch["loss_mask"].float(), *masks)


def get_batch(data_iterator):
    """Read on tensor-parallel rank 0 (others pass None) and share the batch.

    Returns:
        enc_ids ``[b, se]``, dec_ids, labels, loss_mask (float) ``[b, sd]``, and the bool
        masks enc ``[b, 1, se, se]``, dec ``[b, 1, sd, sd]``, cross ``[b, 1, sd, se]``.
    """
    return _unpack(next(data_iterator) if data_iterator is not None else None)


def get_batch_pipe(data):
    """tds batch function: raw batch -> ((ids and masks), (labels, loss_mask))."""
    enc, dec, labels, loss_mask, enc_mask, dec_mask, cross_mask = _unpack(data)
    return (enc, dec, enc_mask, dec_mask, cross_mask), (labels, loss_mask)


def forward_step(data_iterator, model):
    """Mean loss over the micro-batch's real label tokens."""
    enc, dec, labels, loss_mask, enc_mask, dec_mask, cross_mask = get_batch(data_iterator)
    losses = model(enc, dec, enc_mask, dec_mask, cross_mask, labels=labels)  # [b, sd]
    loss = (losses.float() * loss_mask).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach()}


def train_valid_test_datasets_provider(train_valid_test_num_samples):
    print_rank_0("> building T5 datasets")
    return T5.build_datasets(get_args(), get_tokenizer(), train_valid_test_num_samples)


def main(argv=None):
    return pretrain(train_valid_test_datasets_provider, model_provider, forward_step,
                    family=T5, argv=argv)


if __name__ == "__main__":
    run_main(main)
