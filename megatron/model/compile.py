"""``--compile``: regional ``torch.compile`` of each transformer layer (as torchtitan does).

Each layer is compiled in place (``nn.Module.compile``), so parameter names, checkpoints and
the pipeline's layer specs are unchanged, and one compiled graph is reused by every layer of
the same shape. Inductor fuses the elementwise tails (bias + GeLU, dropout + residual add,
the norms' arithmetic). Each layer is one graph (tests/test_compile_graphs.py): the fused
kernels are ``torch.library`` operators, dynamo turns the mpu autograd functions'
collectives into functional collectives, and the RNG tracker is forked only where a
per-rank dropout runs (p > 0 at tp > 1). Such a fork cannot be traced: it runs eagerly
between compiled regions (docs/training.md, "Compiling").

Two hints dynamo needs are given by :func:`prepare_for_compile`, not at import (giving them
imports dynamo, about a second on every rank of every run): :func:`compile_layers` calls it;
call it yourself before ``torch.compile`` of your own module built from these layers.
"""
import torch
from torch import nn

from .. import fused_kernels
from ..mpu import random as mpu_random

#: Class names of the blocks compiled (pipeline subclasses included through the MRO).
LAYER_CLASSES = ("ParallelTransformerLayer", "T5EncoderLayer", "T5DecoderLayer")


def is_transformer_layer(module):
    """Whether ``module`` is (a subclass of) one of :data:`LAYER_CLASSES`."""
    return any(cls.__name__ in LAYER_CLASSES for cls in type(module).__mro__)


def prepare_for_compile():
    """Tell dynamo what it must not trace (idempotent).

    - ``fused_kernels.kernels_available`` is a constant of the graph (its first call may
      build the kernels; ``assume_constant_result`` marks the function in place);
    - a fork of the model-parallel RNG stream runs eagerly: one graph break per fork.
    """
    torch.compiler.assume_constant_result(fused_kernels.kernels_available)
    mpu_random.fork_eagerly_under_compile()


def compile_layers(model, classes=None, **compile_kwargs):
    """Compile every transformer layer of ``model`` in place; returns how many.

    Args:
        model: a GPT2Model / T5Model or their pipeline modules, or any model.
        classes: the layer classes to compile (a model family's ``compile_classes``); None:
            the built-in blocks (:data:`LAYER_CLASSES`, matched by name through the MRO);
            an empty tuple: none (returns 0).
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
