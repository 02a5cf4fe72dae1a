"""Test helper: damage a checkpoint file the way a bad disk or a torn copy does, inside the
bytes of one tensor, so that ``torch.load`` still reads it (silent damage).

``torch.save`` writes a zip archive whose tensor storages are stored uncompressed, one
record each (``<archive>/data/<key>``); the helpers find the largest record (the biggest
tensor: the embedding in a main file, a flat fp32 partition in a ZeRO shard) from the zip's
own directory and flip bits in place.
"""
import struct
import zipfile
from typing import Tuple

import torch

_LOCAL_HEADER = 30  # bytes of a zip local file header before its name and extra field


def largest_record(path: str) -> Tuple[int, int]:
    """``(offset of its first data byte, length)`` of the largest tensor storage in ``path``."""
    with zipfile.ZipFile(path) as archive:
        records = [info for info in archive.infolist() if "/data/" in info.filename]
        info = max(records, key=lambda i: i.file_size)
    assert info.compress_type == zipfile.ZIP_STORED, info
    with open(path, "rb") as handle:
        handle.seek(info.header_offset)
        header = handle.read(_LOCAL_HEADER)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + _LOCAL_HEADER + name_len + extra_len, info.file_size


def flip_low_mantissa_bits(path: str, count: int = 1024) -> int:
    """Flip the lowest mantissa bit of ``count`` fp32 values spread over the largest tensor
    (each value changes by one unit in the last place). Returns the values flipped."""
    start, length = largest_record(path)
    values = length // 4
    count = min(count, values)
    stride = max(1, values // count)
    with open(path, "r+b") as handle:
        for i in range(count):
            handle.seek(start + 4 * i * stride)  # little endian: byte 0 holds bit 0
            byte = handle.read(1)[0]
            handle.seek(start + 4 * i * stride)
            handle.write(bytes([byte ^ 0x01]))
    return count


def flip_one_byte(path: str) -> int:
    """Flip one bit of one byte in the middle of the largest tensor. Returns its offset."""
    start, length = largest_record(path)
    offset = start + length // 2 + 1  # not a value's lowest byte: a larger change
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ 0x10]))
    return offset


DAMAGE = {"mantissa": flip_low_mantissa_bits, "byte": flip_one_byte}


def tensors(obj, prefix=""):
    """``{path: tensor}`` of every tensor nested in a loaded state."""
    if torch.is_tensor(obj):
        return {prefix: obj}
    found = {}
    items = obj.items() if isinstance(obj, dict) else \
        enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for key, value in items:
        found.update(tensors(value, f"{prefix}/{key}"))
    return found


def assert_silent(before: dict, after: dict, max_relative: float) -> None:
    """The damaged file still loads, and only the values in the damaged storage differ, each
    by at most ``max_relative`` of its size: damage torch.load does not notice. (Several
    tensors change when they are views of one storage, as a pipeline stage's flat buffer.)"""
    a, b = tensors(before), tensors(after)
    assert set(a) == set(b)
    changed = [k for k in a if not torch.equal(a[k], b[k])]
    assert changed
    for key in changed:
        x, y = a[key].double(), b[key].double()
        relative = ((x - y).abs() / x.abs().clamp_min(1e-30)).max().item()
        assert 0 < relative <= max_relative, (key, relative)
