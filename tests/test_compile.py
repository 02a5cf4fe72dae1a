"""``compile_layers`` (per-layer compile, kept for a user's module and comparisons) and what
``--compile`` does with a family's ``compile_classes``. Training through ``--compile`` (each
pipeline chunk one region) against eager is tests/test_compile_regions.py.
"""
from harness import run_distributed


def _compile_tiny_gpt2():
    from megatron import mpu
    from megatron.model.compile import compile_layers
    from megatron.model.gpt2_model import GPT2Model
    from megatron.model.transformer import TransformerConfig

    mpu.initialize_model_parallel(1, 1)
    config = TransformerConfig(num_layers=3, hidden_size=16, num_attention_heads=2,
                               kv_channels=8, ffn_hidden_size=32)
    model = GPT2Model(config, 64, 8)
    names = list(model.state_dict())
    count = compile_layers(model)
    return count, names == list(model.state_dict())


def test_compile_layers_compiles_each_block_in_place():
    count, same_names = run_distributed(_compile_tiny_gpt2, 1)[0]
    assert count == 3 and same_names  # checkpoints keep their keys


def _compile_counts_by_classes():
    """compile_layers with None (the built-in blocks), () (nothing) and a class; and what
    --compile does with a family whose compile_classes is () (nothing) or a class (the whole
    model, its loss included, as one region)."""
    import contextlib
    import io
    import types

    from megatron import mpu
    from megatron.model.compile import compile_layers, regions_of
    from megatron.model.gpt2_model import GPT2Model
    from megatron.model.transformer import ParallelTransformerLayer, TransformerConfig
    from megatron.training.backend_factory import _compile

    mpu.initialize_model_parallel(1, 1)
    config = TransformerConfig(num_layers=3, hidden_size=16, num_attention_heads=2,
                               kv_channels=8, ffn_hidden_size=32)

    def compiled(model):
        return sum(hasattr(m, "_compiled_call_impl") and m._compiled_call_impl is not None
                   for m in model.modules())

    counts = {}
    for name, classes in (("none", None), ("empty", ()), ("class", (ParallelTransformerLayer,))):
        model = GPT2Model(config, 64, 8)
        counts[name] = (compile_layers(model, classes), compiled(model))
    logs = {}
    for name, classes in (("empty", ()), ("class", (ParallelTransformerLayer,))):
        model = GPT2Model(config, 64, 8)
        family = types.SimpleNamespace(name="mine", compile_classes=classes, loss_fn=None)
        cfg = types.SimpleNamespace(model_family=family,
                                    parallel=types.SimpleNamespace(pipeline_schedule="1f1b"),
                                    kernels=types.SimpleNamespace(cuda_graphs=False))
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            _compile(model, cfg, pipeline=False)
        logs[name] = (out.getvalue(), regions_of(model) is not None)
    return counts, logs


def test_compile_classes_none_means_the_built_in_blocks_and_empty_means_nothing():
    counts, logs = run_distributed(_compile_counts_by_classes, 1)[0]
    assert counts == {"none": (3, 3), "empty": (0, 0), "class": (3, 3)}
    log, regions = logs["empty"]
    assert not regions and "--compile compiled nothing" in log and "'mine'" in log, log
    log, regions = logs["class"]
    assert regions and "the model as one region" in log, log
