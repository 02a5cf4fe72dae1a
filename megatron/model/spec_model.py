"""The serial model of a list of layer specs, named as a pipeline names it.

A model written once as tds layer specs (``LayerSpec`` / ``TiedLayerSpec``) is its pipeline
(a ``PipelineModule`` of those specs) and, through :class:`SpecModel`, its serial model. A
``PipelineModule`` registers layer spec ``i`` as ``str(i)`` and a tied module once, as
``tied_modules.<key>``, on every stage that holds it; :class:`SpecModel` does the same in
one process, so every tensor has one name at every (tp, pp, v): a checkpoint moves between
layouts by its sharding record alone (docs/new_model.md, section 4), a tied head included
(:func:`megatron.model.lm_head.tied_embedding_specs`).
"""
from functools import partial
from typing import Any, Iterable, Sequence

import torch
from torch import nn

from .. import mpu


class SpecModel(nn.Module):
    """``specs`` built in one process: ``forward(*inputs)`` runs them in turn, as the
    pipeline's stages do (the first takes the tuple ``inputs``; a 1-tuple passes as its
    tensor).

    Args:
        specs: tds ``LayerSpec`` / ``TiedLayerSpec`` objects (or modules, or callables).
        checkpointable: class names of the layers recomputed in the backward
            (``mpu.checkpoint``, one layer at a time) when ``recompute``.
        recompute: recompute those layers (the run's ``--checkpoint-activations``).
    """

    def __init__(self, specs: Sequence[Any], checkpointable: Iterable[str] = (),
                 recompute: bool = False) -> None:
        super().__init__()
        from tds.pipe import LayerSpec, TiedLayerSpec

        self.tied_modules = nn.ModuleDict()
        self.checkpointable = frozenset(checkpointable) if recompute else frozenset()
        self._funcs = []  # (callable, recomputed)
        for index, spec in enumerate(specs):
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.build()
                module = self.tied_modules[spec.key]
                func = module if spec.forward_fn is None else partial(spec.forward_fn, module)
            elif isinstance(spec, (LayerSpec, nn.Module)):
                func = spec.build() if isinstance(spec, LayerSpec) else spec
                self.add_module(str(index), func)
            else:
                func = spec
            self._funcs.append((func, type(func).__name__ in self.checkpointable))

    def forward(self, *inputs: Any) -> Any:
        x: Any = inputs
        for func, recomputed in self._funcs:
            x = x[0] if isinstance(x, tuple) and len(x) == 1 else x
            if recomputed and torch.is_grad_enabled():
                args = x if isinstance(x, tuple) else (x,)
                x = mpu.checkpoint(_run_packed(func, len(args)), *args)
            else:
                x = func(x)
        return x


def _run_packed(func, count):
    """``f(*tensors)`` calling ``func`` with them as the tuple a layer takes."""
    def run(*args):
        return func(args if count > 1 else args[0])

    return run
