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
    moe_layers: int = 0
    """How many of ``encoder_layers`` have an MoE block (megatron/memory/moe.py)."""


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


def _with_moe(spec: MemorySpec, parts) -> List[StageLayers]:
    """The partition with each part's MoE layer count (the parts hold consecutive
    layers)."""
    if not spec.num_experts:
        return list(parts)
    from dataclasses import replace

    from .moe import moe_layer_count

    out, first = [], 0
    for part in parts:
        out.append(replace(part, moe_layers=moe_layer_count(spec, first, part.encoder_layers)))
        first += part.encoder_layers
    return out


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
                       head=any(p.head for p in parts),
                       moe_layers=sum(p.moe_layers for p in parts))


def _partition(spec: MemorySpec, parts_count: int) -> List[StageLayers]:
    return _with_moe(spec, _cached_partition(spec.family, spec.num_layers, parts_count))


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
    """DeepSpeed's balanced partition, as tds's pipeline modules cut their chunks
    (:func:`tds.pipe.partition.partition_balanced`; imported here on first use: a run
    without pipeline stages never loads tds or DeepSpeed)."""
    from tds.pipe.partition import partition_balanced as balanced

    return balanced(weights, num_parts)
