"""Building blocks of any decoder-only language model (GPT-2's, and a new model's:
docs/new_model.md): the batch function, the datasets, and the pipeline stage contract of a
decoder whose stages pass ``(hidden, attention_mask)``."""
from typing import Any, Callable, Optional, Sequence, Tuple

import torch

from .. import mpu
from ..config.run_config import RunConfig
from ..model.utils import get_ltor_masks_and_position_ids
from .base import uses_token_layout


def make_batch_fn(cfg: RunConfig, tokenizer: Any) -> Callable[[Any], Tuple[tuple, tuple]]:
    """``raw -> ((tokens, position_ids, attention_mask), (labels, loss_mask))``.

    Tensor-parallel rank 0 reads (the others pass None) and shares the ``[b, s + 1]`` text
    with its group (sizes from the configuration, so no shape travels); the causal mask
    (``[1, 1, s, s]``, True = masked), the loss mask and the
    positions are built on the device. Under context parallelism or document masking
    (:func:`uses_token_layout`) the mask slot holds the token layout instead, and every
    tensor holds this context-parallel rank's two chunks of the sequence
    (``[b, s / cp]``; the ranks of a context-parallel group read the same samples).
    """
    eod, eod_mask_loss = tokenizer.eod, cfg.data.eod_mask_loss
    # sizes fixed by the configuration: the broadcast needs no shape header (no host sync)
    shapes = [(cfg.batch.micro_batch_size, cfg.batch.seq_length + 1)]
    layout = uses_token_layout(cfg)

    def batch(data):
        text = mpu.broadcast_data(["text"], data, torch.int64, shapes=shapes)["text"]
        # text: [b, s + 1]
        tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
        if layout:
            return _layout_batch(cfg, tokens, labels, eod, eod_mask_loss)
        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens, eod, eod_mask_loss)
        return (tokens, position_ids, attention_mask), (labels, loss_mask)

    return batch


def _layout_batch(cfg: RunConfig, tokens, labels, eod, eod_mask_loss):
    """The batch with the token layout, cut to this rank's chunks: ``tokens, position_ids,
    labels, loss_mask [b, s / cp]``, layout ``[1 or 2, b, s / cp]``."""
    b, s = tokens.shape
    data = cfg.data
    starts = mpu.document_starts(tokens, eod) \
        if data.reset_attention_mask or data.reset_position_ids else None
    position_ids = torch.arange(s, device=tokens.device).expand(b, s)
    if data.reset_position_ids:
        position_ids = position_ids - starts
    loss_mask = torch.ones(b, s, dtype=torch.float, device=tokens.device)
    if eod_mask_loss:
        loss_mask.masked_fill_(tokens == eod, 0.0)
    layout = mpu.token_layout(position_ids, starts if data.reset_attention_mask else None)
    tokens, position_ids, labels, loss_mask = (
        mpu.split_for_context_parallel(t, 1) for t in (tokens, position_ids, labels, loss_mask))
    return (tokens, position_ids, mpu.split_for_context_parallel(layout, 2)), (labels, loss_mask)


def build_datasets(cfg: RunConfig, tokenizer: Any, num_samples: Sequence[int]
                   ) -> Tuple[Optional[Any], Optional[Any], Optional[Any]]:
    """Train/valid/test GPT-2 datasets (None for an empty split)."""
    from ..data.gpt2_dataset import build_train_valid_test_datasets

    return build_train_valid_test_datasets(
        data_prefix=cfg.data.data_path, splits_string=cfg.data.split,
        train_valid_test_num_samples=num_samples, seq_length=cfg.batch.seq_length,
        seed=cfg.model.seed)


def set_decoder_contract(model: Any, sequence_parallel: bool, token_layout: bool = False) -> Any:
    """Declare tds's stage contract of a decoder passing ``(hidden [s, b, h] float,
    attention_mask [1, 1, s, s] bool)``: only the hidden state carries a gradient, and it
    is split across tensor-parallel ranks on the wire unless sequence parallelism already
    made it the rank's ``[s/tp, b, h]`` shard.

    Args:
        model: the ``PipelineModule`` (its attributes are set; it is returned).
        sequence_parallel: the run's ``--sequence-parallel``.
        token_layout: the mask slot carries the int token layout ``[1 or 2, b, s / cp]``
            (:func:`uses_token_layout`) instead of the bool mask.
    """
    model._input_type = ["float", "int" if token_layout else "bool"]
    model._input_grad = [True, False]
    model._input_pipe_partitioned = [not sequence_parallel, False]
    return model
