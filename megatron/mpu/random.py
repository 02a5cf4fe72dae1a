"""Random-number streams for tensor parallelism, and activation checkpointing that replays them.

Two streams, as in Megatron-LM:

- the *default* generator, seeded identically on every tensor-parallel rank: dropout on
  replicated activations (hidden states) draws the same mask on every rank;
- the *model-parallel* stream, a per-tp-rank seed kept by :class:`RNGStatesTracker`:
  dropout on split activations (attention probabilities) differs between ranks, as it
  would across the columns of the serial model.

The tracker forks the generator of the compute device: the CUDA generator on a GPU,
the CPU generator otherwise (so everything here works on CPU with gloo).
"""
import contextlib

import torch

from . import parallel_state as ps
from .split_1d import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks
from .utils import get_device

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
#: Offset between the data-parallel seed and the model-parallel seeds (Megatron's value).
MODEL_PARALLEL_SEED_OFFSET = 2718


def _uses_cuda():
    return get_device().type == "cuda"


def _get_device_rng_state():
    return torch.cuda.get_rng_state() if _uses_cuda() else torch.get_rng_state()


def _set_device_rng_state(state):
    if _uses_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states that can be swapped in for a block of code.

    ``fork(name)`` swaps the device generator to the tracked state, runs the block, saves
    the advanced state back, and restores the original generator state.
    """

    def __init__(self):
        self.states_ = {}
        self.seeds_ = set()

    def reset(self):
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self):
        """A copy of the name -> state dict (for checkpoints and recompute)."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states):
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name, seed):
        """Track a new stream ``name`` seeded with ``seed``.

        Raises:
            ValueError: the name or the seed is already tracked.
        """
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked")
        self.seeds_.add(seed)
        original = _get_device_rng_state()
        if _uses_cuda():
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states_[name] = _get_device_rng_state()
        _set_device_rng_state(original)

    @contextlib.contextmanager
    def fork(self, name=_MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the block with stream ``name`` as the device generator."""
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not tracked: call "
                           "model_parallel_cuda_manual_seed(seed) first")
        original = _get_device_rng_state()
        _set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_device_rng_state()
            _set_device_rng_state(original)


_RNG_TRACKER = RNGStatesTracker()


def get_cuda_rng_tracker():
    """The process-wide tracker (Megatron's name; it tracks the CPU generator without CUDA)."""
    return _RNG_TRACKER


def model_parallel_cuda_manual_seed(seed):
    """Seed both streams for this rank.

    The default generator gets ``seed`` (the same on every tensor-parallel rank); the
    model-parallel stream gets ``seed + 2718 + tp_rank``.

    Args:
        seed: base seed; must be the same on all ranks of a tensor-parallel group.
    """
    tp_seed = seed + MODEL_PARALLEL_SEED_OFFSET + ps.get_tensor_model_parallel_rank()
    torch.manual_seed(seed)  # CPU and every CUDA device
    _RNG_TRACKER.reset()
    _RNG_TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, tp_seed)


def model_parallel_dropout(dropout, input_, per_rank):
    """``dropout(input_)``, on the model-parallel stream when ``per_rank``.

    The stream is swapped in (``fork``) only where a mask is drawn: ``dropout.p > 0``, in
    training, and ``per_rank``, i.e. the activation is split across tensor-parallel ranks
    (heads, the feed-forward width) so each rank must draw its own mask. With one rank in
    the group nothing is split and the default stream serves. Everywhere else no generator
    state is read, which matters to ``torch.compile``: ``torch.get_rng_state`` cannot be
    traced: each fork is a graph break in a compiled layer (:func:`in_model_parallel_stream`).

    Args:
        dropout: the ``nn.Dropout`` module (its ``p`` and ``training``).
        input_: activation.
        per_rank: the activation is this rank's part (tensor-parallel size > 1).
    """
    if not dropout.training or dropout.p == 0:
        return input_
    if not per_rank:
        return dropout(input_)
    return in_model_parallel_stream(dropout, input_)


def in_model_parallel_stream(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with the model-parallel stream as the device's generator.

    Outside ``torch.compile`` this is ``with get_cuda_rng_tracker().fork(): fn(...)``.
    Inside, once :func:`fork_eagerly_under_compile` has run (``--compile`` does), the call
    runs eagerly: the fork's ``torch.get_rng_state`` / ``set_rng_state`` cannot be traced,
    and leaving the whole call to eager mode costs one graph break per fork instead of the
    five that tracing into the fork's context manager gives.

    Args:
        fn: what draws random numbers (a dropout module, SDPA with dropout).
        args, kwargs: its arguments.
    """
    if _EAGER_FORK is not None and torch.compiler.is_compiling():
        return _EAGER_FORK(fn, *args, **kwargs)
    with _RNG_TRACKER.fork():
        return fn(*args, **kwargs)


def _forked_call(fn, *args, **kwargs):
    with _RNG_TRACKER.fork():
        return fn(*args, **kwargs)


_EAGER_FORK = None
"""``torch.compiler.disable(_forked_call)`` once :func:`fork_eagerly_under_compile` ran."""


def fork_eagerly_under_compile():
    """Make :func:`in_model_parallel_stream` (and the context-parallel attention) one eager
    call inside compiled code.

    Not done at import: ``torch.compiler.disable`` imports dynamo (about a second per
    process, on every rank of every run, compiled or not). Idempotent;
    :func:`megatron.model.compile.prepare_for_compile` calls it.
    """
    global _EAGER_FORK
    if _EAGER_FORK is None:
        _EAGER_FORK = torch.compiler.disable(_forked_call)
    from .cp_attention import eager_under_compile

    eager_under_compile()  # the context-parallel attention: one eager call too


# Device-neutral names.
get_rng_tracker = get_cuda_rng_tracker
model_parallel_manual_seed = model_parallel_cuda_manual_seed


class CheckpointFunction(torch.autograd.Function):
    """Drop a block's activations in forward and recompute them in backward.

    The CPU, device and tracker RNG states are captured before the forward and restored
    for the recompute, so dropout draws the same masks and gradients are bit-identical
    to a run without recompute. Autocast state is replayed as well.
    """

    @staticmethod
    def forward(ctx, run_function, distribute, *args):
        ctx.run_function = run_function
        ctx.rng = get_all_rng_states()
        ctx.autocast = _capture_autocast()
        with torch.no_grad():
            outputs = run_function(*args)
        ctx.tensor_slots = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.others = [None if torch.is_tensor(a) else a for a in args]
        saved = [args[i] for i in ctx.tensor_slots]
        # v2.6's distribute_saved_activations: keep 1/tp of the first input (replicated
        # on the tp ranks) and all-gather it for the recompute.
        ctx.distributed_shape = None
        if distribute and ctx.tensor_slots[:1] == [0]:
            ctx.distributed_shape = saved[0].shape
            ctx.first_requires_grad = saved[0].requires_grad
            saved[0] = split_tensor_into_1d_equal_chunks(saved[0].detach(), new_buffer=True)
        ctx.save_for_backward(*saved)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("activation checkpointing does not work with "
                               "torch.autograd.grad(); use .backward()")
        args = list(ctx.others)
        tensors = list(ctx.saved_tensors)
        if ctx.distributed_shape is not None:
            tensors[0] = gather_split_1d_tensor(tensors[0]).view(ctx.distributed_shape)
            tensors[0].requires_grad_(ctx.first_requires_grad)
        for slot, tensor in zip(ctx.tensor_slots, tensors):
            args[slot] = tensor.detach().requires_grad_(tensor.requires_grad)
        saved = get_all_rng_states()
        set_all_rng_states(ctx.rng)
        try:
            with torch.enable_grad(), _autocast_from(ctx.autocast):
                outputs = ctx.run_function(*args)
        finally:
            set_all_rng_states(saved)
        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(a.grad if torch.is_tensor(a) else None for a in args)
        return (None, None) + grads


def init_checkpointed_activations_memory_buffer():
    """Megatron v2.0-v2.5's call that preallocated one buffer for the distributed
    checkpointed activations; here a no-op, kept so v2 code that calls it runs unchanged.

    Megatron v2 copied each checkpointed layer's ``1/tp`` slice of its input into a buffer
    sized from ``micro_batch_size x max_position_embeddings x hidden / tp x checkpointed
    layers`` (read from its global args) to avoid fragmenting GPU memory.
    :func:`checkpoint` here keeps that slice in a tensor of its own, freed by autograd after
    the backward, and needs no run-wide sizes, so there is no buffer to allocate.
    """


def reset_checkpointed_activations_memory_buffer():
    """Megatron v2.0-v2.5's per-step reset of the checkpointed-activations buffer; a no-op
    here (see :func:`init_checkpointed_activations_memory_buffer`: there is no buffer)."""


def get_all_rng_states():
    """CPU, device and tracker generator states (to replay or undo random draws)."""
    return (torch.get_rng_state(),
            torch.cuda.get_rng_state() if _uses_cuda() else None,
            _RNG_TRACKER.get_states())


def set_all_rng_states(states):
    """Restore what :func:`get_all_rng_states` returned."""
    cpu, device, tracked = states
    torch.set_rng_state(cpu)
    if device is not None:
        torch.cuda.set_rng_state(device)
    _RNG_TRACKER.set_states(tracked)


def _capture_autocast():
    device_type = get_device().type
    if torch.is_autocast_enabled(device_type):
        return device_type, torch.get_autocast_dtype(device_type)
    return None


def _autocast_from(state):
    if state is None:
        return contextlib.nullcontext()
    device_type, dtype = state
    return torch.autocast(device_type=device_type, dtype=dtype)


def checkpoint(function, *args, distribute_saved_activations=None):
    """Run ``function(*args)`` without keeping its activations; recompute them in backward.

    Both call shapes work: today's ``checkpoint(fn, *args)`` and Megatron v2.6's
    ``checkpoint(fn, distribute_saved_activations, *args)``. The rule: a Python ``bool``
    as the first argument after ``fn`` is v2.6's flag, never an argument of ``fn``
    (activations are tensors). To pass a bool to ``fn`` itself, give the flag first:
    ``checkpoint(fn, False, True, x)``, or the keyword.

    Args:
        function: the block to run (e.g. a slice of transformer layers).
        *args: its arguments; tensors among them are saved, everything else is kept as is.
        distribute_saved_activations: keep only ``1/tp`` of the first argument (which must
            be the same on every tensor-parallel rank, e.g. the hidden states) and
            all-gather it for the recompute; its element count must divide by tp.
    """
    if distribute_saved_activations is None:
        if args and isinstance(args[0], bool):
            distribute_saved_activations, args = args[0], args[1:]
        else:
            distribute_saved_activations = False
    if torch.compiler.is_compiling() and not distribute_saved_activations:
        return _traced_checkpoint(function, *args)
    return CheckpointFunction.apply(function, bool(distribute_saved_activations), *args)


def _traced_checkpoint(function, *args):
    """Recompute inside compiled code: torch's non-reentrant checkpoint, which dynamo keeps
    in the graph (a region whose saved activations are only its inputs; AOTAutograd's
    partitioner recomputes the rest in the backward). The RNG states need no replay: the
    partitioner never recomputes a random draw, it keeps the draw's result (a dropout mask)
    instead. :class:`CheckpointFunction` would break the graph: it reads and sets the
    generators' states, which dynamo cannot trace."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    return torch_checkpoint(function, *args, use_reentrant=False)
