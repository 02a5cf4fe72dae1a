"""Rank bodies of tests/test_memory_peak_cp.py: the whole peak of a real training step per
layout (tests/memory_peak_runs.py's method), each layout with its own family."""
from memory_peak_runs import measure_peak


def measure_layouts(layouts, vocab, seed):
    """:func:`~memory_peak_runs.measure_peak` of each ``(family, argv)`` of ``layouts``."""
    return [measure_peak(argv, vocab, seed, family) for family, argv in layouts]
