"""Read batches ahead on a background thread, so the training thread never waits on I/O.

The DataLoader's work (memory-mapped reads, collation, and on a GPU the pinning of host
memory that makes the device copy non-blocking) happens in a thread of its own, ``depth``
batches ahead of the training loop; the order is the DataLoader's, so a resumed run reads
the same batches. Worker processes (``--num-workers``) still work underneath it.
"""
import queue
import threading
from typing import Iterable, Iterator

_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Prefetcher(Iterator):
    """Iterate ``iterable`` on a daemon thread, up to ``depth`` items ahead.

    Args:
        iterable: what to read (a DataLoader).
        depth: items held ready (>= 1).
    """

    def __init__(self, iterable: Iterable, depth: int = 2):
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self._queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(iter(iterable),),
                                        name="megatron-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _fill(self, iterator):
        try:
            for item in iterator:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as exc:  # re-raised on the training thread
            self._put(_Failure(exc))

    def __next__(self):
        item = self._queue.get()
        if item is _END:
            self._queue.put(_END)  # every later next() ends too
            raise StopIteration
        if isinstance(item, _Failure):
            raise item.exc
        return item

    def close(self) -> None:
        """Stop the thread (no more items are read)."""
        self._stop.set()
        while True:  # free a put the thread may be blocked in
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout=5)
