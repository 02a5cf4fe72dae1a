"""v1's ``mpu.grads``: ``clip_grad_norm(parameters, max_norm, norm_type=2)`` over the
model-parallel ranks (tensor-parallel ones: v1 had no pipeline)."""
from ..grads import clip_grad_norm  # noqa: F401
