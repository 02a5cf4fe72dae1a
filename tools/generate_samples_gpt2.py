#!/usr/bin/env python
"""Sample continuations from a GPT-2 checkpoint (greedy, top-k, top-p, temperature; KV cache).

    python tools/generate_samples_gpt2.py --load ckpt --prompt "Once upon a time" --top-p 0.9
    torchrun --nproc_per_node 2 tools/generate_samples_gpt2.py --load ckpt \\
        --sample-input-file prompts.txt --greedy --out-seq-length 64

Model sizes and the tokenizer come from the checkpoint's saved args (tokenizer flags override
them). The run's tensor-parallel size is the number of processes; a checkpoint of another
layout (another tp, pipeline stages) is resharded in memory while loading.
"""
import argparse
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron import mpu  # noqa: E402
from megatron.checkpoint.format import (iteration_dir, load_rank_file, rank_files,  # noqa: E402
                                        resolve_iteration)
from megatron.generation.inference import load_gpt2_for_inference  # noqa: E402
from megatron.common.errors import ConfigError, DataError, entry_point  # noqa: E402
from megatron.generation.text_generation import SamplingConfig, generate_text  # noqa: E402
from megatron.tokenizer import build_tokenizer  # noqa: E402

TOKENIZER_FLAGS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="checkpoint directory")
    parser.add_argument("--iteration", type=int, default=None, help="default: latest")
    group = parser.add_argument_group("tokenizer (default: the checkpoint's)")
    for flag in TOKENIZER_FLAGS:
        group.add_argument("--" + flag.replace("_", "-"), default=None)
    group = parser.add_argument_group("prompts")
    group.add_argument("--prompt", action="append", default=[], help="repeatable")
    group.add_argument("--sample-input-file", default=None, help="one prompt per line")
    group.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    group = parser.add_argument_group("sampling")
    group.add_argument("--greedy", action="store_true")
    group.add_argument("--top-k", type=int, default=0, help="0: no top-k filter")
    group.add_argument("--top-p", type=float, default=0.0, help="0: no nucleus filter")
    group.add_argument("--temperature", type=float, default=1.0)
    group.add_argument("--out-seq-length", type=int, default=64, help="tokens to generate")
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--no-kv-cache", action="store_true",
                       help="recompute the whole prefix each step (slow; for checking)")
    group.add_argument("--distributed-backend", choices=["gloo", "nccl"], default=None)
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.out_seq_length < 1:
        parser.error("--batch-size and --out-seq-length must be >= 1")
    return args


def read_prompts(args):
    """The prompts from --prompt and --sample-input-file (blank lines skipped)."""
    prompts = list(args.prompt)
    if args.sample_input_file:
        if not os.path.isfile(args.sample_input_file):
            raise DataError(f"--sample-input-file {args.sample_input_file} does not exist")
        with open(args.sample_input_file, encoding="utf-8") as handle:
            prompts += [line.rstrip("\n") for line in handle if line.strip()]
    if not prompts:
        raise ConfigError("no prompts: give --prompt TEXT (repeatable) or --sample-input-file")
    return prompts


def saved_args(root, iteration):
    """The args dict saved in the checkpoint's first rank file."""
    iteration = resolve_iteration(root, iteration)
    files = rank_files(iteration_dir(root, iteration))
    if (0, 0) not in files:
        raise ConfigError(f"checkpoint {iteration_dir(root, iteration)} has no mp_rank_00_000")
    return load_rank_file(files[(0, 0)]).get("args") or {}, iteration


def make_tokenizer(args, saved):
    """The tokenizer: flags override the checkpoint's saved choice."""
    chosen = {k: getattr(args, k) or saved.get(k) for k in TOKENIZER_FLAGS}
    if not chosen["tokenizer_type"]:
        raise ConfigError("the checkpoint names no tokenizer; pass --tokenizer-type and its files")
    namespace = argparse.Namespace(**chosen, vocab_extra_ids=saved.get("vocab_extra_ids"),
                                   make_vocab_size_divisible_by=1,
                                   tensor_model_parallel_size=1, rank=1)
    return build_tokenizer(namespace)


def init_distributed(backend, seed):
    """torch.distributed from torchrun's environment (or a local group of one), tp = world."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and "MASTER_ADDR" not in os.environ:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if backend is None:
        backend = "nccl" if mpu.get_device().type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, rank=int(os.environ.get("RANK", "0")), world_size=world)
    mpu.initialize_model_parallel(world, 1)
    mpu.model_parallel_cuda_manual_seed(seed)  # the model's RNG tracker (no dropout at eval)


def _print_results(prompts, outputs):
    for prompt, text in zip(prompts, outputs):
        print(f"===== prompt =====\n{prompt}\n===== continuation =====\n{text}\n", flush=True)


@entry_point
def main(argv=None):
    args = get_args(argv)
    prompts = read_prompts(args)
    saved, iteration = saved_args(args.load, args.iteration)
    tokenizer = make_tokenizer(args, saved)
    config = SamplingConfig(greedy=args.greedy, top_k=args.top_k, top_p=args.top_p,
                            temperature=args.temperature, seed=args.seed)
    config.validate()
    init_distributed(args.distributed_backend, args.seed)
    model, model_args = load_gpt2_for_inference(args.load, iteration, tokenizer.vocab_size)
    if tokenizer.vocab_size > model_args["padded_vocab_size"]:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                          f"{model_args['padded_vocab_size']} rows: wrong tokenizer files")
    model.to(mpu.get_device())
    for begin in range(0, len(prompts), args.batch_size):
        batch = prompts[begin:begin + args.batch_size]
        outputs = generate_text(model, tokenizer, batch, args.out_seq_length, config,
                                use_cache=not args.no_kv_cache)
        if dist.get_rank() == 0:
            _print_results(batch, outputs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
