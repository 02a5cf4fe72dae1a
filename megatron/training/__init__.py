"""Training: the loop (loop.py), the backend that runs a step (backend*.py), save/resume of a
run (checkpointing.py, over megatron.checkpoint), the data iterators and the log line.

    from megatron.training import pretrain
"""
from .loop import TrainState, evaluate, pretrain, train, train_step

__all__ = ["TrainState", "evaluate", "pretrain", "train", "train_step"]
