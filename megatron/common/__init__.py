"""Shared basics every layer uses: errors, the device, rank-aware printing,
timers and the run's global state."""
