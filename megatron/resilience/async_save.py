"""``--async-save``: snapshot a checkpoint to host memory, write it on a background thread.

The training thread copies every tensor of the rank's files to host memory (pinned on a GPU,
the copies queued on the current stream, so later updates of the weights cannot overtake
them and the training thread never waits for them) and goes on training. A writer thread
waits for the copies, writes the files through the same atomic, flushed, hashing
``write_checkpoint_file``, then agrees with the other ranks' writers on a gloo group
(:func:`megatron.resilience.agreement.agree`: did every rank write all its files, and if not, which and
why?) and hands every file's digest to rank 0 (the synchronous save's
:func:`~.checkpoint_integrity.gather_digests`). Only then does rank 0 publish the folder with
the same manifest a synchronous save writes and rewrite the tracker (``publish_iteration``),
and the writers agree once more on that, so a crash at any moment of a background write
leaves the previous checkpoint as the one resume picks, and every rank learns of a failure on any rank. At each step boundary
while a write is in flight, the ranks check together whether every writer has finished
(:meth:`AsyncCheckpointWriter.poll`, one host all-reduce): a failed write stops every rank
at the same step, a step or two after the failure, not at the next save. The next save and
the end of the run wait for the writer (:meth:`AsyncCheckpointWriter.wait`).

Cost: one host copy of the rank's checkpoint stays alive during the write (host memory of
the checkpoint's size), and each save still does a few small collectives on the training
thread (RNG states, the temporary folder) as a synchronous save does.
"""
import copy
import os
import threading
import time
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from .agreement import agree_on_call
from ..checkpoint.format import iteration_dir
from ..common.errors import CheckpointError
from .checkpoint_integrity import gather_digests
from .host_group import new_host_group

#: Appended to the message of a write that failed on any rank.
SAVE_FAILED_HINT = ("the tracker still names the previous complete checkpoint (free disk space "
                    "or fix the --save folder, then resume from it)")


#: Values a later step cannot change in place (kept as they are, not copied).
_IMMUTABLE = (type(None), bool, int, float, complex, str, bytes, range, torch.dtype,
              torch.device, torch.Size)


