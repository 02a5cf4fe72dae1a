"""Checks of ``--context-parallel-size`` / ``--cp-comm-type`` (docs/scale_out.md), part of
the one validation pass: they run on every rank before any process group exists."""


def validate_context_parallel(args, problems):
    """Append a message for each context-parallel setting that cannot work.

    With cp > 1 each sequence is cut into ``2 cp`` equal chunks (rank r holds chunks r and
    2cp-1-r, so causal attention costs every rank the same): the sequence length must divide
    into them, and with --sequence-parallel each rank's ``s / cp`` tokens into tp shards.
    The all-to-all form gives each rank ``heads / (tp cp)`` whole heads. Attention dropout
    is not implemented inside the context-parallel attention.
    """
    cp = getattr(args, "context_parallel_size", 1)
    if cp <= 1:
        args.context_parallel_size = max(cp, 1)
        return
    s, tp = args.seq_length, args.tensor_model_parallel_size
    if s % (2 * cp):
        problems.append(f"--context-parallel-size {cp} cuts each sequence into 2 x {cp} = "
                        f"{2 * cp} equal chunks (load-balanced causal order), but "
                        f"--seq-length ({s}) is not divisible by {2 * cp}; use a length that "
                        f"is a multiple of {2 * cp} or another --context-parallel-size")
    elif args.sequence_parallel and (s // cp) % tp:
        problems.append(f"--sequence-parallel splits each rank's {s // cp} tokens (--seq-length "
                        f"{s} / --context-parallel-size {cp}) across the {tp} tensor-parallel "
                        f"ranks, which does not divide; make --seq-length a multiple of "
                        f"{cp * tp}")
    heads = args.num_attention_heads
    if args.cp_comm_type == "a2a" and heads % tp == 0 and (heads // tp) % cp:
        problems.append(f"--cp-comm-type a2a gives each of the {cp} context-parallel ranks "
                        f"whole heads, but each tensor-parallel rank has {heads // tp} "
                        f"(--num-attention-heads {heads} / tp {tp}), not divisible by {cp}; "
                        f"use --cp-comm-type p2p or all_gather, or a context-parallel size "
                        f"dividing {heads // tp}")
    if args.attention_dropout > 0:
        problems.append(f"--context-parallel-size {cp} does not implement attention dropout "
                        f"(--attention-dropout {args.attention_dropout}); set "
                        f"--attention-dropout 0, as long-context decoders do")
