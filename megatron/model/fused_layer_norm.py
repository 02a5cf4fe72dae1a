"""The fused LayerNorm and RMSNorm, at their path before issue 35: they are mpu pieces now
(:mod:`megatron.mpu.norms`; ``mpu.RMSNorm``), re-exported here so model code and user code
that import them from ``megatron.model.fused_layer_norm`` keep working."""
from ..mpu.norms import (  # noqa: F401  (re-exported)
    CUDA_MAX_HIDDEN,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
    fused_norm,
    layer_norm_reference,
    norm_kernel_unavailable_reason,
    rms_norm_reference,
)