def snapshot(obj, pin: bool, reuse=None):
    """A copy of ``obj`` with every tensor copied to host memory (nested dicts, lists,
    tuples) and every other mutable value deep-copied (a loss scaler object, a set, a
    counter dict inside an object): the writer thread pickles the snapshot later, when the
    training thread has already changed the live state.

    Args:
        obj: a state dict.
        pin: allocate the copies of device tensors in pinned memory (asynchronous copies).
        reuse: the previous save's snapshot of the same state, already written: its host
            tensors are filled again where shape and dtype match (allocating, and pinning,
            hundreds of MB at every save costs more than the copy).
    """
    if torch.is_tensor(obj):
        src = obj.detach()
        if torch.is_tensor(reuse) and reuse.shape == src.shape and reuse.dtype == src.dtype \
                and reuse.is_contiguous() and reuse.device.type == "cpu" and \
                (src.device.type == "cpu" or reuse.is_pinned() == pin):
            return reuse.copy_(src, non_blocking=pin and src.device.type != "cpu")
        if src.device.type == "cpu":
            return src.clone(memory_format=torch.contiguous_format)
        out = torch.empty(src.shape, dtype=src.dtype, pin_memory=pin)
        return out.copy_(src, non_blocking=pin)
    if isinstance(obj, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return type(obj)((k, snapshot(v, pin, old.get(k))) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        old = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else None
        items = [snapshot(v, pin, old[i] if old is not None else None)
                 for i, v in enumerate(obj)]
        return type(obj)(items) if not hasattr(obj, "_fields") else type(obj)(*items)
    if isinstance(obj, _IMMUTABLE):
        return obj
    return copy.deepcopy(obj)


def _has_device_tensors(obj) -> bool:
    if torch.is_tensor(obj):
        return obj.device.type != "cpu"
    if isinstance(obj, dict):
        return any(_has_device_tensors(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_device_tensors(v) for v in obj)
    return False


class AsyncCheckpointWriter:
    """Writes one checkpoint at a time in the background; collective where noted.

    Args:
        write_file: ``write_file(path, state)`` writes one complete file (atomically) and
            returns its digest.
        publish: ``publish(root, tmp_root, iteration, digests=...)``, called on rank 0 once
            every rank's files are complete, with every file's digest (for the manifest).
    """

    def __init__(self, write_file: Callable[[str, dict], None],
                 publish: Callable[[str, str, int], None]):
        self._write_file, self._publish = write_file, publish
        self._group = new_host_group()  # the writers' own: never interleaves with training
        self._poll_group = new_host_group()  # the training thread's step-boundary check
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[str] = None
        self.iteration: Optional[int] = None
        self.seconds = 0.0  # how long the last background write took (files + publication)
        self._buffers: List[dict] = []  # the last snapshot, refilled by the next save

    def submit(self, root: str, tmp_root: str, iteration: int,
               files: List[Tuple[str, dict]]) -> None:
        """Snapshot ``files`` (``(path, state)`` pairs; none on a rank that writes nothing)
        and start writing them. Every rank calls it for every save (its writer joins the
        all-reduce of the save). The previous write must have been waited for."""
        assert self._thread is None, "wait() for the previous checkpoint first"
        device = any(_has_device_tensors(state) for _, state in files)
        pin = device and torch.cuda.is_available()
        old = self._buffers if len(self._buffers) == len(files) else [None] * len(files)
        copies = [(path, snapshot(state, pin, prev)) for (path, state), prev in zip(files, old)]
        self._buffers = [state for _, state in copies]
        ready = None
        if pin:  # the writer waits for the queued copies, the training thread does not
            ready = torch.cuda.Event()
            ready.record()
        self.iteration = iteration
        self._thread = threading.Thread(
            target=self._run, args=(root, tmp_root, iteration, copies, ready),
            name=f"checkpoint-writer-{iteration}", daemon=True)
        self._thread.start()

    def _run(self, root, tmp_root, iteration, copies, ready):
        """The writer thread: files, an agreement of the writers, rank 0's publication, an
        agreement on it; the outcome (None, or the message every rank raises) is kept for
        :meth:`wait`."""
        start = time.perf_counter()
        what = f"the background write of the checkpoint of iteration {iteration} to {root}"
        try:
            written = agree_on_call(what, self._write_all, copies, ready, group=self._group,
                                    error_type=CheckpointError, hint=SAVE_FAILED_HINT)
            digests = gather_digests(written, iteration_dir(tmp_root, iteration), self._group)
            rank0 = not dist.is_initialized() or dist.get_rank() == 0
            agree_on_call(f"publishing the checkpoint of iteration {iteration} to {root}",
                          self._publish if rank0 else lambda *a, **k: None, root, tmp_root,
                          iteration, digests=digests, group=self._group,
                          error_type=CheckpointError, hint=SAVE_FAILED_HINT)
        except Exception as exc:  # reported by wait() / poll(), on the training thread
            self._error = str(exc) if isinstance(exc, CheckpointError) else \
                f"{what} failed: {type(exc).__name__}: {exc}"
        self.seconds = time.perf_counter() - start

    def _write_all(self, copies, ready):
        if ready is not None:
            ready.synchronize()
        return [(path, self._write_file(path, state)) for path, state in copies]

    def poll(self) -> None:
        """Collective at a step boundary while a write is in flight: when every rank's writer
        has finished, take its outcome (raising on every rank at this same step if any rank's
        write failed, :meth:`wait`); otherwise return at once. One all-reduce of one int in
        host memory: no device sync."""
        if self._thread is None:
            return
        done = torch.tensor([0 if self._thread.is_alive() else 1], dtype=torch.int32)
        if self._poll_group is not None:
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self._poll_group)
        if int(done[0]):
            self.wait()

    @property
    def busy(self) -> bool:
        """A write was submitted and not yet waited for."""
        return self._thread is not None

    def wait(self) -> None:
        """Block until the submitted write is complete and published.

        Raises:
            CheckpointError: this rank's writer (or another rank's) failed; the tracker still
                names the previous complete checkpoint.
        """
        if self._thread is None:
            return
        self._thread.join()
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(error)
