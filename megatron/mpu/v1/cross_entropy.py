"""v1's ``mpu.cross_entropy``: cross entropy over logits split along the vocabulary."""
from ..cross_entropy import vocab_parallel_cross_entropy  # noqa: F401
