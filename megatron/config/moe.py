"""Mixture-of-experts flags (Megatron-LM's names) and their checks, part of the one validation
pass: they run on every rank before any process group exists (docs/moe.md).

    --num-experts 8 --moe-router-topk 2 --expert-model-parallel-size 2 \\
    --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-layer-freq 2

``--moe-layer-freq`` is an integer N (every N-th layer, counting from the first, is an MoE
layer; 1: all) or a list of 0/1 per layer, in Megatron-LM's forms ``[1,0,1,0]`` or
``([0]+[1]*3)*2``. For an encoder-decoder it applies to each stack.
"""
import ast

from ..common.errors import ConfigError

#: The training step the run goes through implements the MoE contract: expert gradients
#: reduced over the expert-data-parallel group (and counted once in the norm),
#: ``mpu.moe.set_aux_loss_scale`` each step, ``mpu.moe.update_expert_bias`` each step.
#: Until it does, the runs it would silently get wrong are refused (:func:`validate_moe`).
TRAINING_STEP_HAS_MOE = True


def add_moe_args(parser):
    """The "mixture of experts" group."""
    g = parser.add_argument_group("mixture of experts (docs/moe.md)")
    g.add_argument("--num-experts", type=int, default=None,
                   help="experts per MoE layer (default: none, dense feed-forward layers)")
    g.add_argument("--expert-model-parallel-size", type=int, default=1,
                   help="ranks splitting each MoE layer's experts, carved out of the data x "
                        "context-parallel ranks (divides dp x cp and --num-experts)")
    g.add_argument("--moe-router-topk", type=int, default=2, help="experts per token (k)")
    g.add_argument("--moe-router-load-balancing-type", default="aux_loss",
                   choices=["aux_loss", "seq_aux_loss", "none"],
                   help="aux_loss: Switch / GShard over the micro-batch; seq_aux_loss: per "
                        "sequence; none")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0,
                   help="coefficient of the load-balancing loss (1e-2 is usual)")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None,
                   help="coefficient of the router z-loss (ST-MoE; 1e-3 is usual); default off")
    g.add_argument("--moe-router-score-function", default="softmax",
                   choices=["softmax", "sigmoid"])
    g.add_argument("--moe-router-pre-softmax", action="store_true",
                   help="softmax over all experts before the top-k (Switch's top-1 gate)")
    g.add_argument("--moe-router-enable-expert-bias", action="store_true",
                   help="aux-loss-free balancing (DeepSeek-V3): a per-expert routing bias "
                        "moved each step by the observed loads")
    g.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    g.add_argument("--moe-expert-capacity-factor", type=float, default=None,
                   help="capacity per expert = ceil(tokens x k / experts x this), per rank; "
                        "tokens over it are dropped (default: dropless)")
    g.add_argument("--moe-token-drop-policy", default="probs", choices=["probs", "position"],
                   help="over capacity, keep the highest probabilities or the first tokens")
    g.add_argument("--moe-token-dispatcher-type", default="alltoall",
                   choices=["alltoall", "allgather"],
                   help="how tokens reach other ranks' experts (Megatron-LM's default is "
                        "allgather; here alltoall, which it recommends with ep > 1)")
    g.add_argument("--moe-grouped-gemm", action="store_true",
                   help="the local experts in one torch._grouped_mm (where it runs)")
    g.add_argument("--moe-layer-freq", default="1",
                   help="N: every N-th layer is MoE; or a 0/1 list per layer, e.g. [1,0,1,0]")
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None,
                   help="each expert's feed-forward width (default --ffn-hidden-size)")
    g.add_argument("--moe-shared-expert-intermediate-size", type=int, default=None,
                   help="width of the shared experts every token goes through (default none)")


def _list_value(node):
    """A 0/1 list from ``[..]``, ``+`` and ``*`` only (no eval)."""
    if isinstance(node, ast.List):
        values = [_list_value(e) if not isinstance(e, ast.Constant) else e.value
                  for e in node.elts]
        if any(v not in (0, 1) or isinstance(v, bool) for v in values):
            raise ValueError("entries must be 0 or 1")
        return values
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _list_value(node.left) + _list_value(node.right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
        left, right = node.left, node.right
        if isinstance(left, ast.Constant):
            left, right = right, left
        if isinstance(right, ast.Constant) and isinstance(right.value, int):
            return _list_value(left) * right.value
    raise ValueError("only lists of 0/1, + and * by an integer")


def moe_layer_pattern(freq, num_layers: int) -> list:
    """Which of ``num_layers`` layers are MoE layers (a list of bools).

    Args:
        freq: ``--moe-layer-freq``: an int (or its string) N, or a 0/1 list expression.
        num_layers: layers in the stack.

    Raises:
        ConfigError: an unreadable value, N < 1, or a list of another length.
    """
    text = str(freq).strip()
    try:
        if text.lstrip("-").isdigit():
            n = int(text)
            if n < 1:
                raise ValueError("an integer must be >= 1")
            return [i % n == 0 for i in range(num_layers)]
        pattern = _list_value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError) as exc:
        raise ConfigError(f"--moe-layer-freq {text!r}: {exc}; give an integer N (every N-th "
                          f"layer) or a 0/1 list such as [1,0,1,0] or ([0]+[1]*3)*2") from None
    if len(pattern) != num_layers:
        raise ConfigError(f"--moe-layer-freq {text!r} has {len(pattern)} entries but the stack "
                          f"has {num_layers} layers (--num-layers); give one 0/1 per layer")
    return [bool(v) for v in pattern]


