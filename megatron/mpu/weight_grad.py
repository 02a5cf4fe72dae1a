"""Deferred weight gradients: the B / W split of zero-bubble pipeline schedules.

Qi et al. 2024, "Zero Bubble Pipeline Parallelism" (ICLR 2024): a linear layer's backward is
two GEMMs, ``dX = dY W`` (B: what the previous pipeline stage waits for) and ``dW = dY^T X``
(W: needed only by the optimizer). A schedule runs B at once and W later, in slots that would
otherwise be idle. The split is made where the GEMMs are: the mpu linear layers, once
:func:`set_weight_grad_deferral` has given their weights a :class:`WeightGradStore`, run
their matmul through :class:`LinearWithDeferredWeightGrad`, whose backward computes ``dX``
(and the bias gradient, cheap) now and, while the store is recording, appends the ``dW``
GEMM to the store instead of returning it. ``store.flush(key)`` runs that work later and
accumulates into ``param.grad`` as autograd's ``AccumulateGrad`` would, so the gradients
are bit-identical to an unsplit backward (docs/mpu.md, "Deferred weight gradients").

The recording key lives on the store object, not in a context variable or thread-local:
autograd runs the backward of CUDA tensors on its own device threads, which do not see
the caller's context variables.

Inside ``torch.compile`` (``--compile`` with a zero-bubble schedule) the GEMM is
:class:`_TracedDeferredLinear`: its forward is traced into the graph, and its backward calls
one opaque operator, ``torch.ops.megatron_tds.deferred_linear_backward``, which computes
``dX`` and, at run time, hands ``dW``'s inputs to the store the same way (or computes ``dW``
at once outside a record). The compiled backward (the B pass) is then one graph; the W pass
runs the store's GEMMs as in eager mode, the same GEMM as the eager split. The graph must
not reuse the memory of a tensor the operator handed to the store: regions holding such
layers are compiled without inductor's buffer reuse (:data:`COMPILE_OPTIONS`).
"""
import contextlib
from typing import Callable, Dict, Hashable, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .utils import autocast_linear_inputs  # noqa: F401  (mpu's; imported from here before)

#: Parameter attribute naming the store its linear layers defer to (absent: no deferral).
STORE_ATTRIBUTE = "weight_grad_store"
#: Parameter attribute: the parameter's index in :data:`_SLOTS` (what compiled code passes
#: to the deferring operator, a constant of the graph).
SLOT_ATTRIBUTE = "weight_grad_slot"
#: Parameter attribute: ``f(param)`` called after :func:`accumulate_grad` added to its gradient
#: (what autograd's post-accumulate-grad hooks are for the backward; the data-parallel
#: wrapper starts a bucket's reduction from it, megatron/distributed).
GRAD_READY_HOOK = "grad_ready_hook"
#: Inductor options for a compiled region holding deferring layers: the operator keeps
#: references to ``dY`` and ``X`` for the W pass, so their memory must not be handed to
#: another buffer of the graph (buffer reuse, in-place buffers) after the operator ran.
COMPILE_OPTIONS = {"allow_buffer_reuse": False, "inplace_buffers": False}


class _Slot(NamedTuple):
    store: "WeightGradStore"
    param: torch.Tensor
    group: Optional[object]  # the layer's tensor-parallel group (a sequence-parallel W's)


#: slot -> (store, parameter, group), filled by :func:`set_weight_grad_deferral`.
_SLOTS: Dict[int, _Slot] = {}


class WeightGradStoreError(RuntimeError):
    """Misuse of a :class:`WeightGradStore` (unknown key, work left over, stale inputs)."""


class _Work(NamedTuple):
    param: torch.Tensor  # the leaf whose .grad gets the result
    compute: Callable[[], torch.Tensor]  # the weight-gradient GEMM (and any re-gather)
    saved: Tuple[torch.Tensor, ...]  # the tensors it reads: in-place changes are refused
    versions: Tuple[int, ...]


