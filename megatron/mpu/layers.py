"""Tensor-parallel layers: VocabParallelEmbedding, ColumnParallelLinear, RowParallelLinear.

Initialisation is layout-invariant: each layer draws its *full* (master) weight on the
CPU from the default generator, which holds the same state on every tensor-parallel
rank, and keeps its own slice. The gathered weight is therefore the same for any tp.
"""
import functools
from typing import Callable, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn import init

from . import parallel_state as ps
from .mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from .sequence_parallel import (
    mark_sequence_parallel,
    reduce_scatter_to_sequence_parallel_region,
    sequence_parallel_param,
)
from .fp8 import Fp8Recipe, layer_gemms
from .fp8_linear import fp8_gather_linear, fp8_linear
from .sequence_parallel_linear import linear_with_sequence_parallel_gather
from .utils import VocabUtility, divide, get_device
from .weight_grad import deferrable_linear, weight_grad_store_of

#: ``init_method(tensor)``: fills a full (master) weight in place.
InitMethod = Callable[[torch.Tensor], object]

_TP_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1,
                          "partition_stride": 1}


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int,
                                         stride: int) -> None:
    """Mark a parameter as split (or not) across tensor-parallel ranks along ``dim``."""
    tensor.tensor_model_parallel = is_parallel
    tensor.model_parallel = is_parallel  # Megatron v1 / DeepSpeed spelling
    tensor.partition_dim = dim
    tensor.partition_stride = stride


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    for name, value in _TP_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, value)


def copy_tensor_model_parallel_attributes(destination_tensor: torch.Tensor,
                                          source_tensor: torch.Tensor) -> None:
    """Copy the tensor-parallel marks (split, dim, stride) that ``source_tensor`` carries.

    Args:
        destination_tensor: gets the attributes (e.g. an fp32 master copy of a parameter).
        source_tensor: the parameter they come from; attributes it lacks are left alone.
    """
    for name in tuple(_TP_ATTRIBUTE_DEFAULTS) + ("model_parallel",):
        if hasattr(source_tensor, name):
            setattr(destination_tensor, name, getattr(source_tensor, name))


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor) -> bool:
    """True for a split parameter, and for a replicated one on tp rank 0 only."""
    return bool(getattr(param, "tensor_model_parallel", False)) or \
        ps.get_tensor_model_parallel_rank() == 0


def _tp_info(group):
    """(group, tp_rank, tp_size); the default group honours v2.6's rank/size setters."""
    if group is not None:
        return group, dist.get_rank(group), dist.get_world_size(group)
    default = ps.get_tensor_model_parallel_group() if ps.model_parallel_is_initialized() else None
    return default, ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _init_partitioned(weight, full_shape, partition_dim, init_method, tp_rank, tp_size,
                      stride=1, return_master=False):
    """Draw the full weight on the CPU, copy this rank's slice(s) into ``weight``.

    With ``stride`` s the partition dimension is cut into tp*s chunks and rank r keeps
    chunks r, r+tp, ... (for fused weights such as QKV laid out per projection).
    """
    master = torch.empty(full_shape, dtype=torch.float32)
    init_method(master)
    chunk = divide(full_shape[partition_dim], tp_size * stride, "partitioned dimension",
                   f"tensor-model-parallel size x stride ({tp_size} x {stride})")
    chunks = torch.split(master, chunk, dim=partition_dim)
    mine = torch.cat(chunks[tp_rank::tp_size], dim=partition_dim)
    with torch.no_grad():
        weight.copy_(mine)
    return master if return_master else None


