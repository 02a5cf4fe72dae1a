"""Stop a diverging fp32/bf16 run without ever publishing a checkpoint that cannot resume.

A step's loss is computed with the weights of the step before it, so a finite loss says
nothing about the weights the step then writes. What is known, and when:

- loss of step ``i`` finite: the weights after step ``i - 1`` are good;
- gradient norm of step ``i`` finite (and loss finite): the update of step ``i`` used finite
  gradients, so the weights after step ``i`` are finite too (they may still be huge);
- weights finite at save time: checked directly, once per save.

The checks read the per-step losses and gradient norms kept on the device since the last
log line, at log and save time only (no extra host sync per step), and agree across all
ranks with one small all-reduce so every rank stops together. On failure, the tracker of
``--save`` is pointed back at the newest checkpoint whose weights are known to be good, and
the :class:`~megatron.common.errors.DivergenceError` names it.

fp16 runs skip overflowing steps through the loss scaler instead; for them only the weights
are checked before a save. ``--skip-nonfinite-steps`` gives fp32/bf16 runs the same skip
(Megatron-LM's behaviour), so a step skipped that way is not an error.
"""
import os
import re
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ..common.errors import DivergenceError
from ..common.utils import unwrap_model
from ..config.run_config import RunConfig

_ITER_DIR = re.compile(r"^iter_(\d{7})$")
_OK, _BAD_NORM, _BAD_LOSS = 0, 1, 2


def _step_codes(pending, check_loss):
    """Per pending step: 0 ok (or skipped), 1 non-finite grad norm, 2+ non-finite loss."""
    device = pending[0]["lm loss"].device
    losses = torch.stack([p["lm loss"].float() for p in pending])  # [n]
    norms = torch.stack([torch.as_tensor(p["grad norm"] if p.get("grad norm") is not None
                                         else 0.0, dtype=torch.float64).to(device)
                         for p in pending])  # [n]: device tensors (DDP) or floats (engines)
    skipped = torch.tensor([bool(p.get("skipped")) for p in pending], device=device)
    codes = (~torch.isfinite(norms)).int() * _BAD_NORM
    if check_loss:
        codes = codes + (~torch.isfinite(losses)).int() * _BAD_LOSS
    return torch.where(skipped, torch.zeros_like(codes), codes)


def _all_ranks_max(tensor):
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def check_pending(cfg: RunConfig, iteration: int, pending: List[Dict[str, Any]]) -> None:
    """Raise :class:`DivergenceError` if a step since the last check was not finite.

    Collective when torch.distributed is initialised (every rank calls it at the same point).

    Args:
        cfg: the run configuration (``compute_dtype``, ``save``, ``load``).
        iteration: the iteration of the last entry of ``pending``.
        pending: per-step dicts with ``lm loss`` (device tensor), ``grad norm`` (float or
            None) and ``skipped`` (bool), oldest first.
    """
    if cfg.precision.dtype == torch.float16 or not pending:
        return
    codes = _all_ranks_max(_step_codes(pending, check_loss=True)).tolist()  # the one sync
    first = next((i for i, code in enumerate(codes) if code != _OK), None)
    if first is None:
        return
    step = iteration - len(pending) + first + 1
    if codes[first] >= _BAD_LOSS:
        # the weights after step - 1 produced it: the newest good ones are from step - 2
        _fail(cfg, f"loss is not finite at iteration {step}", step - 2)
    _fail(cfg, f"gradient norm is not finite at iteration {step}", step - 1)


def check_weights(cfg: RunConfig, iteration: int, model: Any) -> None:
    """Before saving ``iteration``: every rank's weights are finite, or raise (collective).

    Args:
        cfg: the run configuration.
        iteration: the iteration about to be saved.
        model: the model or engine whose weights are saved.
    """
    params = [p for p in unwrap_model(model).parameters()]
    if not params:
        return
    finite = torch.stack([torch.isfinite(p.detach()).all() for p in params]).all()
    bad = _all_ranks_max((~finite).int().reshape(1))
    if bad.item():
        _fail(cfg, f"weights are not finite after iteration {iteration}", iteration - 1)


def newest_checkpoint_up_to(root: Optional[str], limit: int) -> Optional[int]:
    """The largest iteration ``<= limit`` with a published ``iter_*`` folder in ``root``."""
    if not root or not os.path.isdir(root):
        return None
    found = [int(m.group(1)) for m in map(_ITER_DIR.match, os.listdir(root)) if m]
    good = [it for it in found if it <= limit]
    return max(good) if good else None


def _fixes(cfg: RunConfig):
    """What the user can change, offering --skip-nonfinite-steps only where the run's backend
    accepts it (the DDP path: megatron/config/validation.py refuses it for DeepSpeed and
    pipeline runs, which skip fp16 overflows only)."""
    from ..config.preflight import uses_deepspeed

    fixes = "lower --lr, set --clip-grad, check the data"
    if uses_deepspeed(cfg):
        return fixes
    return fixes + ", or pass --skip-nonfinite-steps to skip such steps"


def _fail(cfg: RunConfig, what, good_limit):
    """Point the tracker at the newest good checkpoint (rank 0) and raise on every rank."""
    from .checkpointing import TRACKER_FILENAME, read_tracker, write_tracker

    dtype = str(cfg.precision.dtype).replace("torch.", "")
    # the run's own saves first, else the checkpoint it started from
    roots = [r for r in (cfg.checkpoint.save, cfg.checkpoint.load) if r]
    root = next((r for r in roots if newest_checkpoint_up_to(r, good_limit) is not None),
                roots[0] if roots else None)
    good = newest_checkpoint_up_to(root, good_limit)
    fixes = _fixes(cfg)
    if good is None:
        where = f"no checkpoint in {root} is known to be good" if root else \
            "there is no --save folder"
        raise DivergenceError(f"{what} ({dtype}); {where}: start again from scratch and {fixes}")
    note = ""
    current = read_tracker(root) if root == cfg.checkpoint.save else None
    if current is not None and current > good:
        if not dist.is_initialized() or dist.get_rank() == 0:
            write_tracker(root, good)
        later = f"iteration {current}" if current == good + 1 else \
            f"iterations {good + 1}..{current}"
        note = (f"; {TRACKER_FILENAME} now points at it (the checkpoints of {later}, if any, "
                f"hold weights that led to the divergence and are kept for inspection)")
    raise DivergenceError(f"{what} ({dtype}); the newest good checkpoint is iteration {good} in "
                          f"{root}{note}. Resume from it and {fixes}")
