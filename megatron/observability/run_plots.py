"""Series of training runs (TensorBoard events or training logs) and their plots.

:func:`read_run` gives ``{series: [(iteration, value), ...]}`` for the four series
``tools/plot_runs.py`` draws (loss, validation loss, tokens/s, MFU), from either source:
the scalars ``megatron/training_log.py`` writes to TensorBoard, or the lines it prints.
:func:`plot_runs` draws several runs into one PNG; :func:`plot_tables` draws benchmark
tables (``benchmarks/kernels.py --plot``). matplotlib is the optional ``[plot]`` extra.
"""
import glob
import os
import re

from ..common.errors import ConfigError, DataError

#: series name -> TensorBoard tag (megatron/observability/training_log.py's scalar_tag).
TAGS = {"loss": "train/lm-loss", "validation loss": "validation/lm-loss",
        "tokens/s": "train/tokens-per-second", "MFU": "train/mfu"}
#: The same series under the tags that runs before the one naming scheme wrote.
_OLD_TAGS = {"loss": "train/lm loss"}
_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+\s*\|(.*)$")
_VALIDATION = re.compile(r"validation loss at iteration (\d+) \| lm loss: ([-+0-9.eE]+|nan|inf)")
_FIELDS = {"lm loss": "loss", "tokens/s": "tokens/s", "MFU": "MFU"}


def _event_dirs(path):
    files = glob.glob(os.path.join(path, "**", "events.out.tfevents.*"), recursive=True)
    return sorted({os.path.dirname(f) for f in files})


def read_tensorboard(path):
    """Series from the TensorBoard event files under ``path`` (all of them, unsampled).

    Args:
        path: a ``--tensorboard-dir`` (event files in it or in its subfolders).
    """
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        raise ConfigError("reading TensorBoard events needs tensorboard: pip install "
                          "tensorboard (or give the run's log file instead)") from None
    series = {}
    for folder in _event_dirs(path):
        events = EventAccumulator(folder, size_guidance={"scalars": 0})  # 0: keep every point
        events.Reload()
        tags = set(events.Tags()["scalars"])
        for name, tag in TAGS.items():
            tag = tag if tag in tags else _OLD_TAGS.get(name, tag)
            if tag in tags:
                series.setdefault(name, []).extend((e.step, e.value) for e in events.Scalars(tag))
    return {name: sorted(points) for name, points in series.items()}


def read_log(path):
    """Series from a training log (the lines ``megatron/training_log.py`` prints).

    Args:
        path: a text file holding the run's stdout (other lines are ignored).
    """
    series = {}
    with open(path, errors="replace") as handle:
        for line in handle:
            match = _ITERATION.search(line)
            if match:
                it = int(match.group(1))
                for field in match.group(2).split("|"):
                    key, _, value = field.strip().partition(": ")
                    name = _FIELDS.get(key)
                    if name is None or value.strip() == "n/a":
                        continue
                    value = value.strip()
                    number = float(value[:-1]) / 100.0 if value.endswith("%") else float(value)
                    series.setdefault(name, []).append((it, number))
                continue
            match = _VALIDATION.search(line)
            if match:
                series.setdefault("validation loss", []).append(
                    (int(match.group(1)), float(match.group(2))))
    return series


def read_run(path):
    """Series of one run: a folder of TensorBoard events, or a log file.

    Raises:
        DataError: the path is missing or holds none of the series.
    """
    if os.path.isdir(path):
        series = read_tensorboard(path) if _event_dirs(path) else {}
    elif os.path.isfile(path):
        series = read_log(path)
    else:
        raise DataError(f"{path} does not exist (give a --tensorboard-dir folder or a log file)")
    if not series:
        raise DataError(f"{path}: no training series found (expected TensorBoard events with "
                        f"'{TAGS['loss']}' or log lines 'iteration N/ M | ... lm loss: ...')")
    return series


def check_matplotlib():
    """Raise a ConfigError saying how to install matplotlib when it is missing."""
    _pyplot()


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plots need matplotlib: pip install 'megatron-tds[plot]'") from None
    matplotlib.use("Agg")  # files only: no display on a cluster node or in CI
    import matplotlib.pyplot as plt

    return plt



def plot_runs(runs, output, title=None):
    """Draw loss, validation loss, tokens/s and MFU of several runs into one PNG.

    Args:
        runs: ``{label: series}`` (series as :func:`read_run` returns).
        output: PNG path.
        title: figure title (default: none).
    """
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, name in zip(axes.flat, TAGS):
        drawn = False
        for label, series in runs.items():
            points = series.get(name)
            if points:
                steps, values = zip(*points)
                values = [v * 100 for v in values] if name == "MFU" else values
                ax.plot(steps, values, marker="o" if len(points) < 30 else None,
                        markersize=3, label=label)
                drawn = True
        ax.set_title(name + (" (%)" if name == "MFU" else ""))
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:  # e.g. MFU on a CPU run, validation without --eval-iters
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)


def plot_tables(results, output, value="vs_eager", label="speed-up vs eager (x)"):
    """Bar charts of benchmark tables: one panel per table, one bar per row and impl.

    Args:
        results: dicts with ``table``, ``op``, ``direction``, ``impl`` and ``value``.
        output: PNG path.
        value: the key to draw.
        label: y-axis label.
    """
    plt = _pyplot()
    tables = list(dict.fromkeys(r["table"] for r in results))
    if not tables:
        raise DataError("no benchmark rows to plot")
    cols = min(len(tables), 3)
    rows = -(-len(tables) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.5 * rows), squeeze=False)
    for ax, table in zip(axes.flat, tables):
        mine = [r for r in results if r["table"] == table]
        cases = list(dict.fromkeys(f"{r['op']} {r['direction']}" for r in mine))
        impls = list(dict.fromkeys(r["impl"] for r in mine))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            heights = [next((r[value] for r in mine if r["impl"] == impl
                             and f"{r['op']} {r['direction']}" == case), 0.0) for case in cases]
            ax.bar([c + i * width for c in range(len(cases))], heights, width, label=impl)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))], cases, fontsize=8)
        ax.set_title(table, fontsize=9)
        ax.set_ylabel(label, fontsize=8)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(tables):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)
