"""v1's ``mpu.utils``: ``divide``, ``ensure_divisibility``, ``split_tensor_along_last_dim``
and ``VocabUtility`` (the same functions as :mod:`megatron.mpu.utils`)."""
from ..utils import (  # noqa: F401
    VocabUtility,
    divide,
    ensure_divisibility,
    split_tensor_along_last_dim,
)
