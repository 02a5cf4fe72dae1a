"""megatron-tds: Megatron-style 3D-parallel pretraining of GPT-2 and T5."""
__version__ = "0.1.0"
