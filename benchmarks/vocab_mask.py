#!/usr/bin/env python
"""Cost of keeping padded vocabulary rows out of the softmax (docs/benchmarks.md).

Times the lm head + cross entropy (``x @ w.T`` then ``F.cross_entropy``) with and without
``mask_padded_vocab_logits_`` on the same inputs, in the same run, and the fill alone:

    python benchmarks/vocab_mask.py --tokens 1024 --hidden 256 --vocab 50257 --padded 50304
"""
import argparse
import os
import platform
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.mpu.vocab_padding import mask_padded_vocab_logits_  # noqa: E402


def _best(fn, repeats):
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=50257, help="true vocabulary size")
    parser.add_argument("--padded", type=int, default=50304, help="padded vocabulary size")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(device)
    w = torch.randn(args.padded, args.hidden, generator=g).to(device)
    t = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)

    def plain():
        return F.cross_entropy(x @ w.t(), t)

    def masked():
        return F.cross_entropy(mask_padded_vocab_logits_(x @ w.t(), args.vocab,
                                                         partitioned=False), t)

    logits = x @ w.t()
    base, with_mask = _best(plain, args.repeats), _best(masked, args.repeats)
    fill = _best(lambda: mask_padded_vocab_logits_(logits, args.vocab, partitioned=False),
                 args.repeats)
    print(f"command: python {' '.join(sys.argv)}")
    print(f"machine: {platform.processor() or platform.machine()}, device {device}, "
          f"{torch.get_num_threads()} threads")
    print(f"lm head + CE: {base * 1e3:.2f} ms; with mask {with_mask * 1e3:.2f} ms "
          f"(ratio {with_mask / base:.3f}); fill alone {fill * 1e3:.3f} ms "
          f"({fill / base:.2%} of lm head + CE)")


if __name__ == "__main__":
    main()
