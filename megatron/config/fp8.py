"""``--fp8-format`` / ``--fp8-recipe``: what an FP8 run needs, checked before anything runs.

FP8 runs the transformer layers' column- and row-parallel GEMMs in float8
(megatron/mpu/fp8.py) under bf16 compute; refused here, each with what to change:

- ``--fp8-recipe`` without ``--fp8-format``; FP8 without ``--bf16``, or with ``--fp16`` (the
  GEMMs' outputs and every other layer run in bf16, and fp16's loss scaler is not made for
  e4m3 / e5m2 gradients);
- a CUDA device below compute capability 8.9 (no float8 tensor cores before Ada / Hopper);
- a GEMM dimension that is not a multiple of 16 (``torch._scaled_mm`` on a GPU): the hidden
  size, this rank's share of the attention projection (heads x kv channels / tp) and of the
  feed-forward width, and the tokens of a micro-batch (sequence / cp x micro-batch);
- torchao missing (its float8 scaling).

On the CPU ``torch._scaled_mm`` runs the GEMMs too (for the numerics; the start-up line says
so once, megatron/initialize.py).
"""
import os
from typing import Any, List, Optional, Tuple

import torch

#: What a GEMM dimension must divide by (``megatron.mpu.fp8.GEMM_MULTIPLE``).
MULTIPLE = 16


def cuda_capability() -> Optional[Tuple[int, int]]:
    """This process's CUDA device's compute capability, or None on a CPU run."""
    if os.environ.get("MEGATRON_DEVICE", "") == "cpu" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability())


def _gemm_problems(args) -> List[str]:
    tp = args.tensor_model_parallel_size
    cp = getattr(args, "context_parallel_size", 1) or 1
    tp_or = " or the tensor-model-parallel size" if tp > 1 else ""
    sizes = [("the hidden size", f"--hidden-size {args.hidden_size}", args.hidden_size,
              "--hidden-size")]
    heads, kv = args.num_attention_heads, args.kv_channels
    if (heads * kv) % tp == 0:
        sizes.append(("the attention projection per tensor-parallel rank",
                      f"--num-attention-heads x --kv-hidden-size / tp = {heads} x {kv} / {tp}",
                      heads * kv // tp, f"--num-attention-heads or --kv-hidden-size{tp_or}"))
    if args.ffn_hidden_size % tp == 0:
        sizes.append(("the feed-forward width per tensor-parallel rank",
                      f"--ff-hidden-size / tp = {args.ffn_hidden_size} / {tp}",
                      args.ffn_hidden_size // tp, f"--ff-hidden-size{tp_or}"))
    for dest in ("seq_length", "enc_seq_length", "dec_seq_length"):
        length, flag = getattr(args, dest, None), "--" + dest.replace("_", "-")
        if length and length % cp == 0:
            per_rank = f" / --context-parallel-size {cp}" if cp > 1 else ""
            sizes.append(("the tokens of a micro-batch",
                          f"{flag}{per_rank} x --batch-size = {length}"
                          f"{f' / {cp}' if cp > 1 else ''} x {args.micro_batch_size}",
                          length // cp * args.micro_batch_size, f"{flag} or --batch-size"))
    return [f"--fp8-format: {what} ({shown} = {value}) is not a multiple of {MULTIPLE}, which "
            f"torch._scaled_mm needs of the FP8 GEMMs' dimensions on a GPU; change {fix}"
            for what, shown, value, fix in sizes if value % MULTIPLE]


def validate_fp8(args: Any, problems: List[str], capability: Optional[tuple] = None) -> None:
    """Check the FP8 flags (the module docstring); fill ``--fp8-recipe``'s default.

    Args:
        args: the parsed flags (model sizes and parallel sizes already derived).
        problems: list the messages are appended to.
        capability: the CUDA device's compute capability (default: this device's; None on
            a CPU); tests pass one to emulate a GPU.
    """
    fmt = getattr(args, "fp8_format", None)
    if fmt is None:
        if getattr(args, "fp8_recipe", None) is not None:
            problems.append("--fp8-recipe needs --fp8-format (e4m3 or hybrid); add it or "
                            "drop --fp8-recipe")
        args.fp8_format = args.fp8_recipe = None
        return
    args.fp8_recipe = args.fp8_recipe or "tensorwise"
    if args.fp16:
        problems.append("--fp16 with --fp8-format is not supported: FP8 training runs the "
                        "layers outside its GEMMs and the GEMMs' outputs in bf16 (use --bf16)")
    elif not args.bf16:
        problems.append("--fp8-format needs --bf16 (the GEMMs' outputs and the layers that "
                        "stay out of FP8 compute in bf16, over fp32 master weights)")
    if capability is None:
        capability = cuda_capability()
    if capability is not None and tuple(capability) < (8, 9):
        major, minor = capability
        problems.append(f"--fp8-format needs a GPU of compute capability 8.9 or later (Ada, "
                        f"Hopper: float8 tensor cores); this one is {major}.{minor}: drop "
                        f"--fp8-format and train in bf16")
    problems.extend(_gemm_problems(args))
    from ..mpu.fp8 import torchao_available

    if not torchao_available():
        problems.append("--fp8-format needs torchao (its float8 scaling): "
                        "pip install -e '.[fp8]' (or pip install torchao)")
