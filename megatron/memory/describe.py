"""How a model family describes its layers to the memory model (``ModelFamily.memory_model``).

A family's ``memory_model`` is one of:

- ``"gpt2"`` / ``"decoder"`` / ``"encoder"``: GPT-2's layer (pre-LayerNorm, GeLU MLP,
  biases, learned positions, the output layer tied to the embedding) with the run's sizes
  (``--num-layers``, ``--hidden-size``, heads, ``--ffn-hidden-size``, sequence, vocabulary);
  an encoder's bidirectional attention keeps the same bytes;
- ``"t5"``: T5's description with the run's sizes, read from T5's settings (encoder and
  decoder lengths, feed-forward kind, relative-position buckets): T5, or a family built on
  T5's flags. There is no generic encoder-decoder description: another encoder-decoder
  family (BART-style: learned positions, LayerNorm, biases) sets None;
- a :class:`LayerDescription`, or ``f(cfg) -> LayerDescription``: a decoder- or encoder-only
  model whose layers differ from GPT-2's in the ways the memory model counts (norms, a
  gated MLP, grouped-query attention, rotary positions, biases, dropout, an untied head);
- None: no memory model (the start-up line says so; tools/plan_layout.py refuses).
"""
from dataclasses import dataclass
from typing import Any, Dict, Optional

from ..common.errors import ConfigError
from ..config.run_config import RunConfig

#: The generic descriptions by name, and the memory model's family kind for each.
KINDS = {"gpt2": "gpt2", "decoder": "gpt2", "encoder": "gpt2", "t5": "t5"}
#: Names a family may give that describe no model here, and why.
NOT_DESCRIBED = {"encoder-decoder": (
    "the memory model describes T5's encoder-decoder only ('t5', read from T5's settings: "
    "encoder and decoder lengths, feed-forward, relative-position buckets), not an "
    "encoder-decoder in general; a T5 family says 't5', another encoder-decoder None (no "
    "per-stage prediction, no plan)")}


@dataclass(frozen=True)
class LayerDescription:
    """What a decoder- (or encoder-) only family's layers are made of; the sizes come from
    the run configuration. The defaults are GPT-2's."""

    norm: str = "layernorm"
    """``layernorm`` or ``rmsnorm`` (its layers' and the final norm)."""
    mlp: str = "gelu"
    """``gelu`` (fc1, activation, fc2) or ``swiglu`` (gate and up GEMMs of one input, SiLU,
    their product, down)."""
    kv_heads: int = 0
    """Key / value heads of grouped-query attention (0: as many as the heads)."""
    positions: str = "learned"
    """``learned`` (a position table beside the word embedding) or ``rotary`` / ``none``."""
    bias: bool = True
    """Biases in the linear layers."""
    tied_embeddings: bool = True
    """The output layer is the word embedding (False: a weight of its own)."""
    dropout: bool = True
    """The layers apply ``--hidden-dropout`` and ``--attention-dropout`` (False: none)."""
    attention: str = ""
    """The attention the layers run when they do not follow ``--attention-backend``:
    ``sdpa`` or ``unfused`` ("" : the run's)."""
    mask_tensor: bool = False
    """The layers hand SDPA the ``[1, 1, s, s]`` mask as a tensor (it keeps it, per layer,
    as an additive mask in the compute dtype) rather than ``is_causal``."""
    separate_projections: bool = False
    """q, k and v (and a gated MLP's gate and up) are separate linear layers: under
    autocast each keeps its own compute-dtype copy of their common input."""

    def fields(self) -> Dict[str, Any]:
        """The :class:`~megatron.memory.spec.MemorySpec` fields this description sets."""
        out = dict(norm=self.norm, mlp=self.mlp, kv_heads=self.kv_heads,
                   positions=self.positions, bias=self.bias,
                   tie_embeddings=self.tied_embeddings, mask_tensor=self.mask_tensor,
                   separate_projections=self.separate_projections)
        if not self.dropout:
            out.update(hidden_dropout=0.0, attention_dropout=0.0)
        if self.attention:
            out["attention"] = self.attention
        return out


def describe(memory_model: Any, cfg: RunConfig) -> Optional[tuple]:
    """``(kind, MemorySpec field overrides)`` of a family's ``memory_model`` for a run, or
    None when it has none.

    Args:
        memory_model: the family's ``memory_model`` (see the module docstring).
        cfg: the run configuration (passed to a callable description).

    Raises:
        ConfigError: a description of another type, or an unknown name.
    """
    if memory_model is None:
        return None
    if isinstance(memory_model, str):
        if memory_model in NOT_DESCRIBED:
            raise ConfigError(f"memory model {memory_model!r}: {NOT_DESCRIBED[memory_model]} "
                              f"(docs/memory.md)")
        if memory_model not in KINDS:
            raise ConfigError(f"memory model {memory_model!r}: a family's memory_model is one "
                              f"of {', '.join(KINDS)}, a LayerDescription, a function of the "
                              f"run configuration returning one, or None (docs/memory.md)")
        return KINDS[memory_model], {}
    description = memory_model(cfg) if callable(memory_model) else memory_model
    if not isinstance(description, LayerDescription):
        raise ConfigError(f"memory model: the family's description is a "
                          f"{type(description).__name__}, not a "
                          f"megatron.memory.LayerDescription (docs/memory.md)")
    return "gpt2", description.fields()
