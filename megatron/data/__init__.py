"""Data pipeline: indexed datasets, GPT-2 / T5 sample datasets, blending and samplers."""
