"""The run's closing line: where its checkpoint, log and event files went.

    > run ended at iteration 300: checkpoint demo/checkpoints/iter_0000300 | log
      demo/logs/20260101-120000-node0.log (this node's) | TensorBoard events
      demo/logs/tensorboard/events.out.tfevents.1767268800.host.123.0

Printed once, by the last rank (the one that writes the TensorBoard events), after the final
save and the event file's close. The log file is the run scripts' (examples/launch_common.sh
tees each node's output into ``$LOG_DIR`` and names it in ``MEGATRON_TDS_LOG_FILE``).
"""
import os
from typing import Any, Optional

from ..checkpoint.format import read_tracker
from ..utils import print_rank_last

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


def closing_line(cfg: Any, iteration: int, events: Optional[str]) -> str:
    """The line (see the module docstring)."""
    parts = []
    save = cfg.checkpoint.save
    saved = read_tracker(save) if save else None
    if saved is not None:
        parts.append(f"checkpoint {os.path.join(save, f'iter_{saved:07d}')}")
    else:
        parts.append("no checkpoint" + ("" if save else " (no --save)"))
    log_file = os.environ.get(LOG_FILE_ENV)
    parts.append(f"log {log_file} (this node's)" if log_file else "log: this output only")
    if events:
        parts.append(f"TensorBoard events {events}")
    elif cfg.logging.tensorboard_dir:
        parts.append(f"TensorBoard events in {cfg.logging.tensorboard_dir}")
    if cfg.logging.wandb_project:
        parts.append(f"W&B project {cfg.logging.wandb_project}")
    return f"> run ended at iteration {iteration}: " + " | ".join(parts)


def print_closing_line(cfg: Any, iteration: int, events: Optional[str]) -> None:
    """Print :func:`closing_line` on the last rank (collective: once every rank is done, so
    rank 0's last lines and its tracker write come first)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    print_rank_last(closing_line(cfg, iteration, events))