class WeightGradStore:
    """Weight-gradient work deferred by the backward of the mpu linear layers, by key.

    One per model (or pipeline engine). A schedule wraps a backward in ``record(key)``
    (``key`` e.g. ``(chunk, micro_batch)``) and later calls ``flush(key)``; a step that
    ends with work left raises in :meth:`check_flushed`. Outside ``record`` the layers
    compute their weight gradient in the backward as usual.

    With sequence parallelism ``flush`` of a column-parallel layer's work all-gathers its
    input shard over the tensor-parallel group: every tp rank of a stage must flush the
    same keys in the same order (as a schedule's identical action lists do). Within a key
    the work runs in an order of its layers (:func:`_flush_order`), not in the order the
    backward recorded it: a compiled backward may run independent branches (T5's
    cross-attention projections) in another order on another tp rank.
    """

    def __init__(self) -> None:
        self._work: Dict[Hashable, List[_Work]] = {}  # insertion order = recording order
        self._key: Optional[Hashable] = None

    @property
    def recording_key(self) -> Optional[Hashable]:
        """The key a backward is being recorded under, or None."""
        return self._key

    @contextlib.contextmanager
    def record(self, key: Hashable):
        """Defer the weight gradients of the backward(s) run inside the block under ``key``.

        Args:
            key: any hashable, e.g. ``(chunk, micro_batch)``; recording a key again appends.
        """
        if key is None:
            raise WeightGradStoreError("WeightGradStore.record: the key must not be None")
        if self._key is not None:
            raise WeightGradStoreError(
                f"WeightGradStore.record({key!r}): already recording {self._key!r}; "
                "records do not nest")
        self._work.setdefault(key, [])
        self._key = key
        try:
            yield self
        finally:
            self._key = None

    def defer(self, param: torch.Tensor, compute: Callable[[], torch.Tensor],
              saved: Tuple[torch.Tensor, ...] = ()) -> None:
        """Append one weight-gradient computation under the key being recorded.

        Args:
            param: the leaf parameter whose ``.grad`` receives ``compute()``.
            compute: returns the gradient (any dtype; cast to ``param``'s as autograd does).
            saved: tensors ``compute`` reads; flush refuses them if changed in place since.
        """
        if self._key is None:
            raise WeightGradStoreError("WeightGradStore.defer: not recording (use record())")
        self._work[self._key].append(
            _Work(param, compute, tuple(saved), tuple(t._version for t in saved)))

    def pending_keys(self) -> List[Hashable]:
        """Keys recorded and not yet flushed, in recording order."""
        return list(self._work)

    def flush(self, key: Hashable) -> int:
        """Run ``key``'s deferred work, accumulating into ``param.grad``: the layers marked by
        :func:`set_weight_grad_deferral` in one order on every tensor-parallel rank, whatever
        order the backward recorded them in (:func:`_flush_order`: largest weights first),
        each parameter's own items in recording order; unmarked parameters' work (a store
        used directly) after, as recorded.

        Args:
            key: a key recorded before and not flushed since.

        Returns:
            the number of weight-gradient GEMMs run.
        """
        if key == self._key:
            raise WeightGradStoreError(f"WeightGradStore.flush({key!r}): still recording it")
        if key not in self._work:
            raise WeightGradStoreError(
                f"WeightGradStore.flush({key!r}): nothing recorded under this key (pending: "
                f"{self.pending_keys()}); run its backward inside `with store.record(key):` "
                "first, and flush each key once")
        work = sorted(self._work.pop(key), key=_flush_order)  # stable: per parameter, as recorded
        with torch.no_grad():
            for item in work:
                _check_unchanged(key, item)
                with torch.autocast(item.param.device.type, enabled=False):
                    grad = item.compute()  # the inputs are already in the compute dtype
                accumulate_grad(item.param, grad)
        return len(work)

    def check_flushed(self, where: str = "at the end of the step") -> None:
        """Raise if any recorded work was not flushed (call it before the optimizer step)."""
        if self._work:
            counts = ", ".join(f"{k!r}: {len(w)}" for k, w in self._work.items())
            raise WeightGradStoreError(
                f"WeightGradStore: weight-gradient work left {where} for keys {counts} "
                "(GEMMs per key); the schedule must flush every key it recorded before the "
                "optimizer step, or those gradients are missing")

    def clear(self) -> List[Hashable]:
        """Drop all pending work (e.g. after a failed step); returns the dropped keys."""
        keys = self.pending_keys()
        self._work.clear()
        return keys

    def __repr__(self) -> str:
        return f"WeightGradStore(recording={self._key!r}, pending={self.pending_keys()})"


