"""Compiled pipeline chunks: one ``torch.compile`` region per model chunk.

``PipelineModule.compile_chunks(compile_fn)`` builds a :class:`ChunkRegions`: for each local
chunk, a function running all the chunk's layers (recompute blocks included) and, on the
chunk that ends the model, the loss, compiled by ``compile_fn`` as one region. The pipeline
engine (:mod:`tds.pipe.schedule_step`) then runs a chunk's forward as one call into compiled
code and its backward as one compiled backward graph, for every schedule: the send and
receive between chunks, the loss bookkeeping and the optimizer stay outside.

Each region is its own function with its own code object, for training and for evaluation
alike: dynamo keeps its compiled graphs per code object, so two chunks (or a chunk's
training and evaluation forms) never share a cache, and compiling one is never a
*recompilation* of another. Once every region ran once, a step compiles nothing
(:func:`cache_entries` counts what each region holds).
"""
import types
from typing import Callable, Dict, List, Optional, Tuple


def fresh_function(function: Callable, name: str) -> Callable:
    """``function`` with a code object of its own, named ``name`` (dynamo caches compiled
    graphs per code object: a fresh one starts with an empty cache)."""
    code = function.__code__.replace(co_name=name, co_qualname=name)
    fresh = types.FunctionType(code, function.__globals__, name, function.__defaults__,
                               function.__closure__)
    fresh.__kwdefaults__ = function.__kwdefaults__
    return fresh


def cache_entries(function: Callable) -> int:
    """Graphs dynamo holds for a region's code object (1 after its first call; more means it
    was recompiled)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return len(_debug_get_cache_entry_list(_code_of(function)))


def _code_of(function):
    inner = getattr(function, "_torchdynamo_orig_callable", function)
    return inner.__code__


class ChunkRegions:
    """The compiled regions of a pipeline module's local chunks.

    Args:
        module: tds's ``PipelineModule`` (its ``run_chunk_layers``, ``chunk_blocks``,
            ``loss_fn``, placement).
        compile_fn: ``f(function) -> compiled function``.
        loss: put ``module.loss_fn`` into the region of the chunk that ends the model.
    """

    def __init__(self, module, compile_fn: Callable, loss: bool = True):
        self.module = module
        last = module.placement.num_chunks - 1
        self.loss_chunk: Optional[int] = None  # local index of the chunk that ends the model
        self.train: List[Callable] = []
        self.eval: List[Callable] = []
        self.raw: List[Callable] = []  # the uncompiled functions (for counting)
        for j, chunk in enumerate(module.local_chunks()):
            with_loss = loss and chunk == last and module.loss_fn is not None
            if with_loss:
                self.loss_chunk = j
            body = _chunk_body(module, j, module.chunk_blocks(j), with_loss)
            for kind, target in (("train", self.train), ("eval", self.eval)):
                fn = fresh_function(body, f"tds_chunk{chunk}_{kind}")
                self.raw.append(fn)
                target.append(compile_fn(fn))

    def run(self, j: int, inputs, labels=None, training: bool = True):
        """Local chunk ``j`` on ``inputs``: its outputs, or the loss where the region holds
        it (``labels`` then required)."""
        if j == self.loss_chunk and labels is None:
            raise ValueError(f"tds: the compiled region of local chunk {j} computes the loss: "
                             "give it the labels")
        return (self.train if training else self.eval)[j](inputs, labels)

    def has_loss(self, j: int) -> bool:
        """Whether local chunk ``j``'s region ends with the loss."""
        return j == self.loss_chunk

    def entries(self) -> Dict[str, int]:
        """Region name -> graphs dynamo holds for it (0 before its first call)."""
        return {fn.__name__: cache_entries(fn) for fn in self.raw}


def _chunk_body(module, j: int, blocks: List[Tuple[list, bool]], with_loss: bool) -> Callable:
    """The function one region compiles: the chunk's blocks, then the loss if it has it."""
    loss_fn = module.loss_fn if with_loss else None

    def chunk(inputs, labels):
        outputs = module.run_chunk_layers(j, inputs, blocks)
        if loss_fn is None:
            return outputs
        return loss_fn(outputs, labels)

    return chunk
