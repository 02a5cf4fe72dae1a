"""Megatron v1.0's mpu/tests/test_random.py, ported: the imports are the only change
(``from megatron.mpu import v1 as mpu``; ``mpu.random`` is its submodule)."""
import torch

from commons import initialize_distributed, print_separator
from megatron.mpu import v1 as mpu


def test_set_cuda_rng_state(model_parallel_size):
    if torch.distributed.get_rank() == 0:
        print(f"> testing set_rng_state with size {model_parallel_size} ...")
    mpu.initialize_model_parallel(model_parallel_size)
    model_parallel_size = mpu.get_model_parallel_world_size()

    size = 123
    torch.cuda.manual_seed(1234)
    tensor = torch.cuda.FloatTensor(size)
    rng_state = torch.cuda.get_rng_state()
    rng_state_copy = rng_state.clone()

    for _ in range(5):
        torch.randn(size, out=tensor)
    result_1 = tensor.clone()
    assert rng_state.sub(rng_state_copy).max() == 0
    assert torch.cuda.get_rng_state().sub(rng_state_copy).max() > 0
    assert torch.cuda.get_rng_state().sub(rng_state).max() > 0  # the generator moved on

    # Back to the saved state (twice): the same draws again.
    mpu.random._set_cuda_rng_state(rng_state)
    for _ in range(5):
        torch.randn(size, out=tensor)
    mpu.random._set_cuda_rng_state(rng_state)
    for _ in range(5):
        torch.randn(size, out=tensor)
    result_2 = tensor.clone()
    assert result_2.sub(result_1).abs().max() < 1.0e-6
    assert rng_state.sub(rng_state_copy).max() == 0  # the saved state was not touched

    mpu.destroy_model_parallel()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print(">> passed the test :-)")


def test_cuda_rng_tracker(model_parallel_size):
    if torch.distributed.get_rank() == 0:
        print(f"> testing cuda rng tracker with size {model_parallel_size} ...")
    mpu.initialize_model_parallel(model_parallel_size)
    model_parallel_size = mpu.get_model_parallel_world_size()

    seed_1, seed_2, size = 1234, 4321, [12, 21]
    tensor = torch.cuda.FloatTensor(size)

    torch.cuda.manual_seed(seed_1)  # two draws from seed 1
    torch.randn(size, out=tensor)
    target_11 = tensor.clone()
    torch.randn(size, out=tensor)
    target_12 = tensor.clone()
    torch.cuda.manual_seed(seed_2)  # two draws from seed 2
    torch.randn(size, out=tensor)
    target_21 = tensor.clone()
    torch.randn(size, out=tensor)
    target_22 = tensor.clone()

    # Interleaved through the tracker, each stream gives the same draws.
    torch.cuda.manual_seed(seed_1)
    mpu.get_cuda_rng_tracker().add("test", seed_2)
    torch.randn(size, out=tensor)
    result_11 = tensor.clone()
    with mpu.get_cuda_rng_tracker().fork("test"):
        torch.randn(size, out=tensor)
        result_21 = tensor.clone()
    torch.randn(size, out=tensor)
    result_12 = tensor.clone()
    with mpu.get_cuda_rng_tracker().fork("test"):
        torch.randn(size, out=tensor)
        result_22 = tensor.clone()

    diff = min(result_11.sub(result_21).abs().max(), result_12.sub(result_22).abs().max())
    assert diff > 1.0e-6
    error = max(result_11.sub(target_11).abs().max(), result_12.sub(target_12).abs().max(),
                result_21.sub(target_21).abs().max(), result_22.sub(target_22).abs().max())
    assert error < 1.0e-6

    mpu.get_cuda_rng_tracker().reset()
    mpu.destroy_model_parallel()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print(">> passed the test :-)")


def test_model_parallel_cuda_manual_seed(model_parallel_size):
    if torch.distributed.get_rank() == 0:
        print(f"> testing model parallel cuda manual seed with size {model_parallel_size} ...")
    mpu.initialize_model_parallel(model_parallel_size)
    model_parallel_size = mpu.get_model_parallel_world_size()

    mpu.model_parallel_cuda_manual_seed(12345)
    assert torch.cuda.initial_seed() == 12345
    with mpu.get_cuda_rng_tracker().fork():
        assert torch.cuda.initial_seed() == 12345 + 2718 + mpu.get_model_parallel_rank()

    mpu.get_cuda_rng_tracker().reset()
    mpu.destroy_model_parallel()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print(">> passed the test :-)")


if __name__ == "__main__":
    initialize_distributed()
    world_size = torch.distributed.get_world_size()
    for name, test in (("set rng state", test_set_cuda_rng_state),
                       ("cuda rng tracker", test_cuda_rng_tracker),
                       ("model parallel cuda manual seed", test_model_parallel_cuda_manual_seed)):
        model_parallel_size = 1
        while model_parallel_size <= world_size:
            print_separator(f"test {name}")
            test(model_parallel_size)
            model_parallel_size *= 2
