"""Token sequences out of a memory-mapped ``.bin``, for every index format's reader."""
import numpy as np


class SequenceAccess:
    """Reading token sequences out of a memory-mapped ``.bin``: ``len``, ``[i]``, ``[a:b]``
    and ``get``, over the reader's ``sizes``, ``pointers`` (bytes), ``dtype`` and ``_bin``.
    Shared by the MMIDIDX reader (indexed_dataset.py) and the TNTIDX one
    (legacy_indexed_dataset.py)."""

    def __len__(self):
        return len(self.sizes)

    def __getitem__(self, idx):
        if isinstance(idx, (int, np.integer)):
            return self.get(int(idx))
        if isinstance(idx, slice):
            return [self.get(i) for i in range(*idx.indices(len(self)))]
        raise TypeError(f"index must be an int or a slice, not {type(idx).__name__}")

    def get(self, idx, offset=0, length=None):
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` as a read-only array."""
        if idx < 0:
            idx += len(self)
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"sequence {idx} has {size} tokens; asked for [{offset}, "
                             f"{offset + length})")
        start = int(self.pointers[idx]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start)
