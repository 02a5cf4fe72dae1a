"""Count host-device synchronisations in training steps, on CPU.

On a GPU a step that reads a value (``.item()``, ``float()``, ``bool()`` of a tensor), copies a
tensor to the host, or runs an op whose output size depends on values (``nonzero``, boolean
indexing) makes the host wait for the device. On CPU nothing waits, so these are counted
instead:

- dispatched ops that are a sync on CUDA (:data:`SYNC_OPS`), seen by a ``TorchDispatchMode``;
- explicit host reads of a tensor (``.cpu()``, ``.tolist()``, ``.numpy()``), by patching those
  ``Tensor`` methods while the counter is open (on CPU every tensor "is on the host", so each
  call is counted: the training thread has no business reading tensors back in a step);
- whole-device waits (:data:`DEVICE_SYNCS`): DeepSpeed's ``get_accelerator().synchronize()``
  (its timers call it), ``torch.cuda.synchronize``, ``torch.accelerator.synchronize`` and this
  project's ``megatron.common.timers.synchronize_device``, wrapped while the counter is open and
  counted on CPU too, where they return at once (DeepSpeed's CPU accelerator) or would fail
  (CUDA's, with no device: counted, then raised). A wait that calls another (the CUDA
  accelerator's calls ``torch.cuda.synchronize``) counts once.

Only the thread that opened the counter is counted (the prefetch thread reads and pins host
batches off the training thread, which is not a sync). ``step_sync_counts`` runs the real
``pretrain()`` in a harness rank and attributes every sync to the step it happened in.
"""
import threading
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: aten ops that make the host wait for a CUDA device (a value read or a data-dependent size).
SYNC_OPS = frozenset({
    "aten._local_scalar_dense.default", "aten.is_nonzero.default", "aten.equal.default",
    "aten.nonzero.default", "aten.masked_select.default", "aten._unique2.default",
    "aten.unique_consecutive.default", "aten.repeat_interleave.Tensor",
    # a tensor made from host data (``torch.tensor(-1.0, device=...)``): on a GPU a copy from
    # pageable host memory, which waits (seen on the H100 in DeepSpeed's norm masking, which
    # this CPU count missed before it counted this op)
    "aten.lift_fresh.default",
})
#: Tensor methods that copy a tensor to the host.
HOST_READS = ("cpu", "tolist", "numpy")
#: Whole-device waits: ``(module path, attribute)``; DeepSpeed's accelerator is added when
#: DeepSpeed imports (its object's ``synchronize``, see :func:`_device_sync_owners`).
DEVICE_SYNCS = (("torch.cuda", "synchronize"), ("torch.accelerator", "synchronize"),
                ("megatron.common.timers", "synchronize_device"))
#: Frames that belong to the project (named in the events, to find a sync's source).
PROJECT_PATHS = ("/megatron/", "/tds/", "pretrain_", "/benchmarks/")


def _internal(filename):
    """Frames of torch's own plumbing (dispatch, this file), skipped to find the caller.

    The caller decides: torch.optim's non-fused AdamW keeps each parameter's ``step`` in a
    host tensor even for CUDA parameters (so reading it is no sync), while on CPU the counter
    cannot tell that tensor from a device one; reads made directly by ``torch/optim`` are
    therefore not counted. Its fused implementation (CUDA) reads nothing.
    """
    return filename.endswith("sync_count.py") or "/torch/utils/" in filename or \
        "/torch/_tensor" in filename or "/torch/overrides" in filename or \
        "/torch/_dynamo/" in filename or filename.endswith("/torch/_compile.py")


def _device_sync_owners():
    """``[(owner, attribute, label)]``: the objects whose ``synchronize`` the counter wraps."""
    import importlib

    owners = []
    for module, attr in DEVICE_SYNCS:
        try:
            owner = importlib.import_module(module)
        except ImportError:
            continue
        if hasattr(owner, attr):
            owners.append((owner, attr, f"{module}.{attr}"))
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError:
        return owners
    return owners + [(get_accelerator(), "synchronize", "accelerator.synchronize")]


