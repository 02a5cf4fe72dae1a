"""Attention backends: ``scaled_dot_product_attention`` (default) or Megatron's bmm + softmax.

``--attention-backend`` takes Megatron-LM's spellings and maps them onto the two
implementations this project has (docs/training.md):

========================  =====================================================
``auto`` (default),        ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention``;
``flash``, ``fused``,      PyTorch picks the flash / cuDNN / memory-efficient kernel on
``sdpa``                   a GPU and its fused CPU kernel on the CPU
``unfused``, ``local``     ``unfused``: two ``bmm`` + :class:`FusedScaleMaskSoftmax`
                           (Megatron's "local" attention, the fused masked-softmax kernel)
========================  =====================================================

``--use-flash-attn`` (Megatron-LM's older flag) selects ``sdpa``.

Both compute the same function (tests/test_attention_backends.py): masked entries take
no probability; the GPT-2 causal triangle is applied by ``is_causal`` (no mask tensor is
built, so the flash kernel is eligible); T5's relative position bias and padding mask
become one additive float mask whose masked entries are the dtype's lowest value (a row
with every entry masked comes out uniform, as Megatron's -10000 fill gives) and whose
gradient reaches the bias.

With an fp16 mask tensor on CUDA (T5's bias and padding, a padded or cached GPT-2) SDPA may
not pick cuDNN's kernel (:data:`MASKED_SDPA_BACKENDS`): on an H100 (torch 2.11, cuDNN's
default-on-Hopper attention) T5's fp16 run got non-finite gradients at every step from the
second on, at every loss scale, and trained with cuDNN off and nothing else changed
(tests/gpu_probe_t5_fp16.py; pytorch/pytorch#196678 describes cuDNN's masked backward
writing NaN into dQ). bf16 and fp32 calls keep every kernel: bf16 T5 trained with cuDNN
on the H100 before that change (issue 38). The causal GPT-2 path passes no mask.

Which kernel a masked call can get depends on the mask's layout: the memory-efficient and
cuDNN kernels need its last dimension contiguous (stride 1) and its dtype the queries'.
T5's relative position bias is built contiguous ``[1, np, sq, sk]``, and :func:`fold_mask`
folds it with the padding mask once per stack (not once per layer) into one contiguous
additive mask every layer passes on as is (tests/test_attention_backends.py checks the
layout and the kernels asked for, per call and dtype).

At tensor-parallel size > 1 attention dropout runs inside the model-parallel RNG tracker on
both paths, so the ranks (which hold different heads) draw their own masks; the tracker is
forked only where a mask is drawn (p > 0, training). At tp = 1 no other rank holds heads and
the default stream serves, with no fork: ``torch.compile`` cannot trace the fork's
``torch.get_rng_state`` (docs/training.md, "Compiling").
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import mpu
from ..common.errors import ConfigError
from .fused_softmax import causal_exclusion

#: Megatron-LM's ``--attention-backend`` choices (and ours) -> the implementation used.
ATTENTION_BACKENDS = {"auto": "sdpa", "flash": "sdpa", "fused": "sdpa", "sdpa": "sdpa",
                      "unfused": "unfused", "local": "unfused"}
DEFAULT_ATTENTION_BACKEND = "sdpa"
#: The SDPA kernels allowed with a mask tensor on CUDA: all but cuDNN's (module docstring).
MASKED_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                        SDPBackend.MATH)


def resolve_attention_backend(name):
    """The implementation (``sdpa`` / ``unfused``) a backend spelling selects.

    Args:
        name: an ``--attention-backend`` choice (see :data:`ATTENTION_BACKENDS`), or None
            for the default.

    Raises:
        ConfigError: an unknown name.
    """
    if name is None:
        return DEFAULT_ATTENTION_BACKEND
    try:
        return ATTENTION_BACKENDS[name]
    except KeyError:
        raise ConfigError(f"unknown attention backend {name!r}; choose one of "
                          f"{', '.join(sorted(ATTENTION_BACKENDS))}") from None


def to_heads_first(x):
    """``[s, b, np, hn]`` -> ``[b, np, s, hn]`` (a view: SDPA takes strided inputs)."""
    return x.permute(1, 2, 0, 3)


def from_heads_first(context):
    """``[b, np, sq, hn]`` -> ``[sq, b, np * hn]``."""
    b, np_, sq, hn = context.shape
    return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)


def additive_mask(mask, bias, dtype, causal=False, shape=None):
    """One float mask for SDPA: ``bias`` (or 0) where attended, the dtype's lowest value
    where ``mask`` (or the bottom-right causal triangle) excludes the entry.

    ``torch.where`` keeps the bias's gradient on attended entries and gives masked ones
    none, as Megatron's fill after adding the bias does.

    Args:
        mask: bool ``[b or 1, 1, sq, sk]``, True = masked, or None.
        bias: float ``[1 or b, np, sq, sk]`` added to the scores, or None.
        dtype: the queries' dtype (SDPA wants the mask in it).
        causal: also exclude keys ``j > i + sk - sq``.
        shape: ``(sq, sk)``, needed for ``causal``.
    """
    if mask is not None and mask.is_floating_point():  # already additive (fold_mask)
        return mask.to(dtype) if bias is None else mask.to(dtype) + bias.to(dtype)
    excluded = mask
    if causal:
        triangle = causal_exclusion(*shape, device=mask.device if mask is not None
                                    else bias.device)[None, None]
        excluded = triangle if excluded is None else excluded | triangle
    if bias is None:
        base = torch.zeros((), dtype=dtype, device=excluded.device)
    else:
        base = bias.to(dtype)
    if excluded is None:
        return base
    return torch.where(excluded, torch.finfo(dtype).min, base)


def fold_mask(mask, bias, dtype):
    """A bool mask and an additive bias as one contiguous additive mask in ``dtype`` (what
    SDPA takes): built once and shared by every layer that attends with them.

    Args:
        mask: bool ``[b or 1, 1, sq, sk]``, True = masked, or None.
        bias: float ``[1 or b, np, sq, sk]`` (contiguous), or None.
        dtype: the queries' dtype (the autocast dtype under autocast).

    Returns:
        ``[b or 1, np or 1, sq, sk]`` float, the dtype's lowest value where masked; None
        when both are None.
    """
    if mask is None and bias is None:
        return None
    return additive_mask(mask, bias, dtype).contiguous()


def attention_dtype(hidden):
    """The dtype attention runs in for a hidden state: the autocast dtype when autocast is
    on for its device, else its own."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def sdpa_attention(q, k, v, *, scale, dropout_p, causal=False, mask=None, bias=None,
                   per_rank_dropout=True):
    """Multi-head attention through ``scaled_dot_product_attention``, ``[s, b, np, hn]`` in.

    Args:
        q: ``[sq, b, np, hn]`` queries; k, v: ``[sk, b, np, hn]``.
        scale: multiplies ``q k^T`` (GPT-2: 1/sqrt(hn); T5: 1).
        dropout_p: attention dropout (0 in eval).
        causal: GPT-2's triangle, aligned bottom right when ``sq < sk`` (a KV cache).
        mask: bool ``[b or 1, 1, sq, sk]`` True = masked, on top of ``causal``; a float
            mask is additive already (:func:`fold_mask`); or None.
        bias: float ``[1 or b, np, sq, sk]`` added to the scores (T5), or None.
        per_rank_dropout: draw the dropout from the model-parallel RNG stream (heads split
            across tensor-parallel ranks); False: from the default generator.

    Returns:
        Context ``[sq, b, np * hn]``.
    """
    sq, sk = q.shape[0], k.shape[0]
    attn_mask, is_causal = None, False
    if mask is None and bias is None and causal and sq == sk:
        is_causal = True  # no mask tensor: the flash kernel applies
    elif mask is not None or bias is not None or (causal and sq > 1):
        # sq == 1 with a causal cache sees every key: no mask at all
        attn_mask = additive_mask(mask, bias, q.dtype, causal=causal and sq > 1,
                                  shape=(sq, sk))
    args = (to_heads_first(q), to_heads_first(k), to_heads_first(v))
    kwargs = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale)
    if dropout_p > 0 and per_rank_dropout:  # a graph break when compiled: only where needed
        context = mpu.in_model_parallel_stream(_sdpa, *args, **kwargs)
    else:
        context = _sdpa(*args, **kwargs)
    return from_heads_first(context)  # [sq, b, np * hn]


