"""DeepSpeed's PipelineModule, with virtual stages: v model chunks per pipeline rank.

``PipelineModule(layers, ..., num_virtual_stages=v, placement="loop")``: with v = 1 this is
DeepSpeed's class, unchanged. With v > 1 the layer specs are partitioned (same
``partition_method``) into ``p v`` chunks placed by ``placement``
(:class:`~tds.pipe.schedules.Placement`): "loop" puts global chunk c on pipeline rank
``c % p``, so rank r builds chunks r, r + p, ..., r + (v - 1) p (Megatron-LM's virtual
pipeline stages); "v" (ZB-V, v = 2) puts chunks 0..p-1 on ranks 0..p-1 and chunks p..2p-1
back on ranks p-1..0, so rank 0 holds the first and the last chunk. Each chunk is
registered under its layers' global spec indices, so a rank's ``state_dict`` keys are
those of a 1F1B stage holding the same layers. ``stage_owner`` answers with the rank, so
DeepSpeed's tied-module groups (the tied embedding on chunk 0 and on the last chunk: ranks
0 and p - 1 in a loop, rank 0 alone in a V) and any group a subclass derives from it
connect the right ranks.

``forward_chunk(j, inputs)`` runs the rank's j-th chunk (global chunk ``local_chunks()[j]``) through
DeepSpeed's own forward (activation checkpointing included); the pipeline schedule drives
the chunks through :mod:`tds.pipe.runner` (:mod:`tds.pipe.schedule_step`).
"""
import contextlib
import io
import sys
from typing import TYPE_CHECKING, Any, List, Tuple

import torch
from deepspeed.pipe import PipelineModule as _DeepSpeedPipelineModule

from .actions import PLACEMENT_KINDS, Placement
from .partition import partition_specs

if TYPE_CHECKING:
    from .compiled import ChunkRegions


#: What DeepSpeed's constructor prints on rank 0 that says nothing to a user (the seed
#: settings tds does not use, the raw topology dump); the stage partition stays.
_DEEPSPEED_NOISE = ("SEED_LAYERS=", "Using topology:")


