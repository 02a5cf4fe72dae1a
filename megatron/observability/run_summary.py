"""The run's closing line: where its checkpoint, log and event files went.

    > run ended at iteration 300: checkpoint demo/checkpoints/iter_0000300 | log
      demo/logs/20260101-120000-node0.log (this node's) | TensorBoard events
      demo/logs/tensorboard/events.out.tfevents.1767268800.host.123.0

Printed by every node's first process (global rank 0 included) after the final save and the
event file's close; the last rank, which writes the TensorBoard events, tells the others
their name. The line names only what exists where it is printed: a checkpoint folder this
node does not see, or the event file of another node's disk, is said to be elsewhere, and a
run that wrote no events says why. The log file is the run scripts' (examples/
launch_common.sh tees each node's output into ``$LOG_DIR`` and names it in
``MEGATRON_TDS_LOG_FILE``).
"""
import importlib.util
import os
from typing import Any, Optional

from ..checkpoint.format import read_tracker
from ..common.utils import print_node_first
from ..config.run_config import RunConfig

#: Set by examples/launch_common.sh: the file this node's output is copied to.
LOG_FILE_ENV = "MEGATRON_TDS_LOG_FILE"


def event_file(writer: Optional[Any]) -> Optional[str]:
    """The event file a TensorBoard ``SummaryWriter`` (alone, or inside the W&B fan-out)
    writes, or None."""
    for one in getattr(writer, "writers", [writer]):
        file_writer = getattr(one, "file_writer", None)
        name = getattr(getattr(file_writer, "event_writer", None), "_file_name", None)
        if name:
            return name
    return None


def _events_part(cfg: RunConfig, events: Optional[str]) -> Optional[str]:
    """The TensorBoard part of the line (None without --tensorboard-dir)."""
    if events and os.path.isfile(events):
        return f"TensorBoard events {events}"
    if events:
        return f"TensorBoard events {events} (on the last rank's node)"
    if not cfg.logging.tensorboard_dir:
        return None
    if importlib.util.find_spec("tensorboard") is None:
        return ("no TensorBoard events (tensorboard is not installed: pip install "
                "tensorboard)")
    return f"no TensorBoard events in {cfg.logging.tensorboard_dir}"


def closing_line(cfg: RunConfig, iteration: int, events: Optional[str]) -> str:
    """The line (see the module docstring).

    Args:
        cfg: the run configuration.
        iteration: the last iteration.
        events: the event file the last rank wrote, or None.
    """
    parts = []
    save = cfg.checkpoint.save
    saved = read_tracker(save) if save else None
    folder = os.path.join(save, f"iter_{saved:07d}") if saved is not None else None
    if folder is not None and os.path.isdir(folder):
        parts.append(f"checkpoint {folder}")
    elif folder is not None:
        parts.append(f"checkpoint {folder} (not on this node's disk)")
    else:
        parts.append("no checkpoint" + ("" if save else " (no --save)"))
    log_file = os.environ.get(LOG_FILE_ENV)
    parts.append(f"log {log_file} (this node's)" if log_file and os.path.isfile(log_file)
                 else "log: this output only")
    tensorboard = _events_part(cfg, events)
    if tensorboard:
        parts.append(tensorboard)
    if cfg.logging.wandb_project:
        parts.append(f"W&B project {cfg.logging.wandb_project}")
    return f"> run ended at iteration {iteration}: " + " | ".join(parts)


def print_closing_line(cfg: RunConfig, iteration: int, events: Optional[str]) -> None:
    """Print :func:`closing_line` on each node's first process (collective: once every rank
    is done, so rank 0's last lines and its tracker write come first; the last rank's event
    file name reaches the others with it).

    Args:
        cfg: the run configuration.
        iteration: the last iteration.
        events: this rank's event file (the last rank's; None elsewhere).
    """
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()  # rank 0's tracker is written before another node reads it
        shared = [events]
        dist.broadcast_object_list(shared, src=dist.get_world_size() - 1)
        events = shared[0]
    if not dist.is_initialized() or cfg.parallel.local_rank == 0:  # print_node_first's
        print_node_first(cfg, closing_line(cfg, iteration, events))
