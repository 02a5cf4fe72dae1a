"""Which layer specs each pipeline rank holds, with or without virtual stages.

A pipeline run partitions its model's layer specs with DeepSpeed's ``partition_balanced``
over per-spec weights (1 per transformer layer, 0 for embeddings and norms). With
``--virtual-pipeline-model-parallel-size`` v > 1 the specs split into p v chunks and rank r
holds chunks r, r + p, ..., r + (v - 1) p (``tds.pipe.PipelineModule``'s "loop" placement);
with ``--pipeline-schedule zbv`` (v = 2, the "v" placement) rank r holds chunks r and
2p - 1 - r. Calling the same partitioner keeps the key maps and the engine in agreement.
"""
from typing import List, Sequence, Set, Tuple, Union

from ..config.run_config import V_SCHEDULE

Bounds = Union[Tuple[int, int], List[Tuple[int, int]]]
"""One rank's ``(start, end)`` spec range, or with virtual stages a list of them."""

VPP_KEY = "virtual_pipeline_model_parallel_size"
SCHEDULE_KEY = "pipeline_schedule"


def vpp_of(args) -> int:
    """Chunks per pipeline rank recorded in saved ``args`` (1 when absent: older runs)."""
    return int(args.get(VPP_KEY) or 1)


def placement_of(args) -> str:
    """The chunk placement of saved ``args``: "v" for a ZB-V run, else "loop" (also when
    the schedule is not recorded: runs before ``--pipeline-schedule``)."""
    return "v" if args.get(SCHEDULE_KEY) == V_SCHEDULE else "loop"


def rank_bounds(weights: Sequence[int], pp_size: int, vpp_size: int = 1,
                placement: str = "loop") -> List[Bounds]:
    """Per pipeline rank: its ``(start, end)`` spec range (v = 1) or its chunks' ranges.

    Args:
        weights: per layer spec, its partition weight.
        pp_size: pipeline ranks p.
        vpp_size: chunks per rank v.
        placement: "loop" (chunk c on rank c % p) or "v" (v = 2: chunks r and 2p - 1 - r).
    """
    from deepspeed.runtime.utils import partition_balanced  # only pipeline layouts need it

    parts = [int(x) for x in partition_balanced(list(weights), pp_size * vpp_size)]
    chunks = [(parts[c], parts[c + 1]) for c in range(pp_size * vpp_size)]
    if vpp_size == 1:
        return chunks
    if placement == "v":
        return [[chunks[r], chunks[2 * pp_size - 1 - r]] for r in range(pp_size)]
    return [chunks[r::pp_size] for r in range(pp_size)]


def spec_indices(bounds: Bounds) -> Set[int]:
    """The spec indices of one rank's bounds (a pair, or a list of pairs)."""
    if bounds and isinstance(bounds[0], int):
        return set(range(*bounds))
    return {i for start, end in bounds for i in range(start, end)}
