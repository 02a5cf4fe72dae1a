"""``--compile``: regional ``torch.compile`` of each transformer layer (as torchtitan does).

Each layer is compiled in place (``nn.Module.compile``), so parameter names, checkpoints and
the pipeline's layer specs are unchanged, and one compiled graph is reused by every layer of
the same shape. Inductor fuses the elementwise tails (bias + GeLU, dropout + residual add,
the norms' arithmetic). Each layer is one graph (tests/test_compile_graphs.py): the fused
kernels are ``torch.library`` operators, dynamo turns the mpu autograd functions'
collectives into functional collectives, and the RNG tracker is forked only where a
per-rank dropout runs (p > 0 at tp > 1). Such a fork cannot be traced: it runs eagerly
between compiled regions (docs/training.md, "Compiling").
"""
from torch import nn

#: Class names of the blocks compiled (pipeline subclasses included through the MRO).
LAYER_CLASSES = ("ParallelTransformerLayer", "T5EncoderLayer", "T5DecoderLayer")


def is_transformer_layer(module):
    """Whether ``module`` is (a subclass of) one of :data:`LAYER_CLASSES`."""
    return any(cls.__name__ in LAYER_CLASSES for cls in type(module).__mro__)


def compile_layers(model, **compile_kwargs):
    """Compile every transformer layer of ``model`` in place; returns how many.

    Args:
        model: a GPT2Model / T5Model or their pipeline modules.
        compile_kwargs: passed to ``torch.compile`` (e.g. ``mode``, ``backend``).
    """
    layers = [m for m in model.modules() if isinstance(m, nn.Module) and is_transformer_layer(m)]
    for layer in layers:
        layer.compile(**compile_kwargs)
    return len(layers)
