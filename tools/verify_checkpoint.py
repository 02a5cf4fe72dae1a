#!/usr/bin/env python
"""Check that a checkpoint's files are intact: every byte against the digests in its manifest.

    # the checkpoint the tracker names (a --save folder)
    python tools/verify_checkpoint.py /path/to/ckpt
    # one iteration, or every published one
    python tools/verify_checkpoint.py /path/to/ckpt --iteration 3000
    python tools/verify_checkpoint.py /path/to/ckpt --all
    # one iteration folder (e.g. a copy made with rsync or cp)
    python tools/verify_checkpoint.py /path/to/copy/iter_0003000

Exit status: 0 when every file verified; 1 when a file is damaged (its digest or size differs),
missing, or not listed, or the manifest is damaged or missing; 2 when the folder is not a
checkpoint. Nothing is loaded: no torch.load, no model. See docs/fault_tolerance.md.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.checkpoint.verify import verify  # noqa: E402
from megatron.common.errors import entry_point  # noqa: E402

DAMAGED_EXIT = 1


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", help="a --save folder or one iter_* folder")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--iteration", type=int, default=None,
                       help="check this iteration of a --save folder (default: the tracker's)")
    which.add_argument("--all", action="store_true",
                       help="check every published iteration of a --save folder")
    return parser.parse_args(argv)


@entry_point
def main(argv=None) -> int:
    args = get_args(argv)
    reports = verify(args.dir, args.iteration, args.all)
    for report in reports:
        for line in report.lines():
            print(line, flush=True)
    return 0 if all(report.ok for report in reports) else DAMAGED_EXIT


if __name__ == "__main__":
    sys.exit(main())
