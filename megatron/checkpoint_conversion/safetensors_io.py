"""Hugging Face weights in the safetensors format, through the ``safetensors`` library.

A thin wrapper: it turns the library's errors into ``CheckpointError`` (a clear message
naming the file) and accepts tensors the library would refuse (on a GPU, non-contiguous).
"""
import os

from safetensors import SafetensorError
from safetensors.torch import load_file as _load_file
from safetensors.torch import save_file as _save_file

from ..common.errors import CheckpointError


def load_file(path):
    """``{name: tensor}`` from a ``.safetensors`` file (CPU tensors, memory-mapped read).

    Args:
        path: the file.

    Raises:
        CheckpointError: the file is truncated, not safetensors, or holds an unknown dtype.
    """
    try:
        return _load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from None


def save_file(tensors, path, metadata=None):
    """Write ``{name: tensor}`` as safetensors.

    Args:
        tensors: tensors on any device, contiguous or not (no two may share storage).
        path: output file.
        metadata: optional ``{str: str}`` stored in the header.
    """
    # the library writes CPU, contiguous tensors only; moving one at a time would not
    # save memory since it serialises the whole dict at once.
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    meta = {str(k): str(v) for k, v in metadata.items()} if metadata else None
    _save_file(cpu, path, metadata=meta)
    # the library creates the file 0600 (through a temporary file); give it the mode of the
    # config and tokenizer files beside it, 0666 less the umask, so others can read it too
    os.chmod(path, 0o666 & ~_umask())


def _umask():
    mask = os.umask(0)  # the only way to read it: set, then restore at once
    os.umask(mask)
    return mask
