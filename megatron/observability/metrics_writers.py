"""Where the training scalars go: TensorBoard, Weights & Biases, or both.

The training loop writes through one object with TensorBoard's ``add_scalar(tag, value,
step)``; :func:`build_metrics_writer` returns the TensorBoard SummaryWriter alone, a W&B
writer alone, a :class:`FanOutWriter` over both, or None. So W&B gets exactly the scalars
(names and steps) that TensorBoard gets, and the loop does not know which backends run.
"""
import os
from typing import TYPE_CHECKING

from ..common.errors import ConfigError

if TYPE_CHECKING:  # megatron.config sits above this module
    from ..config.run_config import RunConfig


class WandbWriter:
    """``add_scalar`` onto a W&B run (Megatron's ``--wandb-*`` flags).

    Args:
        cfg: the run configuration; uses ``wandb_project``, ``wandb_exp_name``, ``wandb_save_dir``.
    """

    def __init__(self, cfg: "RunConfig"):
        import wandb

        log = cfg.logging
        save_dir = log.wandb_save_dir or os.path.join(cfg.checkpoint.save or ".", "wandb")
        os.makedirs(save_dir, exist_ok=True)
        # Flags as the run's config, as plain values (dtypes become text), as checkpoints hold
        config = dict(sorted(cfg.to_dict().items()))
        self.run = wandb.init(project=log.wandb_project, name=log.wandb_exp_name or None,
                              dir=save_dir, config=config)

    def add_scalar(self, tag, value, step):
        """Log ``value`` under ``tag`` at ``step`` (the iteration), as TensorBoard does."""
        self.run.log({tag: value}, step=step)

    def flush(self):
        """W&B sends on its own; kept for the SummaryWriter interface."""

    def close(self):
        """End the run (writes the offline ``.wandb`` file completely)."""
        self.run.finish()


class FanOutWriter:
    """Forwards ``add_scalar`` / ``flush`` / ``close`` to several writers."""

    def __init__(self, writers):
        self.writers = list(writers)

    def add_scalar(self, tag, value, step):
        for writer in self.writers:
            writer.add_scalar(tag, value, step)

    def flush(self):
        for writer in self.writers:
            writer.flush()

    def close(self):
        for writer in self.writers:
            writer.close()


def build_metrics_writer(cfg: "RunConfig", tensorboard_writer):
    """The writer the training loop logs to on this rank, or None.

    Args:
        cfg: the run configuration (only the last rank, which prints the log line, writes).
        tensorboard_writer: SummaryWriter from ``--tensorboard-dir`` or None.
    """
    if not cfg.logging.wandb_project:
        return tensorboard_writer
    wandb_writer, error = None, None
    if cfg.parallel.rank == cfg.parallel.world - 1:
        try:
            wandb_writer = WandbWriter(cfg)
        except Exception as exc:  # no API key, no network, bad project name...
            error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1]}"
    # Every rank learns whether W&B started: a failure on the logging rank alone would
    # leave the others waiting in their first collective.
    if not _all_ranks_ok(error is None):
        raise ConfigError(f"--wandb-project: W&B did not start on the logging rank "
                          f"({error or 'see the last rank'}); run `wandb login`, or set "
                          f"WANDB_MODE=offline and `wandb sync` later")
    if wandb_writer is None:
        return tensorboard_writer
    if tensorboard_writer is None:
        return wandb_writer
    return FanOutWriter([tensorboard_writer, wandb_writer])


def _all_ranks_ok(ok):
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        return ok
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
