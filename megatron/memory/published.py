"""The step-time model against a table no one here wrote: Narayanan et al. 2021 ("Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21,
arXiv 2104.04473), Table 1: GPT models of 1.7B to 1T parameters on 32 to 3072 A100s.

Each row is evaluated exactly as the planner evaluates a layout (:func:`.planner.evaluate`,
the :data:`~.step_time.A100` constants, 8 GPUs per node), and its step time is turned into
TFLOP/s per GPU with the paper's own count (its Eq. 3, recomputation included).

What the paper does not list per row (micro-batch, interleaving, data-parallel
implementation) is taken from its authors' reproduction script, Megatron-LM's
``examples/sc21/run_table_1.sh``; docs/measurements/memory.md ("Against Narayanan et al. 2021") gives it.
"""
from dataclasses import dataclass
from typing import List, Optional

from .planner import Hardware, Plan, evaluate
from .report import GIB
from .spec import MemorySpec
from .step_time import A100, Device

#: Sequence length and (padded) vocabulary of every row of Table 1.
SEQ, VOCAB = 2048, 51200


@dataclass(frozen=True)
class PaperRun:
    """A published run's model and layout (a row of a paper's table)."""

    params_b: float
    """Parameters, billions (the paper's column)."""
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    global_batch: int

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


@dataclass(frozen=True)
class PublishedRow(PaperRun):
    """One row of Table 1 and the settings its authors' script ran it with."""

    tflops: float
    """Published achieved TFLOP/s per GPU."""
    micro_batch: int
    """``MBS`` of run_table_1.sh."""
    layers_per_chunk: Optional[int] = None
    """``--num-layers-per-virtual-pipeline-stage`` (interleaved schedule); None: 1F1B."""

    @property
    def vpp(self) -> int:
        """Model chunks per pipeline rank."""
        return self.layers // self.pp // self.layers_per_chunk if self.layers_per_chunk else 1


#: Table 1 (published columns) with run_table_1.sh's micro-batch and interleaving.
NARAYANAN_2021 = (
    PublishedRow(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16),
    PublishedRow(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16),
    PublishedRow(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16),
    PublishedRow(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8),
    PublishedRow(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4),
    PublishedRow(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 5),
    PublishedRow(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 5),
    PublishedRow(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 3),
    PublishedRow(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 1),
    PublishedRow(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1),
)


def eq3_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """FLOPs of one iteration as the paper counts them (Eq. 3: forward, backward and the
    full recomputation's second forward): ``96 B s l h^2 (1 + s / 6h + V / 16 l h)``.

    Args:
        batch: global batch (sequences).
        seq: sequence length.
        layers: transformer layers.
        hidden: hidden size.
        vocab: vocabulary size.
    """
    h = hidden
    return 96.0 * batch * seq * layers * h * h * (1 + seq / (6 * h) + vocab / (16 * layers * h))


def eq2_params(layers: int, hidden: int, vocab: int = VOCAB, seq: int = SEQ) -> float:
    """Parameters as the paper counts them (Eq. 2):
    ``12 l h^2 (1 + 13 / 12h + (V + s) / 12 l h)``.

    Args:
        layers: transformer layers.
        hidden: hidden size.
        vocab: vocabulary size.
        seq: sequence length (position embeddings).
    """
    h = hidden
    return 12.0 * layers * h * h * (1 + 13 / (12 * h) + (vocab + seq) / (12 * layers * h))


def row_spec(row: PublishedRow) -> MemorySpec:
    """The row's layout as the memory and step-time model reads it: fp16, full recompute,
    Megatron-LM 2021's unfused attention with dropout 0.1; torch DDP (the gradient reduction
    under the backward) without a pipeline, the engine's reduction after it with one, as
    run_table_1.sh's ``DDP=torch`` / ``DDP=local``.

    Args:
        row: a row of :data:`NARAYANAN_2021`.
    """
    per_replica = row.global_batch // row.dp
    if per_replica * row.dp != row.global_batch or per_replica % row.micro_batch:
        raise ValueError(f"{row.params_b}B: batch {row.global_batch} does not split into dp "
                         f"{row.dp} x micro-batch {row.micro_batch}")
    return MemorySpec(
        family="gpt2", num_layers=row.layers, hidden=row.hidden, heads=row.heads,
        kv_channels=row.hidden // row.heads, ffn=4 * row.hidden, vocab=VOCAB, seq=SEQ,
        micro_batch=row.micro_batch, num_micro_batches=per_replica // row.micro_batch,
        tp=row.tp, pp=row.pp, dp=row.dp, vpp=row.vpp, recompute="full", dtype="fp16",
        backend="ddp" if row.pp == 1 else "engine", attention="unfused",
        hidden_dropout=0.1, attention_dropout=0.1, max_positions=SEQ, fused_elementwise=True)


@dataclass(frozen=True)
class RowPrediction:
    """One row: the model's step time and TFLOP/s per GPU (Eq. 3) next to the paper's."""

    row: PublishedRow
    plan: Plan

    @property
    def step_time(self) -> float:
        return self.plan.step_time

    @property
    def tflops(self) -> float:
        """Predicted TFLOP/s per GPU by the paper's count."""
        return self.plan.step_flops / self.plan.step_time / self.row.gpus / 1e12

    @property
    def ratio(self) -> float:
        """Predicted / published."""
        return self.tflops / self.row.tflops


def predict_row(row: PublishedRow, dev: Device = A100, per_node: int = 8,
                gpu_memory: int = 80 * GIB) -> RowPrediction:
    """Evaluate one row's own layout through the planner's model.

    Args:
        row: a row of :data:`NARAYANAN_2021`.
        dev: the GPU and link constants (the A100 preset).
        per_node: GPUs per node (a DGX A100: 8).
        gpu_memory: bytes per GPU (80 GB A100s).
    """
    spec = row_spec(row)
    spec.check()
    hw = Hardware.of(dev, gpus=row.gpus, gpu_memory=gpu_memory, nodes=row.gpus // per_node)
    flops = eq3_flops(row.global_batch, SEQ, row.layers, row.hidden, VOCAB)
    return RowPrediction(row, evaluate(spec, hw, flops))


def predict_table(dev: Device = A100, rows=NARAYANAN_2021) -> List[RowPrediction]:
    """Every row of Table 1 with one set of constants.

    Args:
        dev: the GPU and link constants.
        rows: the rows (default: all of Table 1).
    """
    return [predict_row(r, dev) for r in rows]


def format_table(preds: List[RowPrediction]) -> str:
    """Markdown table: the layout, published and predicted TFLOP/s per GPU and their ratio."""
    lines = ["| params (B) | tp | pp | dp | micro-batch | v | GPUs | batch | step (s) "
             "| predicted TFLOP/s | published | predicted / published | bubble | peak GiB |",
             "|" + "---|" * 14]
    for p in preds:
        r, t = p.row, p.plan.time
        lines.append(f"| {r.params_b:g} | {r.tp} | {r.pp} | {r.dp} | {r.micro_batch} "
                     f"| {r.vpp} | {r.gpus} | {r.global_batch} | {p.step_time:.2f} "
                     f"| {p.tflops:.1f} | {r.tflops:g} | {p.ratio:.2f} | {t.bubble:.3f} "
                     f"| {p.plan.peak / GIB:.1f} |")
    return "\n".join(lines)


__all__ = ["NARAYANAN_2021", "PaperRun", "PublishedRow", "RowPrediction", "eq2_params", "eq3_flops",
           "format_table", "predict_row", "predict_table", "row_spec"]
