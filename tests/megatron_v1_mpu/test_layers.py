"""Megatron v1.0's mpu/tests/test_layers.py, ported: the imports are the only change
(``from megatron.mpu import v1 as mpu``, ``from megatron.mpu.v1 import layers``).

v1.0's two BERT tests (``test_parallel_self_attention`` and
``test_parallel_transformer_layer``, on ``mpu.BertParallelSelfAttention`` /
``BertParallelTransformerLayer``, which v1.0's mpu defined for its BERT model only) are not
ported: this project has no BERT.
"""
import torch
import torch.nn.init as init
from torch.nn.parameter import Parameter

from commons import initialize_distributed, print_separator, set_random_seed
from megatron.mpu import v1 as mpu
from megatron.mpu.v1 import layers


def test_parallel_embedding(model_parallel_size):
    if torch.distributed.get_rank() == 0:
        print(f"> testing parallel embedding with model parallel size {model_parallel_size}")
    mpu.initialize_model_parallel(model_parallel_size)
    model_parallel_size = mpu.get_model_parallel_world_size()

    batch_size, seq_length, vocab_size, hidden_size, seed = 17, 23, 48, 16, 1236
    set_random_seed(123)
    input_data = torch.LongTensor(size=(batch_size, seq_length)).random_(0, vocab_size).cuda()
    loss_weight = torch.randn([batch_size, seq_length, hidden_size]).cuda()

    set_random_seed(seed)
    embedding_original = torch.nn.Embedding(vocab_size, hidden_size).cuda()
    loss_original = torch.mul(embedding_original(input_data), loss_weight).sum()
    loss_original.backward()

    set_random_seed(seed)
    embedding_parallel = layers.ParallelEmbedding(vocab_size, hidden_size,
                                                  init_method=init.normal_).cuda()
    loss_parallel = torch.mul(embedding_parallel(input_data), loss_weight).sum()
    loss_parallel.backward()

    set_random_seed(seed)
    embedding_vocab_parallel = layers.VocabParallelEmbedding(vocab_size, hidden_size,
                                                             init_method=init.normal_).cuda()
    loss_vocab_parallel = torch.mul(embedding_vocab_parallel(input_data), loss_weight).sum()
    loss_vocab_parallel.backward()

    torch.distributed.barrier()
    assert loss_parallel.sub(loss_original).abs() < 1.0e-12
    assert loss_vocab_parallel.sub(loss_original).abs() < 1.0e-12

    rank = mpu.get_model_parallel_rank()
    grad = torch.split(embedding_original.weight.grad, hidden_size // model_parallel_size,
                       1)[rank]
    assert embedding_parallel.weight.grad.sub(grad).abs().max() < 1.0e-12
    grad = torch.split(embedding_original.weight.grad, vocab_size // model_parallel_size,
                       0)[rank]
    assert embedding_vocab_parallel.weight.grad.sub(grad).abs().max() < 1.0e-12

    mpu.destroy_model_parallel()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print(">> passed the test :-)")


def test_initialize_affine_weight(model_parallel_size):
    mpu.initialize_model_parallel(model_parallel_size)
    if torch.distributed.get_rank() == 0:
        print(f"> testing initialize_affine_weight with model parallel size "
              f"{model_parallel_size}")
    model_parallel_size = mpu.get_model_parallel_world_size()

    seed = 12345
    input_size_coeff, output_size_coeff = 13, 17
    input_size = input_size_coeff * model_parallel_size
    output_size = output_size_coeff * model_parallel_size
    rank = mpu.get_model_parallel_rank()

    # column parallel: this rank's rows of the full weight
    weight = torch.empty(output_size_coeff, input_size)
    set_random_seed(seed)
    layers._initialize_affine_weight(weight, output_size, input_size, output_size_coeff, 0,
                                     torch.nn.init.normal_)
    set_random_seed(seed)
    master_weight = torch.empty(output_size, input_size)
    torch.nn.init.normal_(master_weight)
    mine = torch.split(master_weight, output_size_coeff, dim=0)[rank].contiguous().clone()
    torch.distributed.barrier()
    assert weight.sub(mine).abs().max() < 1.0e-6

    # row parallel: this rank's columns (reached through the package, as v1.0 did)
    weight = torch.empty(output_size, input_size_coeff)
    set_random_seed(seed)
    mpu.layers._initialize_affine_weight(weight, output_size, input_size, input_size_coeff, 1,
                                         torch.nn.init.normal_)
    set_random_seed(seed)
    master_weight = torch.empty(output_size, input_size)
    torch.nn.init.normal_(master_weight)
    mine = torch.split(master_weight, input_size_coeff, dim=1)[rank].contiguous().clone()
    torch.distributed.barrier()
    assert weight.sub(mine).abs().max() < 1.0e-6

    mpu.destroy_model_parallel()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print(" >> passed the test :-)")


