"""tds: ``import tds as deepspeed`` (DeepSpeed's API with a typed multi-tensor pipeline engine).

Placeholder until the pipeline engine lands: it re-exports nothing yet.
"""
__version__ = "0.1.0"
