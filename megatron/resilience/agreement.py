"""One rule for every decision that can differ between ranks: agree first, then fail together.

A checkpoint write, its publication, a free-memory check, a kernel build or a data check can
succeed on one rank and fail on another (a full disk on one node, a lost mount, a device with
less free memory). If the rank that failed raises alone, the others wait in their next
collective: on gloo they die a moment later with "connection closed by peer" and no word of
the cause, on NCCL they wait for the collective's timeout. So every such site calls
:func:`agree` with its own outcome: one collective in which each rank says whether it failed
and why; then, if any rank failed, every rank raises the same error, naming the ranks and
their causes, before anyone enters another collective. A local read whose value must be the
same on every rank (the tracker's iteration at resume) goes through :func:`agree_on_value`:
ranks that read different values fail together as well.

The collective (``all_gather_object``) is taken on the group the caller gives, which may be
a host (gloo) group on a background thread (the asynchronous checkpoint writer does so), and
costs one small exchange on a path that is rare (a save, start-up), never inside a step.
``tds.pipe``, which imports nothing of megatron, follows the same rule with its own exchange
where its pipeline contract is checked (tds/pipe/probe.py, tds/pipe/schedule_step.py).
"""
from typing import Any, Callable, List, Optional, Tuple, Type, Union

import torch.distributed as dist

from ..common.errors import MegatronError

#: How many distinct failing ranks a message lists before it says "and N more".
MAX_LISTED = 4


def describe(error: Union[BaseException, str, None]) -> Optional[str]:
    """A one-line cause for ``error``: a user error's message, else ``Type: message``."""
    if error is None:
        return None
    if isinstance(error, str):
        return error
    if isinstance(error, MegatronError):
        return str(error)
    return f"{type(error).__name__}: {error}"


def summary(what: str, failures: List[Tuple[int, str]]) -> str:
    """``what failed on rank 1: cause`` (ranks with the same cause share a clause)."""
    by_cause = {}
    for rank, cause in failures:
        by_cause.setdefault(cause, []).append(rank)
    clauses = []
    for cause, ranks in list(by_cause.items())[:MAX_LISTED]:
        clauses.append(f"{_ranks_in_words(ranks)}: {cause}")
    more = len(by_cause) - MAX_LISTED
    tail = f"; and {more} more cause(s) on other ranks" if more > 0 else ""
    return f"{what} failed on {'; '.join(clauses)}{tail}"


def gather_failures(error: Union[BaseException, str, None], group=None
                    ) -> List[Tuple[int, str]]:
    """Collective over ``group``: every rank's failure, as ``(global rank, cause)`` pairs.

    The collective under :func:`agree`, for a site whose agreed outcome is not an error
    (the fused kernels: if any rank could not build them, every rank falls back).

    Args:
        error: this rank's failure (an exception or a message), or None.
        group: the process group (default: the world); every rank of it must call.
    """
    cause = describe(error)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return [(rank, cause)] if cause is not None else []
    causes = [None] * dist.get_world_size(group)
    dist.all_gather_object(causes, cause, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(causes))
    return [(rank, c) for rank, c in zip(ranks, causes) if c is not None]


def agree(error: Union[BaseException, str, None], what: str, group=None,
          error_type: Type[Exception] = MegatronError, hint: str = "") -> None:
    """Collective over ``group``: raise the same error on every rank if any rank failed.

    Args:
        error: this rank's failure (an exception or a message), or None.
        what: the decision, for the message ("writing the checkpoint of iteration 4").
        group: the process group (default: the world); every rank of it must call.
        error_type: the type raised on every rank (a :class:`MegatronError` subclass for a
            failure the user can fix; the entry script prints its one line).
        hint: what the user can do, appended to the message.

    Raises:
        ``error_type``: ``"<what> failed on rank <r>: <cause>"``, on every rank of the group
            (chained to this rank's own exception where it has one); on the failing rank,
            an exception that is neither a user error nor an ``OSError`` (a bug) is
            re-raised as it is, after the others have been told, to keep its traceback.
    """
    _raise_failures(error, gather_failures(error, group), what, error_type, hint)


def _raise_failures(error, failures, what, error_type, hint):
    if not failures:
        return
    if isinstance(error, BaseException) and not isinstance(error, (MegatronError, OSError)):
        raise error
    message = summary(what, failures) + (f"; {hint}" if hint else "")
    if isinstance(error, BaseException):
        raise error_type(message) from error
    raise error_type(message)


def agree_on_value(value: Any, error: Union[BaseException, str, None], what: str,
                   describe_value: Callable[[Any], str] = repr, group=None,
                   error_type: Type[Exception] = MegatronError, hint: str = "") -> Any:
    """Collective over ``group``: every rank's outcome of a local read (a tracker file, a
    folder's contents), raised on every rank if any rank failed or if the ranks read
    different values; else the value, the same on every rank.

    Args:
        value: what this rank read (picklable, compared with ``==``); ignored when
            ``error`` is set.
        error: this rank's failure (an exception or a message), or None.
        what: the read, for the message ("reading the tracker of /ckpt").
        describe_value: a value in words, for the message when the ranks disagree.
        group: the process group (default: the world); every rank of it must call.
        error_type: the type raised on every rank.
        hint: what the user can do when the ranks disagree, appended to that message (a
            failure's message is its cause's, as :func:`agree`'s).

    Returns:
        ``value`` (equal on every rank).

    Raises:
        ``error_type``: as :func:`agree` when a rank failed; ``"<what>: the ranks disagree:
            <value> on rank 0; <other value> on rank 1"`` when they read different values.
    """
    cause = describe(error)
    mine = (cause, None if cause is not None else value)
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        outcomes = [(dist.get_rank() if dist.is_initialized() else 0, mine)]
    else:
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        ranks = dist.get_process_group_ranks(group) if group is not None else range(len(every))
        outcomes = list(zip(ranks, every))
    _raise_failures(error, [(r, c) for r, (c, _) in outcomes if c is not None], what,
                    error_type, "")
    seen: List[Tuple[Any, List[int]]] = []  # (value, ranks), by ==: values need no hash
    for rank, (_, read) in outcomes:
        for known, ranks in seen:
            if known == read:
                ranks.append(rank)
                break
        else:
            seen.append((read, [rank]))
    if len(seen) > 1:
        clauses = [f"{describe_value(v)} on {_ranks_in_words(r)}" for v, r in seen[:MAX_LISTED]]
        more = len(seen) - MAX_LISTED
        tail = f"; and {more} more value(s) on other ranks" if more > 0 else ""
        raise error_type(f"{what}: the ranks disagree: {'; '.join(clauses)}{tail}"
                         + (f"; {hint}" if hint else ""))
    return value


def _ranks_in_words(ranks):
    return f"rank {ranks[0]}" if len(ranks) == 1 else \
        "ranks " + ", ".join(str(r) for r in ranks)


def agree_on_call(what: str, fn, *args, group=None,
                  error_type: Type[Exception] = MegatronError, hint: str = "", **kwargs):
    """Run ``fn(*args, **kwargs)`` on this rank, then :func:`agree` on its outcome.

    Args:
        what: the decision, for the message.
        fn: the local action (may do nothing on ranks with nothing to do).
        group: the process group (default: the world).
        error_type: the type raised on every rank when any rank failed.
        hint: what the user can do, appended to the message.

    Returns:
        ``fn``'s result on this rank.
    """
    result, error = None, None
    try:
        result = fn(*args, **kwargs)
    except Exception as exc:  # every rank learns of it below, bugs included
        error = exc
    agree(error, what, group, error_type, hint)
    return result
