"""Keeping a run alive and its files whole: rank agreement, locks, durable
writes, the watchdog, preemption, asynchronous saves and checkpoint integrity."""
