"""Building blocks of any decoder-only language model (GPT-2's, and a new model's:
docs/new_model.md): the batch function, the datasets, and the pipeline stage contract of a
decoder whose stages pass ``(hidden, attention_mask)``."""
from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from .. import mpu
from ..model.utils import get_ltor_masks_and_position_ids


def make_batch_fn(cfg: Any, tokenizer: Any) -> Callable[[Any], Tuple[tuple, tuple]]:
    """``raw -> ((tokens, position_ids, attention_mask), (labels, loss_mask))``.

    Tensor-parallel rank 0 reads (the others pass None) and shares the ``[b, s + 1]`` text
    with its group (sizes from the configuration, so no shape travels); the causal mask
    (``[1, 1, s, s]``, True = masked), the loss mask and the
    positions are built on the device.
    """
    eod, eod_mask_loss = tokenizer.eod, cfg.data.eod_mask_loss
    # sizes fixed by the configuration: the broadcast needs no shape header (no host sync)
    shapes = [(cfg.batch.micro_batch_size, cfg.batch.seq_length + 1)]

    def batch(data):
        text = mpu.broadcast_data(["text"], data, torch.int64, shapes=shapes)["text"]
        # text: [b, s + 1]
        tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens, eod, eod_mask_loss)
        return (tokens, position_ids, attention_mask), (labels, loss_mask)

    return batch


def build_datasets(cfg: Any, tokenizer: Any, num_samples: Sequence[int]
                   ) -> Tuple[Optional[Any], Optional[Any], Optional[Any]]:
    """Train/valid/test GPT-2 datasets (None for an empty split)."""
    from ..data.gpt2_dataset import build_train_valid_test_datasets

    return build_train_valid_test_datasets(
        data_prefix=cfg.data.data_path, splits_string=cfg.data.split,
        train_valid_test_num_samples=num_samples, seq_length=cfg.batch.seq_length,
        seed=cfg.model.seed)


def set_decoder_contract(model: Any, sequence_parallel: bool) -> Any:
    """Declare tds's stage contract of a decoder passing ``(hidden [s, b, h] float,
    attention_mask [1, 1, s, s] bool)``: only the hidden state carries a gradient, and it
    is split across tensor-parallel ranks on the wire unless sequence parallelism already
    made it the rank's ``[s/tp, b, h]`` shard.

    Args:
        model: the ``PipelineModule`` (its attributes are set; it is returned).
        sequence_parallel: the run's ``--sequence-parallel``.
    """
    model._input_type = ["float", "bool"]
    model._input_grad = [True, False]
    model._input_pipe_partitioned = [not sequence_parallel, False]
    return model
