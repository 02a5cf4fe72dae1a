"""The planner's model against a second table no one here wrote: Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198),
Tables 3 and 5: GPT models of 22B to 1T parameters on 8 to 512 A100 80GB, each trained
with full activation recompute and with the paper's sequence parallelism + selective
recompute, the iteration time of both and the model FLOPs utilization of the second.

Each row's two runs are evaluated exactly as the planner evaluates a layout
(:func:`.planner.evaluate`, the :data:`~.step_time.A100` constants, 8 GPUs per node), with
the constants of the Narayanan et al. 2021 comparison (:mod:`.published`): nothing was
fitted to this table. What the paper does not list per row is taken as written in
docs/measurements/memory.md ("Against Korthikanti et al. 2022").
"""
from dataclasses import dataclass, replace
from typing import List

from .planner import Hardware, Plan, evaluate
from .published import SEQ, VOCAB, PaperRun
from .report import GIB
from .spec import MemorySpec
from .step_time import A100, Device, layer_times

@dataclass(frozen=True)
class Row(PaperRun):
    """One row of Tables 3 and 5 (sequence 2048 and vocabulary 51,200, as in Table 1)."""

    full_s: float
    """Iteration time with full recompute (Table 5), seconds."""
    present_s: float
    """Iteration time with sequence parallelism + selective recompute (Table 5)."""
    mfu: float
    """Model FLOPs utilization of the second (Table 5), a share."""
    vpp: int = 1
    """Interleaved chunks per pipeline rank."""
    micro_batch: int = 1

    @property
    def speedup(self) -> float:
        """Throughput gain of the paper's method over full recompute (Table 5)."""
        return self.full_s / self.present_s - 1


#: Tables 3 and 5: 8 GPUs per node; micro-batch 4 for 22B (its Table 4 layer times: 48 x
#: 20.3 ms is its 1.10 s iteration), 1 for the others; v = 3 for 175B and 530B.
KORTHIKANTI_2022 = (
    Row(22, 64, 6144, 48, 8, 1, 8, 4, 1.42, 1.10, 0.415, micro_batch=4),
    Row(175, 96, 12288, 96, 8, 8, 64, 64, 18.13, 13.75, 0.514, vpp=3),
    Row(530, 128, 20480, 105, 8, 35, 280, 280, 49.05, 37.83, 0.560, vpp=3),
    Row(1000, 160, 25600, 128, 8, 64, 512, 512, 94.42, 71.49, 0.563),
)


def model_flops(row: Row) -> float:
    """Model FLOPs of one iteration (no recompute; the paper's count behind its MFU):
    ``72 B s l h^2 (1 + s / 6h + V / 12 l h)``."""
    h, s, layers = row.hidden, SEQ, row.layers
    return 72.0 * row.global_batch * s * layers * h * h * (
        1 + s / (6 * h) + VOCAB / (12 * layers * h))


def row_spec(row: Row, present: bool) -> MemorySpec:
    """The row's layout as the model reads it: fp16 through the pipeline engine (the tds
    engine also without a pipeline), Megatron-LM 2022's unfused attention with dropout 0.1,
    hidden dropout 0.1; full recompute (uniform, one layer per group)
    without sequence parallelism, or (``present``) selective recompute with it.

    Args:
        row: a row of :data:`KORTHIKANTI_2022`.
        present: the paper's method rather than full recompute.
    """
    return MemorySpec(
        family="gpt2", num_layers=row.layers, hidden=row.hidden, heads=row.heads,
        kv_channels=row.hidden // row.heads, ffn=4 * row.hidden, vocab=VOCAB, seq=SEQ,
        micro_batch=row.micro_batch,
        num_micro_batches=row.global_batch // (row.dp * row.micro_batch), tp=row.tp, pp=row.pp,
        dp=row.dp, vpp=row.vpp, recompute="selective" if present else "full",
        sequence_parallel=present, dtype="fp16", backend="engine", attention="unfused",
        hidden_dropout=0.1, attention_dropout=0.1, max_positions=SEQ, fused_elementwise=True)


