"""Activation recompute: Megatron-LM's flags, and the older ``--checkpoint-activations``.

``--recompute-granularity``:

- ``full``: whole transformer layers are recomputed in the backward; with
  ``--recompute-method uniform`` (the default) each group of ``--recompute-num-layers``
  consecutive layers keeps only its input; with ``block`` the first
  ``--recompute-num-layers`` layers of every pipeline stage (of every model chunk when
  interleaved; of each stack of an encoder-decoder without a pipeline) keep only their
  input and the others keep everything;
- ``selective``: only the attention core (scores, softmax, attention dropout, context) is
  recomputed, where it keeps ``s x s`` tensors: Megatron's unfused path, and SDPA on the
  CPU with attention dropout (PyTorch's math path). SDPA's fused kernels keep no ``s x s``
  tensor, so there is nothing to recompute; the start-up log says which (:func:`describe`;
  the rule: :func:`megatron.model.recompute.core_keeps_scores`). Korthikanti et al. 2022,
  Section 4.2.

``--checkpoint-activations`` (with ``--checkpoint-num-layers``) is ``full`` + ``uniform``;
``--recompute-activations`` is ``selective`` (Megatron-LM's shortcut). After validation
``checkpoint_activations`` / ``checkpoint_num_layers`` say whether uniform groups are
recomputed and how large, so code that reads only them keeps its meaning.
"""
from typing import Any, List, Optional

GRANULARITIES = ("full", "selective")
METHODS = ("uniform", "block")


def add_recompute_flags(group) -> None:
    """Megatron-LM's recompute flags (the model group)."""
    group.add_argument("--recompute-granularity", choices=GRANULARITIES, default=None,
                       help="full: recompute whole layers in the backward; selective: only "
                            "the attention core (where it keeps s x s tensors: the unfused "
                            "path); docs/memory.md")
    group.add_argument("--recompute-method", choices=METHODS, default=None,
                       help="full recompute: uniform (default; groups of "
                            "--recompute-num-layers layers keep their input) or block (the "
                            "first --recompute-num-layers layers of each pipeline stage or "
                            "chunk)")
    group.add_argument("--recompute-num-layers", type=int, default=None,
                       help="uniform: layers per recomputed group; block: layers recomputed "
                            "per stage or chunk (default 1)")
    group.add_argument("--recompute-activations", action="store_true",
                       help="selective recompute (= --recompute-granularity selective)")


def check_recompute(args: Any, problems: List[str]) -> None:
    """Normalize the recompute flags (one meaning whatever the spelling) and list what is
    wrong: the granularity, method and layer count; ``checkpoint_activations`` and
    ``checkpoint_num_layers`` become full + uniform's.

    Args:
        args: the parsed namespace (changed in place).
        problems: messages are appended.
    """
    granularity = getattr(args, "recompute_granularity", None)
    method = getattr(args, "recompute_method", None)
    count = getattr(args, "recompute_num_layers", None)
    if getattr(args, "recompute_activations", False):
        if granularity == "full":
            problems.append("--recompute-activations is selective recompute but "
                            "--recompute-granularity is full; give one")
        granularity = "selective"
    if args.checkpoint_activations:
        if granularity == "selective":
            problems.append("--checkpoint-activations is full recompute but selective "
                            "recompute was asked for too; give one")
        elif method == "block":
            problems.append("--checkpoint-activations recomputes uniform groups; for block "
                            "give --recompute-granularity full --recompute-method block")
        granularity = granularity or "full"
        if count is None:
            count = args.checkpoint_num_layers
        elif count != args.checkpoint_num_layers != 1:
            problems.append(f"--checkpoint-num-layers ({args.checkpoint_num_layers}) and "
                            f"--recompute-num-layers ({count}) disagree; give one")
    if granularity == "selective" and (method is not None or count is not None):
        problems.append("--recompute-method and --recompute-num-layers choose layers for full "
                        "recompute; selective recomputes the attention core of every layer "
                        "(drop them, as Megatron-LM asks)")
    if granularity is None and (method is not None or count is not None):
        problems.append("--recompute-method / --recompute-num-layers need "
                        "--recompute-granularity full")
    if granularity == "full":
        method, count = method or "uniform", 1 if count is None else count
        if not 1 <= count <= args.num_layers:
            problems.append(f"--recompute-num-layers ({count}) must be between 1 and "
                            f"--num-layers ({args.num_layers})")
    else:
        method = count = None
    args.recompute_granularity, args.recompute_method = granularity, method
    args.recompute_num_layers = count
    args.checkpoint_activations = granularity == "full" and method == "uniform"
    if args.checkpoint_activations:
        args.checkpoint_num_layers = count
    elif not 1 <= args.checkpoint_num_layers <= args.num_layers:
        problems.append(f"--checkpoint-num-layers ({args.checkpoint_num_layers}) must be "
                        f"between 1 and --num-layers ({args.num_layers})")


def describe(granularity: Optional[str], method: Optional[str], count: Optional[int],
             keeps_scores: bool, backend: str) -> Optional[str]:
    """The start-up line about recompute (None without recompute).

    Args:
        granularity, method, count: the normalized flags.
        keeps_scores: :func:`megatron.model.recompute.core_keeps_scores` for the run.
        backend: the attention backend (resolved), named in the line.
    """
    if granularity == "full":
        if method == "uniform":
            return (f"> recompute: full, uniform: each group of {count} layer(s) keeps only "
                    f"its input and runs again in the backward")
        return (f"> recompute: full, block: the first {count} layer(s) of each stage or chunk "
                f"keep only their input and run again in the backward; the others keep "
                f"their activations")
    if granularity != "selective":
        return None
    if keeps_scores:
        why = "its s x s tensors" if backend == "unfused" else \
            "its s x s tensors (PyTorch's math path on the CPU)"
        return (f"> recompute: selective: each layer's attention core (scores, softmax, "
                f"dropout, context) runs again in the backward; {backend} attention would "
                f"keep {why}")
    return (f"> recompute: selective: nothing to recompute: {backend} attention keeps no s x s "
            f"tensor here (--attention-backend unfused is the path that keeps them)")
