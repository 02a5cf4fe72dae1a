"""The settings of one mixture-of-experts block (Megatron-core's names, ``moe_*`` flags).

:class:`MoEConfig` is what a model hands :class:`~megatron.mpu.moe.MoELayer`; the run's flags
build it (``megatron.config.moe``), a user's model may build it by hand. It checks itself
when built, so a bad value fails before any weight is drawn.
"""
from dataclasses import dataclass
from typing import Optional

from ...common.errors import ConfigError

SCORE_FUNCTIONS = ("softmax", "sigmoid")
LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "none")
DISPATCHERS = ("alltoall", "allgather")
DROP_POLICIES = ("probs", "position")
ACTIVATIONS = ("gelu", "relu", "swiglu", "geglu")
GATED = ("swiglu", "geglu")


@dataclass(frozen=True)
class MoEConfig:
    """One MoE block: router, balancing, capacity, experts, dispatch.

    Attributes mirror Megatron-LM's flags (``--num-experts`` -> ``num_experts``,
    ``--moe-router-topk`` -> ``topk``, ...); docs/moe.md is the reference.
    """

    num_experts: int
    hidden_size: int
    ffn_hidden_size: int
    """Each expert's feed-forward width (``--moe-ffn-hidden-size``; default the model's)."""
    topk: int = 2
    score_function: str = "softmax"
    """``softmax`` or ``sigmoid`` (``--moe-router-score-function``)."""
    pre_softmax: bool = False
    """Softmax over all experts before the top-k (``--moe-router-pre-softmax``: Switch's
    top-1 probability); False: top-k of the logits, softmax over the k (Mixtral)."""
    load_balancing_type: str = "aux_loss"
    """``aux_loss`` (Switch / GShard, over the micro-batch's tokens), ``seq_aux_loss`` (per
    sequence, DeepSeek) or ``none``."""
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    """Router z-loss (ST-MoE): ``coeff * mean(logsumexp(logits)^2)``; 0 = off."""
    enable_expert_bias: bool = False
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the routing scores,
    updated outside autograd by :func:`~megatron.mpu.moe.update_expert_bias`."""
    bias_update_rate: float = 1e-3
    capacity_factor: Optional[float] = None
    """None: dropless. Otherwise each expert takes at most ``ceil(T k / E * factor)`` of the
    T tokens a rank routes per micro-batch (per rank, as Megatron-core); the rest drop."""
    token_drop_policy: str = "probs"
    """Which tokens an over-full expert keeps: the highest ``probs`` (Megatron-core's default)
    or the first by ``position`` (the Switch Transformer's)."""
    dispatcher: str = "alltoall"
    """How tokens reach the experts of other ranks: ``alltoall`` or ``allgather``."""
    grouped_gemm: bool = False
    """Compute the local experts with ``torch._grouped_mm`` where it runs (else the
    per-expert loop, the reference path)."""
    shared_expert_intermediate_size: Optional[int] = None
    """Width of the shared experts every token goes through (Qwen-MoE, DeepSeek); None: none."""
    activation: str = "gelu"
    """``gelu`` (tanh form, GPT-2), ``relu`` (T5 / Switch), ``swiglu`` (Mixtral), ``geglu``."""
    init_method_std: float = 0.02
    output_init_std: Optional[float] = None
    """Std of each expert's second projection (default ``init_method_std``)."""

    def __post_init__(self):
        problems = moe_config_problems(self)
        if problems:
            raise ConfigError("invalid MoE configuration:\n  " + "\n  ".join(problems))

    @property
    def gated(self) -> bool:
        """Whether the first projection is ``[gate; up]`` (2 x ffn outputs)."""
        return self.activation in GATED


def _choice(problems, value, choices, flag):
    if value not in choices:
        problems.append(f"{flag} must be one of {', '.join(choices)}, got {value!r}")


def moe_config_problems(c) -> list:
    """One message per bad setting of ``c`` (an :class:`MoEConfig` or anything with its
    attributes), naming Megatron-LM's flag."""
    problems = []
    if c.num_experts < 1:
        problems.append(f"--num-experts must be >= 1, got {c.num_experts}")
    if not 1 <= c.topk <= max(c.num_experts, 1):
        problems.append(f"--moe-router-topk ({c.topk}) must be between 1 and --num-experts "
                        f"({c.num_experts}): a token cannot go to more experts than exist")
    if c.capacity_factor is not None and not c.capacity_factor > 0:
        problems.append(f"--moe-expert-capacity-factor must be > 0 (or left out for dropless "
                        f"routing), got {c.capacity_factor}")
    for value, flag in ((c.aux_loss_coeff, "--moe-aux-loss-coeff"),
                        (c.z_loss_coeff, "--moe-z-loss-coeff"),
                        (c.bias_update_rate, "--moe-router-bias-update-rate")):
        if not value >= 0:
            problems.append(f"{flag} must be >= 0, got {value}")
    for value, flag in ((c.ffn_hidden_size, "--moe-ffn-hidden-size"),
                        (c.hidden_size, "--hidden-size")):
        if value is None or value < 1:
            problems.append(f"{flag} must be >= 1, got {value}")
    shared = c.shared_expert_intermediate_size
    if shared is not None and shared < 1:
        problems.append(f"--moe-shared-expert-intermediate-size must be >= 1, got {shared}")
    _choice(problems, c.score_function, SCORE_FUNCTIONS, "--moe-router-score-function")
    _choice(problems, c.load_balancing_type, LOAD_BALANCING_TYPES,
            "--moe-router-load-balancing-type")
    _choice(problems, c.dispatcher, DISPATCHERS, "--moe-token-dispatcher-type")
    _choice(problems, c.token_drop_policy, DROP_POLICIES, "--moe-token-drop-policy")
    _choice(problems, c.activation, ACTIVATIONS, "the experts' activation")
    if c.pre_softmax and c.score_function != "softmax":
        problems.append("--moe-router-pre-softmax needs --moe-router-score-function softmax")
    return problems
