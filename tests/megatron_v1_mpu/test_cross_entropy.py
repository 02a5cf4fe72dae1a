"""Megatron v1.0's mpu/tests/test_cross_entropy.py, ported: the imports are the only change
(``from megatron.mpu import v1 as mpu``, ``from megatron.mpu.v1.cross_entropy import ...``)."""
import torch
import torch.nn.functional as F

from commons import IdentityLayer, initialize_distributed, print_separator, set_random_seed
from megatron.mpu import v1 as mpu
from megatron.mpu.v1.cross_entropy import vocab_parallel_cross_entropy


def torch_cross_entropy(batch_size, seq_length, vocab_size, logits_scale, seed):
    set_random_seed(seed)
    identity = IdentityLayer((batch_size, seq_length, vocab_size), scale=logits_scale).cuda()
    logits = identity()
    target = torch.cuda.LongTensor(size=(batch_size, seq_length)).random_(0, vocab_size)
    loss = F.cross_entropy(logits.view(-1, logits.size()[-1]), target.view(-1),
                           reduction="none").view_as(target).mean()
    loss.backward()
    return loss, identity.weight.grad


def mpu_cross_entropy(batch_size, seq_length, vocab_size, logits_scale, seed):
    set_random_seed(seed)
    identity = IdentityLayer((batch_size, seq_length, vocab_size), scale=logits_scale).cuda()
    logits = identity()
    logits_parallel = mpu.scatter_to_model_parallel_region(logits)
    target = torch.cuda.LongTensor(size=(batch_size, seq_length)).random_(0, vocab_size)
    loss = vocab_parallel_cross_entropy(logits_parallel, target).mean()
    loss.backward()
    return loss, identity.weight.grad


def test_cross_entropy(model_parallel_size):
    if torch.distributed.get_rank() == 0:
        print(f"> testing cross entropy with model parallel size {model_parallel_size} ...")
    mpu.initialize_model_parallel(model_parallel_size)
    model_parallel_size = mpu.get_model_parallel_world_size()

    batch_size, seq_length, per_partition, scale, seed = 13, 17, 11, 1000.0, 1234
    vocab_size = per_partition * model_parallel_size
    loss_torch, grad_torch = torch_cross_entropy(batch_size, seq_length, vocab_size, scale,
                                                 seed)
    loss_mpu, grad_mpu = mpu_cross_entropy(batch_size, seq_length, vocab_size, scale, seed)

    error = loss_torch.sub_(loss_mpu).abs().max()
    assert error < 1.0e-6, error
    error = grad_torch.sub_(grad_mpu).abs().max()
    assert error < 1.0e-6, error

    mpu.destroy_model_parallel()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print(">> passed the test :-)")


if __name__ == "__main__":
    initialize_distributed()
    world_size = torch.distributed.get_world_size()
    model_parallel_size = 1
    while model_parallel_size <= world_size:
        print_separator("test cross entropy")
        test_cross_entropy(model_parallel_size)
        model_parallel_size *= 2
