"""``--compile``: each pipeline chunk (pp = 1: the whole model) as one ``torch.compile`` region.

What a region holds: the embedding, every layer (recompute blocks included: torch's
non-reentrant checkpoint inside the graph, :func:`megatron.mpu.checkpoint`), the final norm,
the output layer and the loss where the chunk has them (the vocab-parallel cross entropy in
its compiled form, :mod:`megatron.mpu.cross_entropy`). Its backward is one compiled graph. At
tp > 1 dynamo turns the mpu collectives into functional collectives inside the graph; under a
zero-bubble schedule the mpu linears defer their weight GEMMs through an operator the graph
calls (:mod:`megatron.mpu.weight_grad`). Parameter names, checkpoints and the pipeline's layer
specs do not change: nothing is wrapped, the model's ``forward`` (or the engine's chunk call)
is pointed at the compiled functions.

- :func:`compile_model`: a serial model (DDP or DeepSpeed's engine around it). Its
  ``forward(*inputs, loss_labels=labels)`` returns the loss computed inside the region; a
  family's forward step calls it through :func:`model_loss`. Called without ``loss_labels``
  it returns the outputs, from a region without the loss.
- :func:`compile_pipeline`: a tds ``PipelineModule``, one region per local chunk
  (:mod:`tds.pipe.compiled`).
- :func:`compile_layers`: the older per-layer compile (one region per transformer layer), for
  a user's module or a comparison (benchmarks/compiled_step.py); ``--compile`` no longer uses it.

Every region is a function with a code object of its own, for training and for evaluation, so
no region's compilation is a recompilation of another and a step after the first compiles
nothing (:func:`region_cache_entries`; tests/test_compile_regions.py). Shapes are static
(``dynamic=False``): a new shape is a new graph, said by dynamo's recompile log.
"""
import functools
from typing import Callable, Dict, Optional

import torch
from torch import nn

from .. import fused_kernels, mpu
from ..observability import compile_watch
from ..mpu import random as mpu_random
from .t5_layers import T5DecoderLayer, T5EncoderLayer
from .transformer import ParallelTransformerLayer

#: The blocks :func:`compile_layers` compiles (pipeline subclasses included).
LAYER_CLASSES = (ParallelTransformerLayer, T5EncoderLayer, T5DecoderLayer)
#: The keyword a compiled serial model's forward takes the labels by.
LOSS_LABELS = "loss_labels"


def is_transformer_layer(module):
    """Whether ``module`` is (a subclass of) one of :data:`LAYER_CLASSES`."""
    return isinstance(module, LAYER_CLASSES)


def prepare_for_compile():
    """Tell dynamo what it must not trace (idempotent).

    - ``fused_kernels.kernels_available`` is a constant of the graph (its first call may
      build the kernels; ``assume_constant_result`` marks the function in place);
    - a fork of the model-parallel RNG stream runs eagerly: one graph break per fork;
    - compiles are timed and said while they run (:mod:`megatron.observability.compile_watch`).
    """
    torch.compiler.assume_constant_result(fused_kernels.kernels_available)
    mpu_random.fork_eagerly_under_compile()
    compile_watch.install()  # compile time apart from step time; progress while it runs


def compiler(defers_weight_grads: bool = False, **compile_kwargs) -> Callable:
    """``f(function) -> compiled function``: ``torch.compile`` with static shapes and, where
    the region holds layers that defer weight gradients, the inductor options they need
    (``mpu.WEIGHT_GRAD_COMPILE_OPTIONS``).

    Args:
        defers_weight_grads: the regions run under a zero-bubble schedule.
        compile_kwargs: more ``torch.compile`` arguments (``backend``, ``mode``, ``options``).
    """
    prepare_for_compile()
    kwargs = {"dynamic": False, **compile_kwargs}
    if defers_weight_grads and kwargs.get("backend", "inductor") == "inductor":
        kwargs["options"] = {**kwargs.get("options", {}), **mpu.WEIGHT_GRAD_COMPILE_OPTIONS}
    return functools.partial(torch.compile, **kwargs)