class IdentityLayer2D(torch.nn.Module):
    def __init__(self, m, n):
        super().__init__()
        self.weight = Parameter(torch.Tensor(m, n))
        torch.nn.init.xavier_normal_(self.weight)

    def forward(self):
        return self.weight


def _linear_grads(linear_layer, identity_layer, loss_weight, batch_size):
    """Loss, backward, and the gradients the full matrices should get."""
    output = linear_layer(identity_layer())
    torch.mul(output, loss_weight).sum().backward()
    dLdY, X, A = loss_weight, identity_layer.weight, linear_layer.master_weight.cuda()
    dLdA = torch.matmul(dLdY.t(), X)
    dLdb = torch.matmul(torch.ones(batch_size, 1).cuda().t(), dLdY).view(-1)
    dLdX = torch.matmul(dLdY, A)
    return dLdA, dLdb, dLdX


def test_column_parallel_linear(model_parallel_size):
    mpu.initialize_model_parallel(model_parallel_size)
    if torch.distributed.get_rank() == 0:
        print(f"> testing ColumnParallelLinear with model parallel size {model_parallel_size}")
    model_parallel_size = mpu.get_model_parallel_world_size()

    set_random_seed(12345)
    input_size_coeff, output_size_coeff, batch_size = 13, 17, 7
    input_size = input_size_coeff * model_parallel_size
    output_size = output_size_coeff * model_parallel_size
    identity_layer = IdentityLayer2D(batch_size, input_size).cuda()
    linear_layer = mpu.ColumnParallelLinear(input_size, output_size,
                                            keep_master_weight_for_test=True).cuda()
    loss_weight = torch.randn([batch_size, output_size]).cuda()
    dLdA, dLdb, dLdX = _linear_grads(linear_layer, identity_layer, loss_weight, batch_size)

    rank = mpu.get_model_parallel_rank()
    my_dLdA = torch.split(dLdA, output_size_coeff, dim=0)[rank].contiguous().clone()
    assert my_dLdA.sub(linear_layer.weight.grad).abs().max() < 1.0e-6
    my_dLdb = torch.split(dLdb, output_size_coeff, dim=0)[rank].contiguous().clone()
    assert my_dLdb.sub(linear_layer.bias.grad).abs().max() < 1.0e-6
    assert dLdX.sub(identity_layer.weight.grad).abs().max() < 1.0e-6

    mpu.destroy_model_parallel()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print(" >> passed the test :-)")


def test_row_parallel_linear(model_parallel_size):
    mpu.initialize_model_parallel(model_parallel_size)
    if torch.distributed.get_rank() == 0:
        print(f"> testing RowParallelLinear with model parallel size {model_parallel_size}")
    model_parallel_size = mpu.get_model_parallel_world_size()

    set_random_seed(12345)
    input_size_coeff, output_size_coeff, batch_size = 13, 17, 7
    input_size = input_size_coeff * model_parallel_size
    output_size = output_size_coeff * model_parallel_size
    identity_layer = IdentityLayer2D(batch_size, input_size).cuda()
    linear_layer = mpu.RowParallelLinear(input_size, output_size,
                                         keep_master_weight_for_test=True).cuda()
    loss_weight = torch.randn([batch_size, output_size]).cuda()
    dLdA, dLdb, dLdX = _linear_grads(linear_layer, identity_layer, loss_weight, batch_size)

    rank = mpu.get_model_parallel_rank()
    my_dLdA = torch.split(dLdA, input_size_coeff, dim=1)[rank].contiguous().clone()
    assert my_dLdA.sub(linear_layer.weight.grad).abs().max() < 1.0e-6
    assert dLdb.sub(linear_layer.bias.grad).abs().max() < 1.0e-6
    assert dLdX.sub(identity_layer.weight.grad).abs().max() < 1.0e-6

    mpu.destroy_model_parallel()
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        print(" >> passed the test :-)")


if __name__ == "__main__":
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    initialize_distributed()
    world_size = torch.distributed.get_world_size()
    for name, test in (("initialize affine weight", test_initialize_affine_weight),
                       ("parallel embedding", test_parallel_embedding),
                       ("column-parallel linear", test_column_parallel_linear),
                       ("row-parallel linear", test_row_parallel_linear)):
        print_separator(f"test {name}")
        model_parallel_size = 1
        while model_parallel_size <= world_size:
            test(model_parallel_size)
            model_parallel_size *= 2
