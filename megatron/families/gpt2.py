"""GPT-2's hooks: model config from flags, model, datasets, FLOP count, conversion keys."""
from . import ModelFamily, pipeline_topology, transformer_kwargs


def model_config(flags, dropout=True):
    """The :class:`~megatron.model.transformer.TransformerConfig` of a run or a checkpoint
    (arguments: :func:`megatron.families.transformer_kwargs`)."""
    from ..model.transformer import TransformerConfig

    return TransformerConfig(**transformer_kwargs(flags, dropout),
                             init_method_std=flags.init_method_std, bias=flags.hidden_bias)


def build_model(cfg, pipeline, parallel_output=True):
    """GPT2Model, or GPT2ModelPipe (a tds PipelineModule) when ``pipeline``."""
    config = model_config(cfg)
    if pipeline:
        from ..model.gpt2_model_pipe import GPT2ModelPipe

        return GPT2ModelPipe(config, cfg.padded_vocab_size, cfg.max_position_embeddings,
                             pipeline_topology())
    from ..model.gpt2_model import GPT2Model

    return GPT2Model(config, cfg.padded_vocab_size, cfg.max_position_embeddings,
                     parallel_output)


def build_datasets(cfg, tokenizer, num_samples):
    """Train/valid/test GPT-2 datasets (None for an empty split)."""
    from ..data.gpt2_dataset import build_train_valid_test_datasets

    return build_train_valid_test_datasets(
        data_prefix=cfg.data_path, splits_string=cfg.split,
        train_valid_test_num_samples=num_samples, seq_length=cfg.seq_length, seed=cfg.seed)


def flops_per_step(cfg):
    """Megatron's count for one step of a GPT model (no recompute):
    72 * B * s * l * h^2 * (1 + s / (6 h) + V / (12 l h)), B = global batch.
    """
    b, s, layers, h = cfg.global_batch_size, cfg.seq_length, cfg.num_layers, cfg.hidden_size
    vocab = cfg.padded_vocab_size
    return 72.0 * b * s * layers * h * h * (1.0 + s / (6.0 * h) + vocab / (12.0 * layers * h))


def _add_flags(parser):
    return parser


def _keys():
    from ..checkpoint_conversion import gpt2_keys

    return gpt2_keys


FAMILY = ModelFamily(
    name="gpt2", add_flags=_add_flags, model_config=model_config, build_model=build_model,
    build_datasets=build_datasets, flops_per_step=flops_per_step, keys=_keys,
    flag_defaults={"tokenizer_type": "GPT2BPETokenizer"})
