"""Which layers each pipeline stage holds, as the pipeline modules partition them.

GPT2ModelPipe and T5ModelPipe partition their layer specs with DeepSpeed's balanced
partition over the transformer layers (``partition_method='type:...'``: every transformer
layer weighs 1, the embedding, final norms and output layer 0); this module replays that
partition on the same spec list, so the model charges each stage exactly its layers.
"""
from dataclasses import dataclass
from functools import lru_cache
from typing import List, NamedTuple, Sequence, Tuple

from .spec import MemorySpec


@dataclass(frozen=True)
class StageLayers:
    """The parts of the model one pipeline stage runs."""

    stage: int
    embedding: bool
    """The (tied) word embedding lookup (first stage)."""
    encoder_layers: int
    """Transformer layers (GPT-2's, or T5's encoder layers)."""
    decoder_layers: int
    """T5's decoder layers."""
    encoder_norm: bool
    """T5's encoder final norm (GPT-2: unused)."""
    final_norm: bool
    """GPT-2's final LayerNorm / T5's decoder final norm."""
    head: bool
    """Output layer, logits and loss (last stage)."""


def _specs(spec: MemorySpec) -> List[str]:
    """The kinds of the pipeline module's layer specs, in order (t5_pipeline_specs /
    gpt2_pipeline_specs)."""
    L = spec.num_layers
    if spec.family == "gpt2":
        return ["embed"] + ["enc"] * L + ["final_norm", "head"]
    return ["embed"] + ["enc"] * L + ["enc_norm"] + ["dec"] * L + ["final_norm", "head"]


def stage_layers(spec: MemorySpec) -> List[StageLayers]:
    """Each pipeline stage's layers (one entry when pp == 1: the serial model).

    Args:
        spec: the run (family, layers, pp).
    """
    return _partition(spec, spec.pp)


def chunk_layers(spec: MemorySpec) -> List[StageLayers]:
    """Each model chunk's layers with several chunks per rank: tds's PipelineModule runs
    DeepSpeed's partition over ``pp x vpp`` chunks, global chunk c on pipeline rank
    ``c % pp`` (interleaved; ZB-V's V: :func:`.schedule.rank_chunks`); the embedding is in
    chunk 0, the head in the last (``stage`` = chunk).

    Args:
        spec: the run (family, layers, pp, vpp).
    """
    return _partition(spec, spec.pp * spec.vpp)


def rank_layers(chunks: List[StageLayers], rank: int, mine: Sequence[int]) -> StageLayers:
    """The layers pipeline rank ``rank`` holds as the union of its chunks ``mine`` (ZB-V's
    rank 0: the embedding's chunk and the head's, the tied embedding once).

    Args:
        chunks: every global chunk's layers (:func:`chunk_layers`).
        rank: the pipeline rank.
        mine: its global chunks.
    """
    parts = [chunks[c] for c in mine]
    return StageLayers(stage=rank, embedding=any(p.embedding for p in parts),
                       encoder_layers=sum(p.encoder_layers for p in parts),
                       decoder_layers=sum(p.decoder_layers for p in parts),
                       encoder_norm=any(p.encoder_norm for p in parts),
                       final_norm=any(p.final_norm for p in parts),
                       head=any(p.head for p in parts))


def _partition(spec: MemorySpec, parts_count: int) -> List[StageLayers]:
    return list(_cached_partition(spec.family, spec.num_layers, parts_count))


@lru_cache(maxsize=1024)
def _cached_partition(family: str, num_layers: int, parts_count: int) -> Tuple[StageLayers, ...]:
    """The partition of one (family, layers, parts): DeepSpeed's balanced partition is
    computed once per argument set (it takes milliseconds; the planner asks thousands of
    times)."""
    spec = _Sizes(family, num_layers)
    kinds = _specs(spec)
    if parts_count == 1:
        parts = [0, len(kinds)]
    else:
        parts = partition_balanced([1 if k in ("enc", "dec") else 0 for k in kinds],
                                   parts_count)
    out = []
    for stage in range(parts_count):
        mine = kinds[parts[stage]:parts[stage + 1]]
        out.append(StageLayers(stage=stage, embedding="embed" in mine,
                               encoder_layers=mine.count("enc"),
                               decoder_layers=mine.count("dec"),
                               encoder_norm="enc_norm" in mine,
                               final_norm="final_norm" in mine, head="head" in mine))
    return tuple(out)


class _Sizes(NamedTuple):
    """What the partition reads of a spec."""

    family: str
    num_layers: int


def partition_balanced(weights: Sequence[int], num_parts: int) -> List[int]:
    """DeepSpeed's ``partition_balanced`` (the linear-partition dynamic programme its
    ``PipelineModule`` runs for ``partition_method='type:...'``), the same boundaries, ties
    broken the same way (the last split of the least cost), with each step's candidates
    on arrays: milliseconds where DeepSpeed's loops take a second at 128 stages.
    tests/test_planner_fast.py checks it against DeepSpeed's.

    Args:
        weights: per layer spec.
        num_parts: parts.
    """
    import numpy as np

    n, m = len(weights), num_parts
    if n <= m:
        from deepspeed.runtime.utils import partition_uniform  # DeepSpeed's, as there

        return partition_uniform(n, m)
    inf = np.inf
    dp_max, dp_min, dp_cost = (np.full((n + 1, m + 1), inf) for _ in range(3))
    position = np.zeros((n + 1, m + 1), dtype=int)
    prefix = np.zeros(n + 1)
    prefix[1:] = np.cumsum(weights)
    dp_max[0, 0] = dp_cost[0, 0] = 0
    rows, ks = np.arange(n + 1)[:, None], np.arange(n)[None, :]
    span = prefix[:, None] - prefix[None, :n]  # [i, k]: weight of layers k..i-1
    for j in range(1, m + 1):
        top = np.maximum(dp_max[:n, j - 1][None, :], span)
        low = np.minimum(dp_min[:n, j - 1][None, :], span)
        cost = np.where(ks < rows, top - low, np.nan)
        best = np.nanmin(np.where(ks < rows, cost, inf), axis=1)
        hit = (cost == best[:, None]) & (ks < rows)
        k = n - 1 - np.argmax(hit[:, ::-1], axis=1)  # the last k of the least cost
        i = np.arange(j, n + 1)  # DeepSpeed fills j <= min(i, m)
        dp_cost[i, j], position[i, j] = best[i], k[i]
        dp_max[i, j], dp_min[i, j] = top[i, k[i]], low[i, k[i]]
    parts = [n]
    for j in reversed(range(1, m + 1)):
        parts.append(int(position[parts[-1], j]))
    parts.reverse()
    return parts
