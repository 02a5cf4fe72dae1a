#!/usr/bin/env python
"""Host cost of one T5 micro-batch, from dataset samples to masks on the device.

The training step of T5 was host-bound on an H100 (issue 11), with large CPU-side
``aten::copy_`` / ``aten::cat``: each sample carried three ``[s, s]`` int64 attention masks
that were built in NumPy, stacked, converted to uint8, concatenated and copied. Now a
sample carries ``enc_real`` ``[se]`` and the masks are built on the device
(``t5_attention_masks``). This times both, in the same run, on the same samples:

- ``2-D masks`` (the baseline, as the dataset and batch function did it before): per sample
  the three int64 masks, ``np.stack`` collate, uint8, one concatenation, to the device,
  inverted to bool;
- ``1-D + device``: per sample ``enc_real``, collate, to the device, ``t5_attention_masks``.

    python benchmarks/t5_batch.py [--batch 16] [--enc 512] [--dec 128] [--device cpu]

Both include ``make_t5_sample`` (span corruption), the part that did not change.
"""
import argparse
import os
import platform
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from megatron.data import t5_dataset as t5  # noqa: E402
from megatron.model.t5_model import t5_attention_masks  # noqa: E402


class _Tokenizer:
    """Ids 0..31999 plain, 100 sentinels above them (T5's layout: pad 0, eos 1)."""

    name = "benchmark"
    pad, eod, vocab_size = 0, 1, 32100
    sentinel_ids = list(range(32099, 31999, -1))


def _samples(plan, batch, seed):
    rng = np.random.default_rng(seed)
    raws = [rng.integers(2, 32000, plan["raw"]) for _ in range(batch)]
    return [t5.make_t5_sample(raw, plan, np.random.default_rng([seed, i]))
            for i, raw in enumerate(raws)]


def _collate(items, keys):
    return {k: torch.from_numpy(np.stack([it[k] for it in items])) for k in keys}


def old_path(plan, batch, device, seed):
    """The 2-D masks as the dataset and batch function made them before."""
    items = _samples(plan, batch, seed)
    dec_len = plan["dec"]
    causal = np.tril(np.ones((dec_len, dec_len), dtype=bool))
    for it in items:
        enc_real, dec_real = it["enc_real"].astype(bool), it["loss_mask"].astype(bool)
        it["enc_mask"] = (enc_real[:, None] & enc_real[None, :]).astype(np.int64)
        it["dec_mask"] = (causal & dec_real[:, None] & dec_real[None, :]).astype(np.int64)
        it["enc_dec_mask"] = (dec_real[:, None] & enc_real[None, :]).astype(np.int64)
    ids = _collate(items, ("text_enc", "text_dec", "labels"))
    keys = ("enc_mask", "dec_mask", "enc_dec_mask", "loss_mask")
    masks = {k: v.to(torch.uint8) for k, v in _collate(items, keys).items()}
    flat = torch.cat([masks[k].reshape(-1) for k in keys]).to(device)
    shapes = [masks[k].shape for k in keys]
    parts = dict(zip(keys, (p.view(s) for p, s in zip(flat.split([m.numel() for m in
                                                                   masks.values()]), shapes))))
    ids = {k: v.to(device) for k, v in ids.items()}
    out = [(parts[k] == 0).unsqueeze(1) for k in keys[:3]]
    return ids, out


def new_path(plan, batch, device, seed):
    """1-D real-token vectors; masks built on the device."""
    items = _samples(plan, batch, seed)
    data = _collate(items, ("text_enc", "text_dec", "labels", "loss_mask", "enc_real"))
    flat = torch.cat([v.reshape(-1).to(device, non_blocking=True) for v in data.values()])
    parts = dict(zip(data, (p.view(v.shape) for p, v in
                            zip(flat.split([v.numel() for v in data.values()]),
                                data.values()))))
    return parts, t5_attention_masks(parts["enc_real"].bool(), parts["loss_mask"].bool())


def _best(fn, repeats, device):
    fn(0)
    best = float("inf")
    for i in range(repeats):
        start = time.perf_counter()
        fn(i + 1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--enc", type=int, default=512)
    parser.add_argument("--dec", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    plan = t5.make_plan(args.enc, args.dec, _Tokenizer(), 0.15, 3.0)
    ids_old, masks_old = old_path(plan, 2, device, 7)
    ids_new, masks_new = new_path(plan, 2, device, 7)
    assert all(torch.equal(a, b) for a, b in zip(masks_old, masks_new))  # same masks
    assert all(torch.equal(ids_old[k], ids_new[k]) for k in ids_old)
    print("command: python benchmarks/t5_batch.py " + " ".join(
        sys.argv[1:] if argv is None else argv))
    print(f"machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
          f"device {device}; micro-batch {args.batch}, enc {args.enc}, dec {args.dec}")
    old = _best(lambda s: old_path(plan, args.batch, device, s), args.repeats, device)
    new = _best(lambda s: new_path(plan, args.batch, device, s), args.repeats, device)
    print(f"{'path':<16} {'ms / micro-batch':>17} {'vs 2-D masks':>13}")
    print(f"{'2-D masks':<16} {old * 1e3:>17.2f} {1.0:>13.3f}")
    print(f"{'1-D + device':<16} {new * 1e3:>17.2f} {new / old:>13.3f}")


if __name__ == "__main__":
    main()