@dataclass(frozen=True)
class RowPrediction:
    """One row: the model's two iteration times next to the paper's."""

    row: Row
    full: Plan
    present: Plan

    @property
    def speedup(self) -> float:
        return self.full.step_time / self.present.step_time - 1

    @property
    def mfu(self) -> float:
        """Predicted model FLOPs utilization of the paper's method (A100: 312 TFLOP/s)."""
        return model_flops(self.row) / self.present.step_time / self.row.gpus / 312e12


def predict_row(row: Row, dev: Device = A100, gpu_memory: int = 80 * GIB) -> RowPrediction:
    """Both of a row's runs through the planner's model."""
    hw = Hardware.of(dev, gpus=row.gpus, gpu_memory=gpu_memory, nodes=max(1, row.gpus // 8))
    flops = model_flops(row)
    full, present = (evaluate(row_spec(row, p), hw, flops) for p in (False, True))
    return RowPrediction(row, full, present)


#: Table 4: one layer of the 22B model (tp 8, micro-batch 4), forward and backward ms.
LAYER_22B = {"baseline": (7.7, 11.9), "sequence parallel": (7.2, 11.8),
             "full recompute": (7.7, 19.5), "selective": (7.7, 13.2),
             "selective + sequence parallel": (7.2, 13.1)}


def layer_spec(variant: str) -> MemorySpec:
    """The 22B row's layout for one of :data:`LAYER_22B`'s experiments."""
    sp = "sequence parallel" in variant
    recompute = {"full recompute": "full", "selective": "selective",
                 "selective + sequence parallel": "selective"}.get(variant, "none")
    return replace(row_spec(KORTHIKANTI_2022[0], False), sequence_parallel=sp,
                   recompute=recompute)


def predict_layers(dev: Device = A100) -> dict:
    """Per :data:`LAYER_22B` experiment the predicted ``(forward, backward)`` ms."""
    return {v: tuple(x * 1e3 for x in layer_times(layer_spec(v), dev, 8)) for v in LAYER_22B}


def predict_table(dev: Device = A100) -> List[RowPrediction]:
    """Every row with one set of constants."""
    return [predict_row(r, dev) for r in KORTHIKANTI_2022]


def format_table(preds: List[RowPrediction]) -> str:
    """Markdown: per row the layout, paper / predicted iteration times, speed-up, MFU and
    the predicted peaks."""
    lines = ["| model | tp | pp | v | GPUs | batch | full recompute s (paper / predicted) "
             "| SP + selective s (paper / predicted) | speed-up (paper / predicted) "
             "| MFU (paper / predicted) | peak GiB (full / SP + selective) |",
             "|" + "---|" * 11]
    for p in preds:
        r = p.row
        name = f"{r.params_b:g}B" if r.params_b < 1000 else "1T"
        lines.append(
            f"| {name} | {r.tp} | {r.pp} | {r.vpp} | {r.gpus} | {r.global_batch} "
            f"| {r.full_s:.2f} / {p.full.step_time:.2f} "
            f"| {r.present_s:.2f} / {p.present.step_time:.2f} "
            f"| {r.speedup:+.1%} / {p.speedup:+.1%} | {r.mfu:.1%} / {p.mfu:.1%} "
            f"| {p.full.peak / GIB:.1f} / {p.present.peak / GIB:.1f} |")
    return "\n".join(lines)


def format_layers(layers: dict) -> str:
    """Markdown: Table 4's layer times, paper / predicted."""
    lines = ["| 22B layer (tp 8, micro-batch 4) | forward ms (paper / predicted) "
             "| backward ms (paper / predicted) | overhead (paper / predicted) |",
             "|---|---|---|---|"]
    base, base_p = sum(LAYER_22B["baseline"]), sum(layers["baseline"])
    for v, (f, b) in LAYER_22B.items():
        pf, pb = layers[v]
        lines.append(f"| {v} | {f:.1f} / {pf:.1f} | {b:.1f} / {pb:.1f} "
                     f"| {(f + b) / base - 1:+.0%} / {(pf + pb) / base_p - 1:+.0%} |")
    return "\n".join(lines)


__all__ = ["KORTHIKANTI_2022", "LAYER_22B", "Row", "RowPrediction", "format_layers",
           "format_table", "layer_spec", "model_flops", "predict_layers", "predict_row",
           "predict_table", "row_spec"]
