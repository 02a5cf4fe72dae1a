"""What the run scripts (examples/launch_common.sh) run around the training processes.

- :mod:`.check`: the run's settings, checked once in one process before any launcher
  starts (``python -m megatron.launch.check``): a bad setting is one message and exit 2,
  never a torchrun restart loop.
- :mod:`.torchrun`: torchrun with a run's stop (``python -m megatron.launch.torchrun``):
  Ctrl-C or SIGTERM saves and exits 0, a second Ctrl-C aborts, the rendezvous says whom it
  waits for, and a failed run ends in one line per failed rank.

Nothing in the training library imports this package (the top layer of
tests/test_layering.py).
"""
