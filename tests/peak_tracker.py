"""The high-water mark of the bytes a process holds in tensor storages, measured while code
runs: every storage alive when tracking starts (found through the garbage collector) and
every storage an aten op reads or returns while it runs (a ``TorchDispatchMode``: the
forward and the backward's ops, collectives, the optimizer's), each counted once however
many views share it, until it is freed (a weak reference's callback on the storage object,
which PyTorch keeps alive exactly as long as the storage).

    with LivePeak() as tracker:
        step()
    tracker.peak, tracker.baseline, tracker.labelled()   # bytes; what was alive at the peak

Storages alive before the code under test was even set up can be left out
(``LivePeak(ignore=Preexisting())``, taken before the setup).

What it cannot see: memory that is not a tensor storage (gloo's and the allocator's own
buffers, a kernel's scratch space freed before the op returns) and the CUDA allocator's
rounding and caching (it counts ``nbytes``, as ``torch.cuda.memory_allocated`` would count
them unrounded). A storage resized outside an aten op (``UntypedStorage.resize_``) keeps its
size at the last op that touched it.
"""
import gc
import itertools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class Preexisting:
    """The storages alive now (to leave out of a later measurement: a previous run's
    engine that Python has not freed), each forgotten when it is freed, so that a new
    storage at a reused address is not mistaken for one of them."""

    def __init__(self):
        gc.collect()
        self.refs = {}
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                storage = obj.untyped_storage()
                key = storage._cdata
                if key not in self.refs:
                    self.refs[key] = weakref.ref(storage,
                                                 lambda _, key=key: self.refs.pop(key, None))

    def __contains__(self, key):
        return key in self.refs


class LivePeak(TorchDispatchMode):
    """Track live tensor-storage bytes in this thread and keep their maximum.

    Attributes:
        baseline: bytes alive when tracking started.
        now: bytes alive now.
        peak: the most bytes alive at once since tracking started.
        peak_op: the aten op whose outputs made the peak.
        phase: a name the caller sets (``tracker.phase = "step"``); ``phase_peaks`` keeps
            the most bytes alive at once in each phase, ``peak_phase`` the phase of the peak.
    """

    def __init__(self, label_fn=None, snapshot=False, ignore=()):
        super().__init__()
        self.ignore = ignore  # storage addresses not to count (a :class:`Preexisting`)
        self.snapshot = snapshot or label_fn is not None
        self.origin = {}  # StorageImpl address -> the op that first returned or read it
        self.born = {}  # StorageImpl address -> ordinal of the storage (addresses are reused)
        self._ordinal = itertools.count()
        self.live = {}  # StorageImpl address -> bytes
        self.refs = {}  # StorageImpl address -> weak reference with the free callback
        self.now = self.peak = self.baseline = 0
        self.label_fn = label_fn
        self._at_peak, self._origin_at_peak, self._born_at_peak, self.peak_op = {}, {}, {}, None
        self.phase, self.phase_peaks, self.peak_phase = None, {}, None

    def __enter__(self):
        gc.collect()
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor):
                self._track(obj)
        self.baseline = self.peak = self.now
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self.refs.clear()  # stop counting: the callbacks go with their references
        return out

    def _free(self, key):
        self.now -= self.live.pop(key, 0)
        self.refs.pop(key, None)
        self.origin.pop(key, None)
        self.born.pop(key, None)

    def _track(self, t, origin="baseline"):
        if t.is_meta:
            return
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse, nested, functional wrappers
            return
        key, size = storage._cdata, storage.nbytes()
        if key in self.ignore:
            return
        old = self.live.get(key)
        if old is None:
            self.refs[key] = weakref.ref(storage, lambda _, key=key: self._free(key))
            self.live[key] = size
            self.origin[key] = origin
            self.born[key] = next(self._ordinal)
            self.now += size
        elif old != size:  # resized by an op (resize_, set_)
            self.live[key] = size
            self.now += size - old

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, func)
        if self.now > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = self.now
        if self.now > self.peak:
            self.peak, self.peak_op, self.peak_phase = self.now, func, self.phase
            if self.snapshot:
                self._at_peak, self._origin_at_peak = dict(self.live), dict(self.origin)
                self._born_at_peak = dict(self.born)
        return out

    def alive_at_peak(self, tensor):
        """Whether ``tensor``'s storage (still alive) was alive at the peak (tracked with
        ``snapshot`` or ``label_fn``)."""
        key = tensor.untyped_storage()._cdata
        return key in self._at_peak and self._born_at_peak.get(key) == self.born.get(key)

    def labelled(self):
        """``{label: bytes}`` alive at the peak (tracked with ``snapshot`` or ``label_fn``):
        labels from ``label_fn(address, origin)``, else the op that first returned or read
        each storage (``"baseline"``: alive at the start)."""
        out = {}
        for key, size in self._at_peak.items():
            origin = self._origin_at_peak.get(key)
            label = self.label_fn(key, origin) if self.label_fn else str(origin)
            out[label] = out.get(label, 0) + size
        return out