class SyncCounter(TorchDispatchMode):
    """Context manager: counts the syncs of the opening thread while it is open.

    Attributes:
        events: list of ``(name, where)``: the op or method and the innermost project frame.
        ops: Counter of every aten op dispatched (the op count of the window).
    """

    def __init__(self, count_ops=False):
        super().__init__()
        self.events, self.ops, self.count_ops = [], Counter(), count_ops
        self._thread = None
        self._saved = {}
        self._wrapped = []  # (owner, attribute, original, was an attribute of the owner)
        self._waiting = threading.local()  # inside a counted device wait (count it once)

    def _record(self, name):
        if threading.get_ident() != self._thread:
            return
        stack = traceback.extract_stack()[:-2]
        caller = next((f.filename for f in reversed(stack) if not _internal(f.filename)), "")
        if "/torch/optim/" in caller:
            return  # torch.optim's step counters live on the host by design (see _internal)
        frames = [f for f in stack if any(part in f.filename for part in PROJECT_PATHS)]
        where = f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?"
        inner = next((f for f in reversed(stack) if not _internal(f.filename)), None)
        if inner is not None and inner.filename != (frames[-1].filename if frames else ""):
            where += f" ({inner.filename}:{inner.lineno})"  # the library code that read
        self.events.append((name, where))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if self.count_ops and threading.get_ident() == self._thread:
            self.ops[name] += 1
        if name in SYNC_OPS:
            self._record(name)
        return func(*args, **(kwargs or {}))

    def _patch(self):
        for method in HOST_READS:
            original = getattr(torch.Tensor, method)
            self._saved[method] = original

            def counted(tensor, *args, _original=original, _name=method, **kwargs):
                self._record(f"Tensor.{_name}")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, method, counted)
        for owner, attr, label in _device_sync_owners():
            self._wrap_device_sync(owner, attr, label)

    def _wrap_device_sync(self, owner, attr, label):
        original = getattr(owner, attr)

        def counted(*args, **kwargs):
            outer = not getattr(self._waiting, "depth", 0)
            if outer:
                self._record(label)
            self._waiting.depth = getattr(self._waiting, "depth", 0) + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._waiting.depth -= 1

        self._wrapped.append((owner, attr, original, attr in vars(owner)))
        setattr(owner, attr, counted)

    def _unpatch(self):
        for method, original in self._saved.items():
            setattr(torch.Tensor, method, original)
        for owner, attr, original, own in reversed(self._wrapped):
            if own:
                setattr(owner, attr, original)
            else:  # a bound method of the class (DeepSpeed's accelerator): unshadow it
                delattr(owner, attr)
        self._saved, self._wrapped = {}, []

    def __enter__(self):
        self._thread = threading.get_ident()
        self._patch()
        return super().__enter__()

    def __exit__(self, *exc):
        self._unpatch()
        return super().__exit__(*exc)

    @property
    def count(self):
        return len(self.events)

    @property
    def device_waits(self):
        """The events that are whole-device waits (:data:`DEVICE_SYNCS`, the accelerator's)."""
        return [event for event in self.events if is_device_wait(event[0])]


def is_device_wait(name):
    """Whether an event's name is a whole-device wait (not a value read or a host copy)."""
    return name.endswith("synchronize") or name.endswith("synchronize_device")


def _steps_counted(counter, boundaries):
    """Split ``counter.events`` at the step boundaries: one list of events per step."""
    edges = [*boundaries, len(counter.events)]
    return [counter.events[a:b] for a, b in zip(edges, edges[1:])]


def step_sync_counts(entry_main, argv):
    """Rank body: run ``entry_main(argv)`` (``pretrain_gpt2.main``...) with every training
    step counted. Returns one list of ``(name, where)`` sync events per step: a step's events
    are those between its start and the next step's start (the last step also holds the
    final log line's reads, the first the steps' lazy start-up)."""
    from megatron.training import loop

    counter, boundaries = SyncCounter(), []
    original_train, original_step = loop.train, loop.train_step

    def counted_step(*args, **kwargs):
        boundaries.append(len(counter.events))
        return original_step(*args, **kwargs)

    def counted_train(*args, **kwargs):
        with counter:
            return original_train(*args, **kwargs)

    loop.train, loop.train_step = counted_train, counted_step
    try:
        entry_main(argv)
    finally:
        loop.train, loop.train_step = original_train, original_step
    return _steps_counted(counter, boundaries)


def gpt2_step_syncs(argv):
    """Rank body: :func:`step_sync_counts` of ``pretrain_gpt2.main``."""
    import pretrain_gpt2

    return step_sync_counts(pretrain_gpt2.main, argv)


def t5_step_syncs(argv):
    """Rank body: :func:`step_sync_counts` of ``pretrain_t5.main``."""
    import pretrain_t5

    return step_sync_counts(pretrain_t5.main, argv)