def sdpa_backends_for(device_type, has_mask, dtype):
    """The SDPA kernels a call may use: None (PyTorch's choice among all), or
    :data:`MASKED_SDPA_BACKENDS` for an fp16 call with a mask tensor on CUDA."""
    return MASKED_SDPA_BACKENDS if has_mask and device_type == "cuda" and \
        dtype == torch.float16 else None


def _sdpa(q, k, v, **kwargs):
    backends = sdpa_backends_for(q.device.type, kwargs["attn_mask"] is not None, q.dtype)
    if backends is None:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with sdpa_kernel(list(backends)):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def bmm_attention(q, k, v, scale_mask_softmax, dropout, mask=None, bias=None,
                  per_rank_dropout=True):
    """Megatron's path: ``bmm``, scale + mask + softmax (fused kernel), dropout, ``bmm``.

    Args:
        q: ``[sq, b, np, hn]``; k, v: ``[sk, b, np, hn]``.
        scale_mask_softmax: a :class:`FusedScaleMaskSoftmax` (scale and mask type).
        dropout: the attention-dropout module.
        mask: bool ``[b or 1, 1, sq, sk]`` True = masked, or None.
        bias: float ``[1 or b, np, sq, sk]`` added to the scores before the mask, or None.
        per_rank_dropout: draw the dropout from the model-parallel RNG stream (heads split
            across tensor-parallel ranks); False: from the default generator.

    Returns:
        Context ``[sq, b, np * hn]``.
    """
    sq, b, np_, hn = q.shape
    sk = k.shape[0]
    q = q.reshape(sq, b * np_, hn).transpose(0, 1)  # [b*np, sq, hn]
    k = k.reshape(sk, b * np_, hn).transpose(0, 1)  # [b*np, sk, hn]
    v = v.reshape(sk, b * np_, hn).transpose(0, 1)  # [b*np, sk, hn]
    scores = torch.bmm(q, k.transpose(1, 2)).view(b, np_, sq, sk)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    probs = scale_mask_softmax(scores, mask)  # [b, np, sq, sk]
    probs = mpu.model_parallel_dropout(dropout, probs, per_rank_dropout)
    context = torch.bmm(probs.view(b * np_, sq, sk), v)  # [b*np, sq, hn]
    return context.view(b, np_, sq, hn).permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)
