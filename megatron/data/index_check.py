"""Every entry of an ``.idx`` file checked at open, vectorised, before anything reads it.

A bad entry in the middle of an index (a negative size, a pointer past the end of the
``.bin``) would otherwise fail only when that document is sampled, maybe hours into a run,
with a raw NumPy error, or worse, read the wrong tokens. Megatron writes the pointers as the
running sum of the sizes (in bytes) from 0, so the check is exact: each pointer equals the
bytes of every sequence before it. The work is O(N) NumPy in blocks of :data:`BLOCK`
entries, so a billion-entry index needs a few seconds and bounded memory.
"""
import numpy as np

from megatron.common.errors import DataError

#: Entries checked per NumPy call (bounds the temporaries to a few tens of MB).
BLOCK = 1 << 22


def check_entries(path, sizes, pointers, itemsize, bin_bytes):
    """Raise :class:`DataError` naming the first bad sequence of the index at ``path``.

    Args:
        path: the ``.idx`` file (for the message).
        sizes: int32 ``[N]`` tokens per sequence.
        pointers: int64 ``[N]`` byte offset of each sequence in the ``.bin``.
        itemsize: bytes per token.
        bin_bytes: size of the ``.bin`` file.
    """
    expected = 0  # where the next sequence must start
    for lo in range(0, len(sizes), BLOCK):
        size = sizes[lo:lo + BLOCK].astype(np.int64)  # [b]
        ptr = pointers[lo:lo + BLOCK]  # [b]
        nbytes = size * itemsize
        starts = np.empty_like(nbytes)
        starts[0] = expected
        np.cumsum(nbytes[:-1], out=starts[1:])
        starts[1:] += expected
        bad = (size < 0) | (ptr != starts) | (ptr + nbytes > bin_bytes)
        if bad.any():
            i = int(np.argmax(bad))
            raise DataError(f"{path}: sequence {lo + i} is corrupt ("
                            f"{_why(size[i], ptr[i], starts[i], nbytes[i], bin_bytes)}); "
                            f"rebuild the index with tools/preprocess_data.py")
        expected = int(ptr[-1] + nbytes[-1])


def _why(size, ptr, start, nbytes, bin_bytes):
    if size < 0:
        return f"negative size {size}"
    if ptr != start:
        return f"it starts at byte {ptr}, the sizes before it put it at byte {start}"
    return f"it ends at byte {ptr + nbytes}, past the end of the .bin ({bin_bytes} bytes)"


def check_doc_idx(path, doc_idx, n_sequences):
    """Document starts must be sequence numbers in ``[0, N]``, in order.

    Args:
        path: the ``.idx`` file (for the message).
        doc_idx: int64 ``[D]`` sequence index where each document starts (then N).
        n_sequences: N.
    """
    for lo in range(0, len(doc_idx), BLOCK):
        block = doc_idx[max(lo - 1, 0):lo + BLOCK]  # overlap one entry: order across blocks
        bad = (block < 0) | (block > n_sequences)
        bad[1:] |= block[1:] < block[:-1]
        if bad.any():
            i = max(lo - 1, 0) + int(np.argmax(bad))
            raise DataError(f"{path}: document {i} starts at sequence {int(doc_idx[i])}, "
                            f"outside 0..{n_sequences} or before the previous document; "
                            f"rebuild the index with tools/preprocess_data.py")
