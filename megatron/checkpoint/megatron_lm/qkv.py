"""The fused QKV rows of each Megatron-LM checkpoint version, and the versions known.

Each tensor-parallel rank's ``query_key_value`` weight (and bias) has
``3 x heads_per_rank x head_dim`` rows; their order depends on the checkpoint version the
file was saved with (Megatron-LM's ``fix_query_key_value_ordering`` undoes the first two
when it loads them)::

    version 0   (no ``checkpoint_version``: Megatron-LM v1.0, the released GPT-2 345M)
                [3, np, hn]   all queries, then all keys, then all values
    version 1.0 [np, hn, 3]   per head, per channel: q, k, v interleaved
    version 2.0 [np, 3, hn]   per head: its q, k and v rows
    version 3.0 [np, 3, hn]   (3.0 added pipeline stages and renamed the parallel args)

This project's layout is the last one, per head ``[np, 3, hn]``, so a contiguous
tensor-parallel split gives whole heads. The reorder is per rank: ``np`` is the rank's own
number of heads.
"""
from typing import Any

from ...common.errors import CheckpointError

KNOWN_VERSIONS = (0, 1, 2, 3)
#: What this project's writer saves.
WRITE_VERSION = 3.0


def check_version(version: Any, path: str) -> float:
    """The version as a number this reader knows (0, 1, 2 or 3)."""
    try:
        number = float(version)
    except (TypeError, ValueError):
        number = None
    if number is None or number not in KNOWN_VERSIONS:
        raise CheckpointError(f"{path} has checkpoint_version {version!r}; megatron-tds reads "
                              f"Megatron-LM checkpoint versions 0, 1.0, 2.0 and 3.0")
    return number


def to_per_head(shard: Any, version: float, heads: int) -> Any:
    """One tp rank's fused QKV weight or bias, reordered from ``version`` to ``[np, 3, hn]``.

    Args:
        shard: ``[3 * heads * head_dim(, hidden)]`` rows as saved.
        version: the file's checkpoint version (0, 1, 2 or 3).
        heads: attention heads on this rank.
    """
    if version >= 2:
        return shard
    rest = shard.shape[1:]
    if shard.shape[0] % (3 * heads):
        raise CheckpointError(f"a query_key_value tensor of {shard.shape[0]} rows does not "
                              f"split into 3 x {heads} heads")
    if version == 0:
        per_head = shard.reshape(3, heads, -1, *rest).transpose(0, 1)  # [np, 3, hn, ...]
    else:
        per_head = shard.reshape(heads, -1, 3, *rest).transpose(1, 2)  # [np, 3, hn, ...]
    return per_head.reshape(shard.shape).contiguous()