def _factory(params_dtype, device):
    return {"dtype": params_dtype or torch.get_default_dtype(),
            "device": get_device() if device is None else device}


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary dimension is split across the tensor-parallel ranks.

    Each rank looks up the ids in its own vocabulary slice, zeroes the others, and the
    partial embeddings are summed with one all-reduce.

    Args:
        num_embeddings: vocabulary size (must divide by the tensor-parallel size).
        embedding_dim: hidden size.
        init_method: in-place initialiser applied to the full weight.
        params_dtype: parameter dtype (default: torch's default dtype).
        device: parameter device (default: the current CUDA device, else CPU).
        group: tensor-parallel group (default: mpu's).
        perform_initialization: False leaves the weight uninitialised (to be loaded).

    ``mpu.set_weight_grad_deferral`` marks its weight: the output layer that multiplies with
    it (``parallel_lm_logits``) then defers that GEMM's weight gradient; the lookup's
    gradient is never deferred.
    """

    #: ``mpu.set_weight_grad_deferral`` marks this layer's weight (see :mod:`.weight_grad`).
    weight_grad_deferrable = True

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 init_method: InitMethod = init.xavier_normal_, *,
                 params_dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None,
                 group: Optional[dist.ProcessGroup] = None,
                 perform_initialization: bool = True) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, tp_rank, self.tp_size = _tp_info(group)
        self.vocab_start_index, self.vocab_end_index = \
            VocabUtility.vocab_range_from_global_vocab_size(num_embeddings, tp_rank, self.tp_size)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim,
                                               **_factory(params_dtype, device)))
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        # a row per vocabulary entry, padded: a checkpoint's sharding record says so
        self.weight.padded_vocab_rows = True
        if perform_initialization:
            _init_partitioned(self.weight, (num_embeddings, embedding_dim), 0, init_method,
                              tp_rank, self.tp_size)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:  # [*] ids -> [*, h]
        if self.tp_size == 1:
            return F.embedding(input_, self.weight)
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local_ids = (input_ - self.vocab_start_index).masked_fill_(outside, 0)
        output_parallel = F.embedding(local_ids, self.weight)
        output_parallel.masked_fill_(outside.unsqueeze(-1), 0.0)
        return reduce_from_tensor_model_parallel_region(output_parallel, self.group)


class ColumnParallelLinear(nn.Module):
    """Linear layer ``Y = XA + b`` with A split along its output (column) dimension.

    Forward: ``f`` (identity; all-reduce of the input grad backward), local matmul, and
    an all-gather of the output when ``gather_output``.

    Args:
        input_size: first dimension of A.
        output_size: second dimension of A (must divide by the tensor-parallel size).
        bias: add a (split) bias.
        gather_output: all-gather Y so every rank has all of it; otherwise each rank
            keeps its ``output_size / tp`` columns.
        init_method: in-place initialiser applied to the full ``[output, input]`` weight.
        stride: interleaving of fused weights (see :func:`_init_partitioned`).
        keep_master_weight_for_test: keep the full weight as ``self.master_weight``.
        skip_bias_add: return the bias instead of adding it (for fusing it later).
        sequence_parallel: the input is this rank's part of the sequence ``[s/tp, ...]``:
            all-gather it along dim 0 (reduce-scatter of its gradient) instead of ``f``;
            only the shard is saved for the backward, which all-gathers it again
            (:mod:`.sequence_parallel_linear`).
        params_dtype, device, group, perform_initialization: as in VocabParallelEmbedding.
        fp8: an :class:`~.fp8.Fp8Recipe`: the three GEMMs in float8 (:mod:`.fp8`), the
            weight's scales agreed across the tensor-parallel ranks; None: the compute
            dtype. This rank's ``input_size`` and ``output_size / tp`` must then be
            multiples of 16.

    Returns (forward):
        ``(output, bias)``: ``bias`` is the bias parameter when ``skip_bias_add``, else None.

    After ``mpu.set_weight_grad_deferral`` the matmul runs through a Function that defers
    its weight-gradient GEMM while the store records (:mod:`.weight_grad`); unmarked, the
    layer runs ``F.linear``.
    """

    weight_grad_deferrable = True

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 gather_output: bool = True, init_method: InitMethod = init.xavier_normal_,
                 stride: int = 1, keep_master_weight_for_test: bool = False,
                 skip_bias_add: bool = False, *, params_dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None,
                 group: Optional[dist.ProcessGroup] = None,
                 perform_initialization: bool = True, sequence_parallel: bool = False,
                 fp8: Optional[Fp8Recipe] = None) -> None:
        super().__init__()
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: sequence_parallel needs gather_output=False "
                             "(the output is split across heads, not gathered)")
        self.sequence_parallel = sequence_parallel
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.group, tp_rank, self.tp_size = _tp_info(group)
        self.output_size_per_partition = divide(output_size, self.tp_size, "output size",
                                                "tensor-model-parallel size")
        self.fp8 = layer_gemms(fp8, "out", self.group, self.tp_size,
                               (input_size, self.output_size_per_partition),
                               "ColumnParallelLinear")
        factory = _factory(params_dtype, device)
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size,
                                               **factory))
        set_tensor_model_parallel_attributes(self.weight, True, 0, stride)
        self.master_weight = None
        if perform_initialization:
            self.master_weight = _init_partitioned(
                self.weight, (output_size, input_size), 0, init_method, tp_rank, self.tp_size,
                stride, return_master=keep_master_weight_for_test)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, **factory))
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
        else:
            self.register_parameter("bias", None)

    # [*, in] -> [*, out] or [*, out/tp]; SP: [s/tp, ...] -> [s, ...]
    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        bias = None if self.skip_bias_add else self.bias
        if self.sequence_parallel and self.fp8 is not None:
            output_parallel = fp8_gather_linear(input_, self.weight, bias, self.group, self.fp8)
        elif self.sequence_parallel:  # all-gathered here and again in the backward
            output_parallel = linear_with_sequence_parallel_gather(input_, self.weight, bias,
                                                                   self.group)
        else:
            input_parallel = copy_to_tensor_model_parallel_region(input_, self.group)
            if self.fp8 is not None:  # deferrable too (set_weight_grad_deferral)
                output_parallel = fp8_linear(input_parallel, self.weight, bias, gemms=self.fp8)
            elif weight_grad_store_of(self.weight) is None:
                output_parallel = F.linear(input_parallel, self.weight, bias)
            else:  # set_weight_grad_deferral: a store may take the weight GEMM
                output_parallel = deferrable_linear(input_parallel, self.weight, bias)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output_parallel, self.group)
        else:
            output = output_parallel
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(nn.Module):
    """Linear layer ``Y = XA + b`` with A split along its input (row) dimension.

    Forward: split X unless it already is (``input_is_parallel``), local matmul, ``g``
    (all-reduce of the partial sums), then the bias, which is replicated on every rank.

    Args:
        input_size: first dimension of A (must divide by the tensor-parallel size).
        output_size: second dimension of A.
        bias: add a bias (replicated, not split).
        input_is_parallel: the input is already split (it comes from a
            ColumnParallelLinear with ``gather_output=False``).
        sequence_parallel: reduce-scatter the partial sums along dim 0 (the sequence)
            instead of all-reducing them, so the output is ``[s/tp, ...]``; needs
            ``input_is_parallel``. The bias gradient is then summed across tp.
        init_method, stride, keep_master_weight_for_test, skip_bias_add, params_dtype,
            device, group, perform_initialization, fp8: as in ColumnParallelLinear (here
            ``input_size / tp`` and ``output_size`` must be multiples of 16 in FP8).

    Returns (forward):
        ``(output, bias)`` as ColumnParallelLinear (and its weight-gradient deferral).
    """

    weight_grad_deferrable = True

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 input_is_parallel: bool = False, init_method: InitMethod = init.xavier_normal_,
                 stride: int = 1, keep_master_weight_for_test: bool = False,
                 skip_bias_add: bool = False, *, params_dtype: Optional[torch.dtype] = None,
                 device: Optional[torch.device] = None,
                 group: Optional[dist.ProcessGroup] = None,
                 perform_initialization: bool = True, sequence_parallel: bool = False,
                 fp8: Optional[Fp8Recipe] = None) -> None:
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel=True")
        self.sequence_parallel = sequence_parallel
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.group, tp_rank, self.tp_size = _tp_info(group)
        self.input_size_per_partition = divide(input_size, self.tp_size, "input size",
                                               "tensor-model-parallel size")
        self.fp8 = layer_gemms(fp8, "in", self.group, self.tp_size,
                               (self.input_size_per_partition, output_size), "RowParallelLinear")
        factory = _factory(params_dtype, device)
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition,
                                               **factory))
        set_tensor_model_parallel_attributes(self.weight, True, 1, stride)
        self.master_weight = None
        if perform_initialization:
            self.master_weight = _init_partitioned(
                self.weight, (output_size, input_size), 1, init_method, tp_rank, self.tp_size,
                stride, return_master=keep_master_weight_for_test)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, **factory))
            set_tensor_model_parallel_attributes(self.bias, False, -1, 1)
            if sequence_parallel:
                mark_sequence_parallel(self.bias)
        else:
            self.register_parameter("bias", None)

    # [*, in] or [*, in/tp] -> [*, out]
    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, self.group)
        bias = self.bias
        # set_weight_grad_deferral: a store may take the weight GEMM
        linear = F.linear if weight_grad_store_of(self.weight) is None else deferrable_linear
        if self.fp8 is not None:  # deferrable too
            linear = functools.partial(fp8_linear, gemms=self.fp8)
        if self.tp_size == 1 and not self.skip_bias_add and \
                not torch.is_autocast_enabled(input_parallel.device.type):
            # nothing to reduce: the bias goes into the matmul (one addmm, not mm + add).
            # Not under autocast: there the fp32 bias added after the low-precision matmul
            # keeps the output (the residual stream) in fp32, as at tp > 1.
            return linear(input_parallel, self.weight, bias), None
        output_parallel = linear(input_parallel, self.weight)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(output_parallel, self.group)
            if bias is not None:  # added on a sequence shard: partial gradient per rank
                bias = sequence_parallel_param(bias, self.group)
        else:
            output = reduce_from_tensor_model_parallel_region(output_parallel, self.group)
        if self.skip_bias_add or bias is None:
            return output, (bias if self.skip_bias_add else None)
        return output + bias, None
