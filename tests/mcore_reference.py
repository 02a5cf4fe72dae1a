"""Run by tests/test_megatron_core_checkpoints.py under an interpreter that has megatron-core
(not this project's environment: megatron-core must not be installed beside the suite's).

    python mcore_reference.py save DIR IDS.npy OUT.npy PORT TP  # GPTModel -> DIR (torch_dist)
    python mcore_reference.py load DIR IDS.npy OUT.npy PORT TP  # DIR -> a fresh GPTModel

Both write the model's logits on IDS to OUT. The model is Megatron-Core's own GPTModel with
the local spec, built as GPT-2: learned absolute positions, LayerNorm, tanh GeLU, tied output
layer, on the CPU with gloo; ``save`` perturbs every parameter (so biases and norms are not
their initial zeros and ones) and saves with ``dist_checkpointing.save`` and the common state
Megatron-LM adds (args, iteration, checkpoint_version).
"""
import argparse
import contextlib
import os
import sys
import warnings

import numpy as np
import torch
import torch.nn.functional as F

LAYERS, HIDDEN, HEADS, POSITIONS, VOCAB = 4, 32, 4, 16, 104  # 104: 100 padded to 8 x tp


def _gelu(x):
    return F.gelu(x, approximate="tanh")


def _model(tp):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                               use_cpu_initialization=True, hidden_dropout=0.0,
                               attention_dropout=0.0, activation_func=_gelu,
                               bias_activation_fusion=False, tensor_model_parallel_size=tp)
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=VOCAB,
                    max_sequence_length=POSITIONS, position_embedding_type="learned_absolute",
                    share_embeddings_and_output_weights=True).eval()


def _logits(model, ids):
    from megatron.core import parallel_state

    b, s = ids.shape
    mask = torch.tril(torch.ones(s, s, dtype=torch.bool)).logical_not().view(1, 1, s, s)
    with torch.no_grad():
        local = model(ids, torch.arange(s).expand(b, s), mask)  # [b, s, v / tp]
    parts = [torch.empty_like(local)
             for _ in range(parallel_state.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(parts, local.contiguous(),
                                 group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, -1)


def _rank(rank, mode, folder, ids_path, out_path, port, tp):
    warnings.filterwarnings("ignore")
    if not torch.cuda.is_available():  # megatron-core 0.16's torch_dist writer asks the GPU
        torch.cuda.synchronize = lambda *args, **kwargs: None
        torch.cuda.current_device = lambda: "cpu"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=tp)
    from megatron.core import dist_checkpointing, parallel_state

    parallel_state.initialize_model_parallel(tp, 1)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    # the attention's dropout (0 here) forks the CUDA RNG tracker, which needs a GPU
    get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()
    model = _model(tp)
    ids = torch.from_numpy(np.load(ids_path))
    if mode == "save":
        for name, param in model.named_parameters():
            torch.manual_seed(sum(map(ord, name)))
            with torch.no_grad():
                param.add_(torch.randn(param.shape) * 0.1)
        state = {"model": model.sharded_state_dict(), "iteration": 10,
                 "checkpoint_version": 3.0,
                 "args": argparse.Namespace(num_layers=LAYERS, hidden_size=HIDDEN,
                                            num_attention_heads=HEADS,
                                            max_position_embeddings=POSITIONS,
                                            padded_vocab_size=VOCAB,
                                            tensor_model_parallel_size=tp,
                                            pipeline_model_parallel_size=1,
                                            position_embedding_type="learned_absolute")}
        os.makedirs(folder, exist_ok=True)
        dist_checkpointing.save(state, folder)
    else:
        loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, folder)
        model.load_state_dict(loaded["model"])
    logits = _logits(model, ids)
    if rank == 0:
        np.save(out_path, logits.numpy())
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    mode, folder, ids_path, out_path = sys.argv[1:5]
    port, tp = int(sys.argv[5]), int(sys.argv[6])
    torch.multiprocessing.spawn(_rank, (mode, folder, ids_path, out_path, port, tp), nprocs=tp)