class ModelRegions:
    """The compiled regions of a serial model: forward with or without the loss, in training
    and in evaluation (four functions, each compiled on its first call).

    Args:
        model: the model (its ``forward`` as it was before :func:`compile_model`).
        loss_fn: ``loss_fn(outputs, labels) -> loss``, or None (no loss regions).
        compile_fn: from :func:`compiler`.
    """

    def __init__(self, model: nn.Module, loss_fn: Optional[Callable], compile_fn: Callable,
                 cuda_graphs: bool = False):
        from tds.pipe.compiled import fresh_function

        self.cuda_graphs = cuda_graphs

        forward = model.forward  # the bound method, before it is replaced

        def with_loss(args, kwargs, labels):
            return loss_fn(forward(*args, **kwargs), labels)

        def without_loss(args, kwargs, labels):
            return forward(*args, **kwargs)

        self.raw: Dict[str, Callable] = {}
        self.regions: Dict[tuple, Callable] = {}
        for training in (True, False):
            for loss in ((True, False) if loss_fn is not None else (False,)):
                name = f"{type(model).__name__}_{'train' if training else 'eval'}" \
                       f"{'_loss' if loss else ''}"
                fn = fresh_function(with_loss if loss else without_loss, name)
                self.raw[name] = fn
                self.regions[(training, loss)] = compile_fn(fn)
        self.has_loss = loss_fn is not None

    def __call__(self, model, args, kwargs):
        labels = kwargs.pop(LOSS_LABELS, None)
        if labels is not None and not self.has_loss:
            raise ValueError(f"{type(model).__name__} was compiled without a loss function: "
                             f"call it without {LOSS_LABELS}=")
        region = self.regions[(model.training, labels is not None)]
        if not self.cuda_graphs:
            return region(args, kwargs, labels)
        # a CUDA graph's outputs live in memory its next replay overwrites: the loop keeps
        # losses until it logs them, so each call starts a new "step" and returns a copy
        torch.compiler.cudagraph_mark_step_begin()
        out = region(args, kwargs, labels)
        return out.clone() if torch.is_tensor(out) else type(out)(t.clone() for t in out)

    def entries(self) -> Dict[str, int]:
        """Region name -> graphs dynamo holds for it."""
        from tds.pipe.compiled import cache_entries

        return {name: cache_entries(fn) for name, fn in self.raw.items()}


def compile_model(model: nn.Module, loss_fn: Optional[Callable] = None,
                  compile_fn: Optional[Callable] = None,
                  cuda_graphs: bool = False) -> ModelRegions:
    """Compile a serial model as one region (with its loss when ``loss_fn`` is given).

    ``model(*inputs, loss_labels=labels)`` then returns the loss of the region; ``model(*inputs)``
    its outputs. Call it before wrapping the model (DDP, DeepSpeed's engine pass keyword
    arguments through).

    Args:
        model: the bare model.
        loss_fn: the family's loss, or None.
        compile_fn: from :func:`compiler` (default: ``compiler()``).
        cuda_graphs: ``compile_fn`` replays CUDA graphs (``mode="reduce-overhead"``): each
            call's outputs are copied out of the graph's memory.
    """
    regions = ModelRegions(model, loss_fn, compile_fn or compiler(), cuda_graphs)

    def forward(*args, **kwargs):
        return regions(model, args, kwargs)

    model.forward = forward  # an instance attribute: the class and the state dict unchanged
    model._megatron_regions = regions
    return regions


def compile_pipeline(module: nn.Module, compile_fn: Optional[Callable] = None):
    """Compile each local chunk of a tds ``PipelineModule`` as one region, the loss in the
    last chunk's (:meth:`tds.pipe.PipelineModule.compile_chunks`); returns the regions."""
    if not hasattr(module, "compile_chunks"):
        raise TypeError(f"--compile of a pipeline needs tds's PipelineModule (got "
                        f"{type(module).__name__}, DeepSpeed's own class): build the model "
                        f"with tds.pipe.PipelineModule")
    return module.compile_chunks(compile_fn or compiler())


def regions_of(model) -> Optional[object]:
    """The :class:`ModelRegions` / ``ChunkRegions`` of a compiled model (through DDP or an
    engine), or None."""
    bare = bare_module(model)
    return getattr(bare, "_megatron_regions", None) or getattr(bare, "chunk_regions", None)


def region_cache_entries(model) -> Dict[str, int]:
    """Region name -> graphs dynamo holds for it; 1 each once every region ran, more after a
    recompilation."""
    regions = regions_of(model)
    return {} if regions is None else regions.entries()


def bare_module(model):
    """The model inside DDP / a DeepSpeed engine (their ``module``)."""
    while not hasattr(model, "_megatron_regions") and isinstance(
            getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def model_loss(model, inputs, labels, loss_fn: Callable):
    """``loss_fn(model(*inputs), labels)``, computed inside the model's compiled region when
    :func:`compile_model` gave it one (the forward step of every family)."""
    if getattr(bare_module(model), "_megatron_regions", None) is not None:
        return model(*inputs, **{LOSS_LABELS: labels})
    return loss_fn(model(*inputs), labels)


def compile_layers(model, classes=None, **compile_kwargs):
    """Compile every transformer layer of ``model`` in place; returns how many.

    Args:
        model: a GPT2Model / T5Model or their pipeline modules, or any model.
        classes: the layer classes to compile; None: the built-in blocks
            (:data:`LAYER_CLASSES` and their subclasses); an empty tuple: none.
        compile_kwargs: passed to ``torch.compile`` (e.g. ``mode``, ``backend``).
    """
    prepare_for_compile()
    if classes is None:
        layers = [m for m in model.modules() if is_transformer_layer(m)]
    else:
        classes = tuple(classes)
        layers = [m for m in model.modules() if isinstance(m, classes)] if classes else []
    for layer in layers:
        layer.compile(**compile_kwargs)
    return len(layers)


def compiled_graph_count() -> int:
    """Graphs dynamo compiled in this process so far (its ``unique_graphs`` counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
