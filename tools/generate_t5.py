#!/usr/bin/env python
"""Fill the masked spans of a text with a T5 checkpoint (greedy decoding, KV cache).

    python tools/generate_t5.py --load ckpt --text "The cat <extra_id_0> on the <extra_id_1>."
    torchrun --nproc_per_node 2 tools/generate_t5.py --load ckpt --input-file texts.txt

Each ``<extra_id_i>`` marks a span for the model to fill, as in T5's span corruption; the
output lists the decoded target (``<extra_id_0> span <extra_id_1> span ...``) and the text
with the spans filled in (``[...]``). The checkpoint may be native (any tp/pp layout; its
saved args name the sentencepiece model) or a Hugging Face T5 directory (pass
``--tokenizer-model``). The tensor-parallel size is the number of processes.
"""
import argparse
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron import mpu  # noqa: E402
from megatron.checkpoint_conversion import hf_io  # noqa: E402
from megatron.common.errors import ConfigError, DataError, entry_point  # noqa: E402


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--load", required=True, help="native checkpoint or HF T5 directory")
    parser.add_argument("--iteration", type=int, default=None, help="native: default latest")
    parser.add_argument("--tokenizer-model", default=None,
                        help="sentencepiece .model (default: the checkpoint's)")
    parser.add_argument("--vocab-extra-ids", type=int, default=None,
                        help="sentinels (default: the checkpoint's, else 100)")
    parser.add_argument("--text", action="append", default=[], help="repeatable")
    parser.add_argument("--input-file", default=None, help="one text per line")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--no-kv-cache", action="store_true",
                        help="recompute the decoder prefix each step (slow; for checking)")
    parser.add_argument("--distributed-backend", choices=["gloo", "nccl"], default=None)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    return args


def read_texts(args):
    texts = list(args.text)
    if args.input_file:
        if not os.path.isfile(args.input_file):
            raise DataError(f"--input-file {args.input_file} does not exist")
        with open(args.input_file, encoding="utf-8") as handle:
            texts += [line.rstrip("\n") for line in handle if line.strip()]
    if not texts:
        raise ConfigError("no input: give --text 'with <extra_id_0> spans' or --input-file")
    return texts


def make_tokenizer(args):
    """The sentencepiece tokenizer: the flag, else the one the native checkpoint names."""
    from megatron.tokenizer.sentencepiece_tokenizer import SentencePieceTokenizer

    saved = {}
    if not hf_io.is_hf_dir(args.load):
        from megatron.checkpoint_conversion.t5_convert import read_native_t5

        saved = read_native_t5(args.load, args.iteration).args
    model_file = args.tokenizer_model or saved.get("tokenizer_model")
    if not model_file:
        raise ConfigError("the checkpoint names no sentencepiece model; pass --tokenizer-model")
    extra = args.vocab_extra_ids if args.vocab_extra_ids is not None else \
        saved.get("vocab_extra_ids", 100)
    tokenizer = SentencePieceTokenizer(model_file, vocab_extra_ids=extra)
    if not tokenizer.sentinel_ids:
        raise ConfigError("the tokenizer has no sentinels (<extra_id_i>); use --vocab-extra-ids")
    return tokenizer


def encode_batch(tokenizer, texts, device):
    """``([b, se] ids, [b, se] bool real)``: each text's ids then eos, padded with pad."""
    rows = [tokenizer.tokenize(t) + [tokenizer.eod] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
    real = torch.arange(width)[None] < torch.tensor([len(r) for r in rows])[:, None]
    return ids.to(device), real.to(device)


def init_distributed(backend):
    """torch.distributed from torchrun's environment (or a local group of one), tp = world."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and "MASTER_ADDR" not in os.environ:
        with socket.socket() as sock:  # a free local port for a group of one
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = backend or ("nccl" if mpu.get_device().type == "cuda" else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, rank=int(os.environ.get("RANK", "0")), world_size=world)
    mpu.initialize_model_parallel(world, 1)
    mpu.model_parallel_cuda_manual_seed(1234)  # the model's RNG tracker (no dropout at eval)


@entry_point
def main(argv=None):
    from megatron.generation.inference import load_t5_for_inference
    from megatron.generation.t5_generation import fill_spans, greedy_generate

    args = get_args(argv)
    texts = read_texts(args)
    tokenizer = make_tokenizer(args)
    init_distributed(args.distributed_backend)
    model, model_args = load_t5_for_inference(args.load, args.iteration, tokenizer.vocab_size)
    if tokenizer.vocab_size > model_args["padded_vocab_size"]:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                          f"{model_args['padded_vocab_size']} rows: wrong tokenizer")
    model.to(mpu.get_device())
    ids, real = encode_batch(tokenizer, texts, mpu.get_device())
    out = greedy_generate(model, ids, real, args.max_new_tokens, tokenizer.eod, tokenizer.pad,
                          tokenizer.vocab_size, use_cache=not args.no_kv_cache)
    if dist.get_rank() == 0:
        for text, generated in zip(texts, out.cpu()):
            filled, _ = fill_spans(tokenizer, text, generated)
            target = tokenizer.detokenize([t for t in generated[1:].tolist()
                                           if t != tokenizer.pad])
            print(f"===== input =====\n{text}\n===== target =====\n{target}\n"
                  f"===== filled =====\n{filled}\n", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
