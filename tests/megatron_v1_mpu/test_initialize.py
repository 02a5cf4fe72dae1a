"""Megatron v1.0's mpu/tests/test_initialize.py, ported: the imports are the only change
(``from megatron.mpu import v1 as mpu``)."""
import torch

from commons import initialize_distributed, print_separator
from megatron.mpu import v1 as mpu


def test_initialize_model_parallel(model_parallel_size):
    if torch.distributed.get_rank() == 0:
        print(f"> testing initialize_model_parallel with size {model_parallel_size} ...")
    size = min(model_parallel_size, torch.distributed.get_world_size())
    assert not mpu.model_parallel_is_initialized()
    mpu.initialize_model_parallel(size)
    assert mpu.model_parallel_is_initialized()

    def check(group, world_size, rank):
        assert world_size == torch.distributed.get_world_size(group=group)
        assert rank == torch.distributed.get_rank(group=group)

    # model parallel: consecutive ranks
    world_size, rank = size, torch.distributed.get_rank() % size
    assert world_size == mpu.get_model_parallel_world_size()
    assert rank == mpu.get_model_parallel_rank()
    check(mpu.get_model_parallel_group(), world_size, rank)

    # data parallel: every size-th rank
    world_size = torch.distributed.get_world_size() // size
    rank = torch.distributed.get_rank() // model_parallel_size
    assert world_size == mpu.get_data_parallel_world_size()
    assert rank == mpu.get_data_parallel_rank()
    check(mpu.get_data_parallel_group(), world_size, rank)

    mpu.destroy_model_parallel()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print(">> passed the test :-)")


def test_get_model_parallel_src_rank(model_parallel_size_):
    if torch.distributed.get_rank() == 0:
        print(f"> testing get_model_parallel_src_rank with size {model_parallel_size_} ...")
    size = min(model_parallel_size_, torch.distributed.get_world_size())
    assert not mpu.model_parallel_is_initialized()
    mpu.initialize_model_parallel(size)
    assert mpu.model_parallel_is_initialized()

    expected = torch.distributed.get_rank() - mpu.get_model_parallel_rank()
    assert mpu.get_model_parallel_src_rank() == expected

    mpu.destroy_model_parallel()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print(">> passed the test :-)")


if __name__ == "__main__":
    initialize_distributed()
    world_size = torch.distributed.get_world_size()
    model_parallel_size = 1
    while model_parallel_size <= world_size:
        print_separator("test initialize model parallel")
        test_initialize_model_parallel(model_parallel_size)
        print_separator("test model parallel source rank")
        test_get_model_parallel_src_rank(model_parallel_size)
        model_parallel_size *= 2
