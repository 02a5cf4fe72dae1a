"""Typed calls into the compiled kernels (CPU or CUDA module: same functions, same arguments).

The C++ side takes raw pointers and sizes, so everything it relies on is checked and
arranged here: dtypes, shapes, contiguity, 16-byte alignment (the CUDA kernels use 16-byte
vector loads), the device and its current stream. Outputs are allocated here with torch, so
they come from the caching allocator. Callers decide eligibility first (see
megatron/model/fused_softmax.py and fused_layer_norm.py); these functions assume it.
"""
import contextlib

import torch

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _ready(t):
    """Contiguous and 16-byte aligned (a copy only for an odd view, which is rare)."""
    t = t.contiguous()
    if t.data_ptr() % 16:
        t = t.clone()
    return t


def _ptr(t):
    return 0 if t is None else t.data_ptr()


def _stream(t):
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def _on_device(t):
    """Launch on ``t``'s GPU even when another one is current (a no-op on CPU)."""
    if t.is_cuda and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def softmax_mask_bytes(mask, b, sq, sk):
    """``mask`` as contiguous bytes ``[1 or b, 1, sq, sk]`` (True/nonzero = masked out).

    Args:
        mask: bool or uint8, shape ``[1 or b, 1, sq, sk]`` (a batch dim expanded with stride 0
            is read once).
        b, sq, sk: batch, query and key lengths of the scores.
    """
    if mask.dim() != 4 or mask.shape[1] != 1 or tuple(mask.shape[2:]) != (sq, sk):
        raise ValueError(f"mask must be [b or 1, 1, {sq}, {sk}], got {tuple(mask.shape)}")
    if mask.shape[0] not in (1, b):
        raise ValueError(f"mask batch {mask.shape[0]} is neither 1 nor {b}")
    if mask.dtype not in (torch.bool, torch.uint8):
        raise ValueError(f"mask must be bool or uint8, got {mask.dtype}")
    if mask.shape[0] > 1 and mask.stride(0) == 0:
        mask = mask[:1]
    return _ready(mask)


def softmax_forward(module, x, mask, scale, causal):
    """Scaled, masked softmax over the last dim of ``x`` [b, np, sq, sk].

    Args:
        module: compiled kernels for ``x.device``.
        x: scores (fp32/bf16 on CPU, fp16/bf16 on CUDA).
        mask: None or bool ``[1 or b, 1, sq, sk]``, True = masked (score becomes -10000).
        scale: multiplies the scores before masking.
        causal: exclude keys ``j > i + sk - sq`` (probability exactly 0).

    Returns:
        ``(probs, dead)``: probabilities in ``x.dtype``, and None or bool ``[b*np*sq]``
        marking rows the mask hides entirely (input of :func:`softmax_backward`).
    """
    b, np_, sq, sk = x.shape
    x = _ready(x)
    y = torch.empty_like(x)
    dead, stride = None, 0
    if mask is not None:
        mask = softmax_mask_bytes(mask, b, sq, sk)
        stride = 0 if mask.shape[0] == 1 else sq * sk
        dead = torch.empty(b * np_ * sq, dtype=torch.bool, device=x.device)
    if x.numel():
        with _on_device(x):
            module.softmax_forward(x.data_ptr(), _ptr(mask), y.data_ptr(), _ptr(dead), b, np_,
                                   sq, sk, stride, float(scale), bool(causal),
                                   DTYPE_CODES[x.dtype], _stream(x))
    return y, dead


def softmax_backward(module, grad, probs, dead, scale, causal):
    """Gradient of :func:`softmax_forward` w.r.t. its scores.

    Args:
        module: compiled kernels for ``grad.device``.
        grad: dL/dprobs, shape and dtype of ``probs``.
        probs, dead: the outputs of the forward.
        scale, causal: as in the forward.
    """
    b, np_, sq, sk = probs.shape
    grad = _ready(grad.to(probs.dtype))
    dx = torch.empty_like(probs)
    if probs.numel():
        with _on_device(probs):
            module.softmax_backward(grad.data_ptr(), probs.data_ptr(), _ptr(dead), dx.data_ptr(),
                                    b, np_, sq, sk, float(scale), bool(causal),
                                    DTYPE_CODES[probs.dtype], _stream(probs))
    return dx


def norm_forward(module, x, weight, bias, eps, rms):
    """LayerNorm (``rms=False``) or RMSNorm over the last ``weight.numel()`` elements.

    Args:
        module: compiled kernels for ``x.device``.
        x: activations ``[..., hidden]``; the output has its dtype.
        weight, bias: ``[hidden]`` parameters (fp32 or ``x.dtype``); bias None for RMSNorm.
        eps: added to the variance (mean square for RMSNorm).
        rms: RMSNorm instead of LayerNorm.

    Returns:
        ``(y, mean, rstd)``; mean is None for RMSNorm; statistics fp32 ``[rows]``.
    """
    hidden = weight.numel()
    rows = x.numel() // hidden if hidden else 0
    x = _ready(x)
    # No detach: callers run below autograd (an autograd function's forward or backward, or
    # an operator's kernel), and each extra op is host time (a dispatch) on every call.
    w = _ready(weight.float())
    b = None if bias is None else _ready(bias.float())
    y = torch.empty_like(x)
    stats = dict(dtype=torch.float32, device=x.device)
    mean = None if rms else torch.empty(rows, **stats)
    rstd = torch.empty(rows, **stats)
    if rows:
        with _on_device(x):
            module.norm_forward(x.data_ptr(), w.data_ptr(), _ptr(b), y.data_ptr(), _ptr(mean),
                                rstd.data_ptr(), rows, hidden, float(eps), bool(rms),
                                DTYPE_CODES[x.dtype], _stream(x))
    return y, mean, rstd


def norm_backward(module, grad, x, weight, mean, rstd, has_bias, rms):
    """Gradients of :func:`norm_forward`: ``(dx, dweight, dbias or None)``.

    Args:
        module: compiled kernels for ``x.device``.
        grad: dL/dy, shape of ``x``.
        x, weight: the forward's inputs.
        mean, rstd: the forward's statistics.
        has_bias: whether to compute dbias.
        rms: RMSNorm instead of LayerNorm.
    """
    hidden = weight.numel()
    rows = x.numel() // hidden if hidden else 0
    grad = _ready(grad.to(x.dtype))
    x = _ready(x)
    w = _ready(weight.float())
    dx = torch.empty_like(x)
    stats = dict(dtype=torch.float32, device=x.device)
    alloc = torch.empty if rows else torch.zeros  # the kernels write every column
    dw = alloc(hidden, **stats)
    db = alloc(hidden, **stats) if has_bias else None
    if rows:
        with _on_device(x):
            code = DTYPE_CODES[x.dtype]
            blocks = module.norm_backward_blocks(rows, hidden, code)
            work = torch.empty(blocks * 2 * hidden, **stats) if blocks else None
            module.norm_backward(grad.data_ptr(), x.data_ptr(), w.data_ptr(), _ptr(mean),
                                 rstd.data_ptr(), dx.data_ptr(), dw.data_ptr(), _ptr(db),
                                 _ptr(work), blocks, rows, hidden, bool(rms), code, _stream(x))
    dw = dw.to(weight.dtype).view_as(weight)
    db = None if db is None else db.to(weight.dtype).view_as(weight)
    return dx, dw, db
