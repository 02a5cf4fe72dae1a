"""Read and write the safetensors format (Hugging Face's default) without the library.

The format: an 8-byte little-endian header length N, N bytes of JSON
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
raw little-endian tensor bytes. Parsing it here keeps the ``safetensors`` package out of the
runtime dependencies; a test checks both directions against the package.
"""
import json
import struct

import torch

from ..errors import CheckpointError

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}
#: A header larger than this is not a safetensors file (the spec caps it at 100 MB).
MAX_HEADER = 100_000_000


def load_file(path):
    """``{name: tensor}`` from a ``.safetensors`` file (CPU tensors).

    Args:
        path: the file.

    Raises:
        CheckpointError: the file is truncated or not safetensors.
    """
    with open(path, "rb") as handle:
        data = bytearray(handle.read())
    if len(data) < 8:
        raise CheckpointError(f"{path} is not a safetensors file (too short)")
    (size,) = struct.unpack("<Q", data[:8])
    if size > MAX_HEADER or 8 + size > len(data):
        raise CheckpointError(f"{path} is not a safetensors file (bad header length)")
    try:
        header = json.loads(data[8:8 + size].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CheckpointError(f"{path} is not a safetensors file (bad header)") from None
    body = memoryview(data)[8 + size:]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(info.get("dtype"))
        begin, end = info["data_offsets"]
        if dtype is None or end > len(body) or begin > end:
            raise CheckpointError(f"{path}: tensor {name} has an unsupported dtype or lies "
                                  f"outside the file")
        # clone: own, aligned memory instead of a view into the file's bytes
        flat = torch.frombuffer(body[begin:end], dtype=dtype).clone() if end > begin else \
            torch.empty(0, dtype=dtype)
        tensors[name] = flat.reshape(info["shape"])
    return tensors


def save_file(tensors, path, metadata=None):
    """Write ``{name: tensor}`` as safetensors, one tensor at a time.

    Args:
        tensors: CPU or GPU tensors of a supported dtype.
        path: output file.
        metadata: optional ``{str: str}`` stored in the header.
    """
    header, ordered, offset = {}, [], 0
    for name in sorted(tensors):
        tensor = tensors[name]
        if tensor.dtype not in _NAMES:
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be stored as safetensors")
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + size]}
        ordered.append(tensor)
        offset += size
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the body starts 8-byte aligned
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(text)))
        handle.write(text)
        for tensor in ordered:  # one tensor's bytes at a time: no second copy of the model
            flat = tensor.detach().to("cpu").contiguous().reshape(-1)
            handle.write(flat.view(torch.uint8).numpy().tobytes())
