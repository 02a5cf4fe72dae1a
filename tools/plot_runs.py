#!/usr/bin/env python
"""Plot loss, validation loss, tokens/s and MFU of one or more runs into one PNG.

    python tools/plot_runs.py runs/gpt2/tensorboard/123 logs/other_run.log -o runs.png
    python tools/plot_runs.py a.log b.log --labels tp2 tp4 -o compare.png

Each run is a ``--tensorboard-dir`` folder (event files) or a file holding the training log
(the ``iteration N/ M | ...`` lines). Needs matplotlib: pip install 'megatron-tds[plot]'.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.common.errors import ConfigError, entry_point  # noqa: E402
from megatron.observability.run_plots import TAGS, plot_runs, read_run  # noqa: E402


def get_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="TensorBoard folders or training log files")
    parser.add_argument("-o", "--output", default="runs.png", help="PNG to write")
    parser.add_argument("--labels", nargs="+", default=None,
                        help="legend names, one per run (default: the paths)")
    parser.add_argument("--title", default=None)
    return parser.parse_args(argv)


@entry_point
def main(argv=None):
    args = get_args(argv)
    labels = args.labels or [os.path.normpath(path) for path in args.runs]
    if len(labels) != len(args.runs):
        raise ConfigError(f"--labels gives {len(labels)} names for {len(args.runs)} runs")
    runs = {label: read_run(path) for label, path in zip(labels, args.runs)}
    plot_runs(runs, args.output, args.title)
    for label, series in runs.items():
        counts = ", ".join(f"{name} {len(series.get(name, []))}" for name in TAGS)
        print(f"{label}: {counts} points")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
