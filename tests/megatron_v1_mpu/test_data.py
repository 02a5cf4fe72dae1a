"""Megatron v1.0's mpu/tests/test_data.py, ported: the imports are the only change
(``from megatron.mpu import v1 as mpu``, ``from megatron.mpu.v1 import data``)."""
import functools
import operator

import torch

from commons import initialize_distributed, print_separator
from megatron.mpu import v1 as mpu
from megatron.mpu.v1 import data as data_utils


def test_boradcast_data(model_parallel_size):
    if torch.distributed.get_rank() == 0:
        print(f"> testing broadcast_data with model parallel size {model_parallel_size} ...")
    mpu.initialize_model_parallel(model_parallel_size)
    torch.manual_seed(1234 + mpu.get_data_parallel_rank())  # one seed per model-parallel group
    model_parallel_size = mpu.get_model_parallel_world_size()

    shapes = {"key1": [7, 11], "key2": [8, 2, 1], "key3": [13], "key4": [5, 1, 2],
              "key5": [5, 12]}
    keys = list(shapes)
    data, expected = {}, {}
    for key, shape in shapes.items():
        data[key] = torch.LongTensor(size=shape).random_(0, 1000)
        expected[key] = data[key].clone()
    data["keyX"] = torch.FloatTensor(size=(5,)).random_(0, 1000)  # not broadcast
    expected["keyX"] = data["keyX"].clone()
    if mpu.get_model_parallel_rank() != 0:
        data = None  # only the source rank has the batch

    data_utils._check_data_types(keys, expected, torch.int64)
    key_size, key_numel, total_numel = \
        data_utils._build_key_size_numel_dictionaries(keys, data)
    total = 0
    for key in keys:
        assert key_size[key] == shapes[key]
        numel = functools.reduce(operator.mul, shapes[key], 1)
        assert key_numel[key] == numel
        total += numel
    assert total_numel == total

    received = data_utils.broadcast_data(keys, data, torch.int64)
    for key in keys:
        assert received[key].sub(expected[key].cuda()).abs().max() == 0

    mpu.destroy_model_parallel()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print(">> passed the test :-)")


if __name__ == "__main__":
    initialize_distributed()
    world_size = torch.distributed.get_world_size()
    model_parallel_size = 1
    while model_parallel_size <= world_size:
        print_separator("test broadcast data")
        test_boradcast_data(model_parallel_size)
        model_parallel_size *= 2
