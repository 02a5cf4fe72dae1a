"""AdamW with the fastest implementation torch has for where the parameters live.

On CUDA ``torch.optim.AdamW(fused=True)`` updates every parameter in a few kernels instead
of a foreach loop of small ones (issue 10's profile: ~11 ms/step of foreach AdamW on an
H100 at 345M). Elsewhere (CPU runs, tests) the default implementation stays, so CPU results
do not change; ``impl`` forces one (tests/test_optimizer_impl.py checks they agree).
"""
import torch

IMPLS = ("auto", "fused", "foreach", "for-loop")


def adamw_kwargs(params, impl="auto"):
    """The ``fused`` / ``foreach`` arguments of ``torch.optim.AdamW`` for ``params``.

    Args:
        params: the parameters (or param groups) the optimizer will own.
        impl: ``auto`` (fused when every parameter is on CUDA, else torch's default),
            ``fused``, ``foreach`` or ``for-loop``.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown AdamW implementation {impl!r}; choose one of {IMPLS}")
    if impl == "auto":
        tensors = [p for g in params for p in (g["params"] if isinstance(g, dict) else [g])]
        impl = "fused" if tensors and all(p.is_cuda for p in tensors) else "default"
    return {"fused": {"fused": True}, "foreach": {"foreach": True},
            "for-loop": {"foreach": False}, "default": {}}[impl]


def build_adamw(param_groups, lr, betas, eps, weight_decay, impl="auto"):
    """``torch.optim.AdamW`` over ``param_groups``, fused on CUDA (see :func:`adamw_kwargs`).

    Args:
        param_groups: list of ``{"params": [...], "weight_decay": ...}`` groups.
        lr, betas, eps, weight_decay: AdamW's hyper-parameters.
        impl: see :func:`adamw_kwargs`.
    """
    param_groups = list(param_groups)
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps,
                             weight_decay=weight_decay, **adamw_kwargs(param_groups, impl))