def _flush_order(item: _Work) -> Tuple[int, int]:
    """Sort key of a deferred GEMM in :meth:`WeightGradStore.flush`, the same on every
    tensor-parallel rank of a stage (shards of one shape, slots in the model's layer order):
    the largest weights first, then later layers first (as a backward records them).

    Largest first keeps the W pass's peak where a backward's order had it: each GEMM's result
    is its weight's size and the gradients made before it stay, so the output layer's (tied
    to the embedding: slot 0) must not come last (+5% on ZB-V's first stage,
    tests/test_memory_peak.py). Work without a slot (a store used directly) comes after, as
    recorded."""
    slot = getattr(item.param, SLOT_ATTRIBUTE, None)
    return (1, 0) if slot is None else (-item.param.numel(), -slot)


def _check_unchanged(key, item: _Work) -> None:
    for tensor, version in zip(item.saved, item.versions):
        if tensor._version != version:
            raise WeightGradStoreError(
                f"WeightGradStore.flush({key!r}): a tensor the weight gradient of a "
                f"{tuple(item.param.shape)} parameter reads was modified in place between "
                "B and W (e.g. a reused receive buffer); keep it alive unchanged until flush")


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad += grad`` exactly as autograd's ``AccumulateGrad`` does it.

    The first gradient is taken as is when its strides match the parameter's (else copied
    into the parameter's layout); later ones are added in place. A gradient in another
    dtype or device is cast first, as the autograd engine (and ``_to_copy``'s backward)
    would.

    Args:
        param: a leaf tensor.
        grad: a gradient of ``param``'s shape.
    """
    if grad.dtype != param.dtype or grad.device != param.device:
        grad = grad.to(dtype=param.dtype, device=param.device)
    if param.grad is not None:
        param.grad.add_(grad)
    elif _same_layout(grad, param):
        param.grad = grad.detach()
    elif param.is_contiguous() or param.is_contiguous(memory_format=torch.channels_last):
        param.grad = torch.empty_like(param, memory_format=torch.preserve_format).copy_(grad)
    else:
        param.grad = grad.clone(memory_format=torch.contiguous_format)
    hook = getattr(param, GRAD_READY_HOOK, None)
    if hook is not None:
        hook(param)


def _same_layout(grad, param):
    """AccumulateGrad's layout contract: equal strides wherever a dimension is not 1."""
    if not param.is_contiguous():
        return False
    return all(gs == ps for n, gs, ps in zip(grad.shape, grad.stride(), param.stride())
               if n != 1)


# ------------------------------------------------------------------ the deferrable GEMM
def weight_grad_store_of(weight: torch.Tensor) -> Optional[WeightGradStore]:
    """The store a weight defers to (set by :func:`set_weight_grad_deferral`), or None."""
    return getattr(weight, STORE_ATTRIBUTE, None)


def deferral_target(weight: torch.Tensor):
    """``(store, param)`` when a backward through ``weight`` should be deferrable, else None:
    the weight carries a store, is a leaf that needs a gradient, and grad mode is on."""
    store = weight_grad_store_of(weight)
    if store is None or not (torch.is_grad_enabled() and weight.requires_grad and
                             weight.is_leaf):
        return None
    return store, weight


def _is_col_major(t):
    return t.stride(0) == 1 and t.stride(1) == t.size(0)


def mm_mat1_grad(grad, weight, mat1):
    """``d mat1`` of ``mat1 @ weight.t()``: aten's ``mm_mat1_backward`` (same GEMM layout)."""
    if _is_col_major(mat1):
        return weight.t().mm(grad.t()).t()
    return grad.mm(weight)


def mm_weight_grad(grad, mat1, weight_col_major_t):
    """``d weight`` of ``mat1 @ weight.t()``: aten's ``mm_mat2_backward`` for ``weight.t()``
    followed by ``t()``'s backward, so the GEMM (and its bits) are autograd's.

    Args:
        grad: ``[n, out]`` output gradient; mat1: ``[n, in]`` input.
        weight_col_major_t: whether ``weight.t()`` was column-major (a contiguous weight).
    """
    if weight_col_major_t:
        return grad.t().mm(mat1)  # [out, in]
    return mat1.t().mm(grad).t()


def _save_and_multiply(ctx, mat1, weight, bias):
    """The forward of both deferrable Functions: ``mat1 @ weight.t() (+ bias)`` as
    ``aten::linear`` runs it (``addmm`` / ``mm``), keeping ``mat1`` and ``weight``."""
    ctx.weight_col_major_t = _is_col_major(weight.t())
    ctx.save_for_backward(mat1, weight)
    if bias is None:
        return mat1.mm(weight.t())  # [n, out]
    return torch.addmm(bias, mat1, weight.t())


class LinearWithDeferredWeightGrad(torch.autograd.Function):
    """``mat1 @ W^T (+ b)`` on 2-D ``mat1``, whose weight GEMM a WeightGradStore can defer.

    Qi et al. 2024 (zero-bubble pipelines: B = input gradient, W = weight gradient) on the
    pattern of Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication`` (a linear
    as an autograd Function that owns its weight-gradient GEMM). Forward is ``addmm`` /
    ``mm`` as ``aten::linear`` runs it; backward computes ``d mat1`` (and ``db``) with the
    GEMMs of aten's ``mm``/``addmm`` backward and, while the store records, defers
    ``dW = dY^T mat1`` (keeping ``mat1`` and ``dY``) instead of returning it.
    """

    @staticmethod
    def forward(ctx, mat1, weight, bias, target):
        # mat1: [n, in]; weight: [out, in]; target: (store, param) in a tuple, so autograd
        # does not take param (the leaf behind a cast weight) for an input
        ctx.target = target
        ctx.bias_shape = None if bias is None else bias.shape
        return _save_and_multiply(ctx, mat1, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # grad: [n, out]
        mat1, weight = ctx.saved_tensors
        grad_mat1 = mm_mat1_grad(grad, weight, mat1) if ctx.needs_input_grad[0] else None
        grad_bias = None
        if ctx.bias_shape is not None and ctx.needs_input_grad[2]:
            grad_bias = grad.sum_to_size(ctx.bias_shape)  # the engine's broadcast reduction
        grad_weight = None
        if ctx.needs_input_grad[1]:
            store, param = ctx.target
            if store.recording_key is None:
                grad_weight = mm_weight_grad(grad, mat1, ctx.weight_col_major_t)
            else:
                col_major = ctx.weight_col_major_t
                store.defer(param, lambda: mm_weight_grad(grad, mat1, col_major),
                            saved=(grad, mat1))
        return grad_mat1, grad_weight, grad_bias, None


def _linear_as_aten(input_, weight, bias, target):
    """``aten::linear``'s decomposition (Linear.cpp) with the GEMM replaced by the
    deferrable Function: the same reshapes/views, so autograd's own nodes do the rest."""
    apply = LinearWithDeferredWeightGrad.apply
    if input_.dim() == 2 and bias is not None:
        return apply(input_, weight, bias, target)
    if bias is not None and input_.is_contiguous():  # _flatten_nd_linear
        out = apply(input_.reshape(-1, input_.size(-1)), weight, bias, target)
        return out.view(*input_.shape[:-1], out.size(1))
    if input_.dim() == 2:  # at::matmul: 2-D @ 2-D is mm
        out = apply(input_, weight, None, target)
    else:  # at::matmul folds [..., in] to [n, in] (copying if it must) and unsafe-views back
        out = apply(input_.reshape(-1, input_.size(-1)), weight, None, target)
        out = torch.ops.aten._unsafe_view(out, (*input_.shape[:-1], out.size(1)))
    if bias is not None:
        out.add_(bias)
    return out


# ------------------------------------------------------------------ the compiled form
@torch.library.custom_op("megatron_tds::deferred_linear_backward", mutates_args=())
def deferred_linear_backward(grad: torch.Tensor, mat1: torch.Tensor, weight: torch.Tensor,
                             slot: int, weight_col_major_t: bool) -> torch.Tensor:
    """``dX`` of ``mat1 @ weight.t()`` (contiguous ``[n, in]``); ``dW`` deferred to the slot's
    store while it records, else computed and accumulated now (the backward of
    :class:`_TracedDeferredLinear`, opaque to the compiler)."""
    store, param, _ = _SLOTS[slot]
    grad_mat1 = mm_mat1_grad(grad, weight, mat1).contiguous()
    if store.recording_key is None:
        with torch.no_grad():
            accumulate_grad(param, mm_weight_grad(grad, mat1, weight_col_major_t))
    else:
        store.defer(param, lambda: mm_weight_grad(grad, mat1, weight_col_major_t),
                    saved=(grad, mat1))
    return grad_mat1


@deferred_linear_backward.register_fake
def _(grad, mat1, weight, slot, weight_col_major_t):
    return mat1.new_empty(mat1.shape)


class _TracedDeferredLinear(torch.autograd.Function):
    """``mat1 @ W^T (+ b)`` for compiled code: the forward is traced (addmm / mm), the
    backward is ``dX`` and the bias gradient, with the weight GEMM left to the opaque
    operator (see the module docstring). ``W`` gets no gradient from autograd: the
    operator accumulates it, now or in the W pass."""

    @staticmethod
    def forward(ctx, mat1, weight, bias, slot):
        # mat1: [n, in]; weight: [out, in] (the compute-dtype copy of the slot's parameter)
        ctx.slot, ctx.has_bias = slot, bias is not None
        return _save_and_multiply(ctx, mat1, weight, bias)

    @staticmethod
    def backward(ctx, grad):  # grad: [n, out]
        mat1, weight = ctx.saved_tensors
        grad_mat1 = torch.ops.megatron_tds.deferred_linear_backward(
            grad, mat1, weight, ctx.slot, ctx.weight_col_major_t)
        grad_bias = grad.sum(0) if ctx.has_bias else None
        return grad_mat1, None, grad_bias, None


def _traced_deferred_linear(input_, weight, bias, slot):
    """``F.linear`` through :class:`_TracedDeferredLinear` (compiled code only)."""
    input_, weight, bias, _ = autocast_linear_inputs(input_, weight, bias)
    with torch.autocast(input_.device.type, enabled=False):
        out = _TracedDeferredLinear.apply(input_.reshape(-1, input_.size(-1)), weight, bias,
                                          slot)
    return out.view(*input_.shape[:-1], out.size(-1))


def deferrable_linear(input_: torch.Tensor, weight: torch.Tensor,
                      bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``F.linear(input_, weight, bias)``, deferring the weight gradient if ``weight`` has
    a store (:func:`set_weight_grad_deferral`); otherwise exactly ``F.linear``.

    Args:
        input_: ``[*, in]`` (at least 2-D to be deferrable).
        weight: ``[out, in]`` leaf parameter.
        bias: optional ``[out]``.

    Returns:
        ``[*, out]``. Under autocast the three are cast outside the Function (as autocast's
        ``linear`` casts them), so autograd casts the gradients back.
    """
    target = deferral_target(weight) if input_.dim() >= 2 else None
    if target is None:
        return F.linear(input_, weight, bias)
    if torch.compiler.is_compiling():
        return _traced_deferred_linear(input_, weight, bias, getattr(weight, SLOT_ATTRIBUTE))
    return _deferred_linear(input_, weight, bias, target)


def _deferred_linear(input_, weight, bias, target):
    input_, weight, bias, autocast = autocast_linear_inputs(input_, weight, bias)
    if not autocast:
        return _linear_as_aten(input_, weight, bias, target)
    with torch.autocast(input_.device.type, enabled=False):
        return _linear_as_aten(input_, weight, bias, target)


# ------------------------------------------------------------------ opting a model in
def _deferrable_layers(module):
    return [m for m in module.modules() if getattr(type(m), "weight_grad_deferrable", False)]


def set_weight_grad_deferral(module: nn.Module, enabled: bool = True,
                             store: Optional[WeightGradStore] = None
                             ) -> Optional[WeightGradStore]:
    """Let ``module``'s mpu linear layers defer their weight-gradient GEMMs (or stop).

    Marks the weight of every ColumnParallelLinear and RowParallelLinear (plain and
    sequence-parallel) and of every VocabParallelEmbedding (whose weight the output layer,
    ``parallel_lm_logits``, multiplies with; the lookup's own gradient is not deferred).
    Deferral only happens inside ``store.record(key)``; elsewhere the layers compute the
    weight gradient in the backward, bit-identical to the unmarked layers. Compiled code
    defers too (the module docstring): mark the model before its first compiled call, and
    compile regions holding marked layers with :data:`COMPILE_OPTIONS`.

    Args:
        module: a model, a pipeline stage or a single layer.
        enabled: False removes the marks: the layers run their plain code again.
        store: the store to defer to (default: a new one).

    Returns:
        the store, or None when disabling.
    """
    layers = _deferrable_layers(module)
    if not enabled:
        for layer in layers:
            for attribute in (STORE_ATTRIBUTE, SLOT_ATTRIBUTE):
                if hasattr(layer.weight, attribute):
                    delattr(layer.weight, attribute)
        return None
    store = WeightGradStore() if store is None else store
    for layer in layers:
        setattr(layer.weight, STORE_ATTRIBUTE, store)
        slot = getattr(layer.weight, SLOT_ATTRIBUTE, None)
        if slot is None:
            slot = len(_SLOTS)
            setattr(layer.weight, SLOT_ATTRIBUTE, slot)
        _SLOTS[slot] = _Slot(store, layer.weight, getattr(layer, "group", None))
    return store