@contextlib.contextmanager
def _without_lines(prefixes):
    """Print what the block prints, less the lines that start with ``prefixes``."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield
    finally:
        kept = [line for line in captured.getvalue().splitlines(keepends=True)
                if not line.startswith(prefixes)]
        sys.stdout.write("".join(kept))
        sys.stdout.flush()


class PipelineModule(_DeepSpeedPipelineModule):
    """DeepSpeed's ``PipelineModule`` plus ``num_virtual_stages`` (chunks per pipeline rank).

    Args:
        layers, args, kwargs: DeepSpeed's (``topology``, ``loss_fn``, ``partition_method``,
            ``activation_checkpoint_interval``, ...).
        num_virtual_stages: model chunks v per pipeline rank (1: DeepSpeed's behaviour).
        placement: "loop" (chunk c on rank c % p) or "v" (ZB-V's V, needs v = 2).
    """

    def __init__(self, layers, *args, num_virtual_stages: int = 1, placement: str = "loop",
                 **kwargs):
        if not isinstance(num_virtual_stages, int) or num_virtual_stages < 1:
            raise ValueError(f"PipelineModule: num_virtual_stages must be a positive integer, "
                             f"got {num_virtual_stages!r}")
        if placement not in PLACEMENT_KINDS or (placement == "v" and num_virtual_stages != 2):
            raise ValueError(f"PipelineModule: placement must be one of "
                             f"{', '.join(PLACEMENT_KINDS)} (\"v\" with num_virtual_stages=2), "
                             f"got {placement!r} with {num_virtual_stages} virtual stages")
        object.__setattr__(self, "placement_kind", placement)
        if num_virtual_stages > 1 and kwargs.get("seed_layers"):
            raise ValueError("PipelineModule: seed_layers is not supported with virtual "
                             "stages; seed the layers in their constructors")
        object.__setattr__(self, "num_virtual_stages", num_virtual_stages)
        object.__setattr__(self, "chunk_bounds", [])
        from ..comm_ready import ensure_backend

        ensure_backend()  # CPM's order: the model built before deepspeed.init_distributed
        with _without_lines(_DEEPSPEED_NOISE):
            super().__init__(layers, *args, **kwargs)
        if num_virtual_stages > 1 and self.num_stages < 2:
            raise ValueError(f"PipelineModule: {num_virtual_stages} virtual stages need at "
                             f"least 2 pipeline stages (got {self.num_stages})")

    def _synchronize_tied_weights(self):
        """DeepSpeed's start-up broadcast of the tied weights from their first stage, outside
        autograd: DeepSpeed broadcasts the parameters themselves with gradients on, so the
        in-place ``c10d::broadcast_`` (which has no autograd kernel) entered the weight's
        autograd history and every backward through it warned "an autograd kernel was not
        registered ... may lead to silently incorrect behavior"."""
        with torch.no_grad():
            super()._synchronize_tied_weights()

    @property
    def placement(self) -> Placement:
        """Which pipeline rank holds each global chunk (:class:`tds.pipe.schedules.Placement`)."""
        return Placement(self.num_stages, self.num_virtual_stages, self.placement_kind)

    # ------------------------------------------------------------ partition and build
    def _partition_layers(self, method="uniform"):
        if self.num_virtual_stages == 1:
            return super()._partition_layers(method)
        p, v = self.num_stages, self.num_virtual_stages
        self.parts = partition_specs(self._layer_specs, method, p * v)  # DeepSpeed's methods
        empty = [c for c in range(p * v) if self.parts[c] == self.parts[c + 1]]
        if empty:
            raise ValueError(f"PipelineModule: chunk(s) {empty} of {p * v} hold no layer "
                             f"(partition {list(self.parts)}); use fewer virtual stages")
        self.chunk_bounds = [(self.parts[c], self.parts[c + 1])
                             for c in self.placement.chunks(self.stage_id)]

    def _build(self):
        if self.num_virtual_stages == 1:
            return super()._build()
        self.chunk_funcs: List[list] = []
        for start, stop in self.chunk_bounds:
            self.forward_funcs = []
            self._set_bounds(start, stop)
            super()._build()
            self.chunk_funcs.append(self.forward_funcs)
        self._chunk_checkpointable = [None] * len(self.chunk_funcs)
        self._select_chunk(0)

    def chunk_owner(self, layer_idx: int) -> int:
        """Global chunk holding layer spec ``layer_idx``."""
        for chunk in range(len(self.parts) - 1):
            if self.parts[chunk] <= layer_idx < self.parts[chunk + 1]:
                return chunk
        raise ValueError(f"layer spec {layer_idx} is outside the partition {list(self.parts)}")

    def stage_owner(self, layer_idx: int) -> int:
        if self.num_virtual_stages == 1:
            return super().stage_owner(layer_idx)
        return self.placement.owner(self.chunk_owner(layer_idx))

    def local_chunks(self) -> List[int]:
        """Global chunk ids this rank holds, in local order (``[stage_id]`` when v = 1)."""
        return list(self.placement.chunks(self.stage_id))

    def spec_ranges(self) -> List[Tuple[int, int]]:
        """``[start, stop)`` layer-spec indices of each local chunk."""
        if self.num_virtual_stages == 1:
            return [(self._local_start, self._local_stop)]
        return list(self.chunk_bounds)

    # ------------------------------------------------------------ forward
    def _select_chunk(self, j: int):
        """Point DeepSpeed's forward at local chunk ``j`` (its layers and recompute blocks)."""
        self.forward_funcs = self.chunk_funcs[j]
        self._local_start, self._local_stop = self.chunk_bounds[j]
        if self.activation_checkpoint_interval > 0:
            cached = self._chunk_checkpointable[j]
            if cached is None or cached[0] != self.activation_checkpoint_interval:
                # a fresh table: DeepSpeed before 0.19.8 appends to the one it finds
                self.is_checkpointable_results, self.is_checkpointable_results_interval = \
                    [], None
                self._precompute_checkpointable_values()
                cached = (self.activation_checkpoint_interval, self.is_checkpointable_results)
                self._chunk_checkpointable[j] = cached
            self.is_checkpointable_results = cached[1]
            self.is_checkpointable_results_interval = cached[0]

    def forward_chunk(self, j: int, inputs):
        """Run local chunk ``j`` (global chunk ``local_chunks()[j]``) on ``inputs``.

        DeepSpeed's forward, with each block's layers bound when the block runs: its
        recompute closure reads ``self.forward_funcs`` only in backward, when another
        chunk may be selected.

        Args:
            j: local chunk index, 0 .. v - 1.
            inputs: the chunk's input (tuple of tensors).
        """
        if self.num_virtual_stages == 1:
            return self(inputs)
        self._select_chunk(j)
        return self.run_chunk_layers(j, inputs)

    def chunk_blocks(self, j: int) -> List[Tuple[list, bool]]:
        """Local chunk ``j``'s layers as recompute blocks: ``[(layers, checkpointed)]`` (one
        block of every layer when the module recomputes nothing)."""
        if self.num_virtual_stages == 1:
            funcs = self.forward_funcs
            self._precompute_checkpointable_values()
        else:
            self._select_chunk(j)
            funcs = self.chunk_funcs[j]
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return [(list(funcs), False)]
        return [(list(funcs[start:start + interval]), bool(checkpointable))
                for start, checkpointable in zip(range(0, len(funcs), interval),
                                                 self.is_checkpointable_results)]

    def run_chunk_layers(self, j: int, inputs, blocks=None):
        """Local chunk ``j``'s layers on ``inputs``, block by block (recompute blocks through
        ``activation_checkpoint_func``), without DeepSpeed's per-call bookkeeping (its
        micro-batch counter and per-layer reseeding): what a compiled chunk traces.

        Args:
            j: local chunk index.
            inputs: the chunk's input (tuple of tensors).
            blocks: :meth:`chunk_blocks` ``(j)``, if the caller has it already.
        """
        x = inputs
        for layers, checkpointed in (self.chunk_blocks(j) if blocks is None else blocks):
            block = _run_layers(layers)
            if not checkpointed:
                x = block(x)
                continue
            x = x if isinstance(x, tuple) else (x,)
            x = self.activation_checkpoint_func(block, *x)
        return x

    def compile_chunks(self, compile_fn, loss: bool = True) -> "ChunkRegions":
        """Compile each local chunk as one region (its layers, and the loss on the chunk
        that computes it): :class:`tds.pipe.compiled.ChunkRegions`, kept as
        ``self.chunk_regions`` (the pipeline engine runs the chunks through it).

        Args:
            compile_fn: ``f(function) -> compiled function`` (e.g. ``torch.compile`` with
                the caller's options).
            loss: put ``loss_fn`` in the last chunk's region.
        """
        from .compiled import ChunkRegions

        if getattr(self, "seed_layers", False):
            raise ValueError("PipelineModule.compile_chunks: seed_layers reseeds the "
                             "generators before every layer, which a compiled region cannot "
                             "do; seed the layers in their constructors")
        regions = ChunkRegions(self, compile_fn, loss=loss)
        object.__setattr__(self, "chunk_regions", regions)
        return regions

    def forward(self, forward_input: Any) -> Any:
        if self.num_virtual_stages > 1:
            raise RuntimeError("a PipelineModule with virtual stages runs one chunk at a time: "
                               "call forward_chunk(j, inputs) (the pipeline engine does)")
        return super().forward(forward_input)


def _run_layers(layers):
    """``f(*inputs)`` running ``layers`` in turn (a single input is passed unwrapped)."""
    def run(*inputs):
        x = inputs[0] if len(inputs) == 1 else inputs
        for layer in layers:
            x = layer(x)
        return x

    return run