def _routing_problems(args, problems):
    from ..mpu.moe.config import moe_config_problems

    args.moe_z_loss_coeff = args.moe_z_loss_coeff or 0.0
    args.moe_ffn_hidden_size = args.moe_ffn_hidden_size or args.ffn_hidden_size
    fields = dict(num_experts=args.num_experts, topk=args.moe_router_topk,
                  capacity_factor=args.moe_expert_capacity_factor,
                  aux_loss_coeff=args.moe_aux_loss_coeff, z_loss_coeff=args.moe_z_loss_coeff,
                  bias_update_rate=args.moe_router_bias_update_rate,
                  ffn_hidden_size=args.moe_ffn_hidden_size, hidden_size=args.hidden_size,
                  shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
                  score_function=args.moe_router_score_function,
                  load_balancing_type=args.moe_router_load_balancing_type,
                  dispatcher=args.moe_token_dispatcher_type,
                  token_drop_policy=args.moe_token_drop_policy, activation="gelu",
                  pre_softmax=args.moe_router_pre_softmax)
    problems.extend(moe_config_problems(type("Flags", (), fields)))


def _step_problems(args, problems, ep):
    """What the training step of this build would get wrong (:data:`TRAINING_STEP_HAS_MOE`)."""
    if args.deepspeed and args.pipeline_model_parallel_size <= 1:
        problems.append("MoE layers with --deepspeed: DeepSpeed's engine takes parameters "
                        "marked allreduce=False for its own MoE parameters; drop --deepspeed "
                        "(the project's step: --use-distributed-optimizer for ZeRO-1)")
    if TRAINING_STEP_HAS_MOE:
        return
    later = "needs the training step that implements the MoE contract (docs/moe.md), not in " \
            "this build yet"
    if ep > 1:
        problems.append(f"--expert-model-parallel-size {ep} {later}: the step would average "
                        f"different experts' gradients over data-parallel ranks; use 1")
    losses = (args.moe_router_load_balancing_type != "none" and args.moe_aux_loss_coeff > 0) \
        or args.moe_z_loss_coeff > 0
    if losses and (args.gas > 1 or args.fp16):
        problems.append(f"MoE routing losses (--moe-aux-loss-coeff / --moe-z-loss-coeff) with "
                        f"gradient accumulation (gas {args.gas}) or --fp16 {later}: their "
                        f"gradient would miss the step's 1/gas and loss scale; use gas 1 and "
                        f"fp32/bf16, or coefficients 0")
    if args.moe_router_enable_expert_bias:
        problems.append(f"--moe-router-enable-expert-bias {later}: nothing would update the "
                        f"bias; drop it")
    if args.pipeline_model_parallel_size > 1 and not args.deepspeed:
        problems.append(f"MoE layers at --pipe-parallel-size "
                        f"{args.pipeline_model_parallel_size} {later}: today's pipeline engine "
                        f"is DeepSpeed's, which takes the experts for its own MoE parameters; "
                        f"use pp 1")


def validate_moe(args, problems):
    """Append a message for each MoE setting that cannot work; fill the derived values.

    Refused before any group is built: experts not divisible by ep, ep not dividing
    dp x cp, top-k above the expert count, a capacity factor <= 0, a bad layer pattern,
    MoE flags without ``--num-experts``, sequence parallelism with MoE. (A family whose
    layers have no MoE block is refused by the family check: ``FEATURES["moe"]``.)
    """
    ep = args.expert_model_parallel_size
    if args.num_experts is None:
        if ep != 1:
            problems.append(f"--expert-model-parallel-size {ep} needs --num-experts (there are "
                            f"no experts to split); drop it or add MoE layers")
        return
    if ep < 1:
        problems.append(f"--expert-model-parallel-size must be >= 1, got {ep}")
        return
    _routing_problems(args, problems)
    if args.num_experts >= 1 and args.num_experts % ep:
        problems.append(f"--num-experts ({args.num_experts}) is not divisible by "
                        f"--expert-model-parallel-size ({ep}); every expert-parallel rank "
                        f"holds the same number of experts")
    dp_cp = args.data_parallel_size * args.context_parallel_size
    if dp_cp % ep:
        problems.append(f"--expert-model-parallel-size ({ep}) does not divide the data-parallel "
                        f"x context-parallel size ({args.data_parallel_size} x "
                        f"{args.context_parallel_size} = {dp_cp}): the expert-parallel group "
                        f"is carved out of those ranks; launch more processes or lower ep")
    tp = args.tensor_model_parallel_size
    if args.moe_ffn_hidden_size and args.moe_ffn_hidden_size % tp:
        problems.append(f"--moe-ffn-hidden-size ({args.moe_ffn_hidden_size}) is not divisible "
                        f"by the tensor-model-parallel size ({tp}): each expert's FFN is split "
                        f"over tp")
    if args.deepspeed:
        problems.append("--deepspeed with --num-experts: DeepSpeed's engine takes parameters "
                        "marked allreduce=False (the experts) for its own MoE's and fails; use "
                        "the project's data parallelism (drop --deepspeed)")
    if args.sequence_parallel:
        problems.append("--sequence-parallel with --num-experts is not supported yet (the MoE "
                        "block routes whole sequences on every tp rank); drop "
                        "--sequence-parallel")
    try:
        moe_layer_pattern(args.moe_layer_freq, args.num_layers)
    except ConfigError as exc:
        problems.append(str(exc))
    _step_problems(args, problems, ep)
