"""--context-parallel-size / --cp-comm-type and the document-masking flags: parsed, carried
in the run configuration and the YAML block, and refused with a message naming the numbers
when they cannot work, before any process group (on every rank of a launch)."""
import pytest

from megatron.config import parse_args
from megatron.common.errors import ConfigError

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8",
        "--seq-length", "64", "--batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
        "--tokenizer-type", "GPT2BPETokenizer", "--attention-dropout", "0"]


def _parse(*extra, world_size=8, **kw):
    return parse_args(BASE + list(extra), world_size=world_size, rank=0, check_files=False,
                      **kw)


def test_context_parallel_size_takes_its_share_of_the_world():
    args = _parse("--context-parallel-size", "2", "--model-parallel-size", "2",
                  "--cp-comm-type", "a2a")
    assert (args.context_parallel_size, args.data_parallel_size, args.cp_comm_type) == \
        (2, 2, "a2a")
    default = _parse()
    assert (default.context_parallel_size, default.cp_comm_type) == (1, "p2p")
    assert not default.reset_attention_mask and not default.reset_position_ids


def test_run_config_sections_and_yaml_block(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("parallel_config:\n  context_parallel: 4\n  data_parallel: 2\n"
                      "reset_attention_mask: true\n")
    cfg = _parse("--config", str(config), "--reset-position-ids")
    assert (cfg.parallel.cp, cfg.parallel.dp, cfg.parallel.cp_comm_type) == (4, 2, "p2p")
    assert cfg.data.reset_attention_mask and cfg.data.reset_position_ids


@pytest.mark.parametrize("extra,world,message", [
    (("--context-parallel-size", "3"), 6,
     r"--seq-length \(64\) is not divisible by 6; use a length that is a multiple of 6"),
    (("--context-parallel-size", "4"), 6,
     r"world size \(6\) is not divisible by .* x context-parallel size \(4\)"),
    (("--context-parallel-size", "2", "--cp-comm-type", "a2a", "--model-parallel-size", "2",
      "--num-attention-heads", "6", "--hidden-size", "48"),
     8, r"a2a gives each of the 2 context-parallel ranks whole heads, but each "
        r"tensor-parallel rank has 3 \(--num-attention-heads 6 / tp 2\), not divisible by 2"),
    (("--context-parallel-size", "2", "--attention-dropout", "0.1"), 8,
     r"does not implement attention dropout \(--attention-dropout 0.1\); set "
     r"--attention-dropout 0"),
    (("--context-parallel-size", "2", "--model-parallel-size", "4", "--sequence-parallel",
      "--seq-length", "12", "--max-position-embeddings", "12"), 8,
     r"splits each rank's 6 tokens .* across the 4 tensor-parallel ranks"),
    (("--context-parallel-size", "0",), 8, r"--context-parallel-size must be >= 1"),
])
def test_bad_context_parallel_settings_name_the_numbers(extra, world, message):
    with pytest.raises(ConfigError, match=message):
        _parse(*extra, world_size=world)


def test_t5_refuses_context_parallelism_and_document_masking():
    from megatron.families import get_family

    t5 = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
          "--kv-channels", "8", "--ffn-hidden-size", "128", "--encoder-seq-length", "64",
          "--decoder-seq-length", "16", "--batch-size", "2", "--train-iters", "10",
          "--lr", "1e-3", "--tokenizer-type", "GPT2BPETokenizer", "--attention-dropout", "0"]
    with pytest.raises(ConfigError, match=r"--context-parallel-size is not supported by the "
                                          r"'t5' model family"):
        parse_args(t5 + ["--context-parallel-size", "2"], world_size=2, rank=0,
                   check_files=False, family=get_family("t5"))
    with pytest.raises(ConfigError, match=r"--reset-attention-mask / --reset-position-ids is "
                                          r"not supported by the 't5'"):
        parse_args(t5 + ["--reset-attention-mask"], world_size=1, rank=0, check_files=False,
                   family=get_family("t5"))


def test_a_family_provides_context_parallelism_through_its_model_configs_token_layout():
    """A family declaring no ``supports`` gets cp and document masking when its model config
    carries ``token_layout`` (the attention then takes mpu's layout), and is refused
    otherwise (issue 45's provided features)."""
    from dataclasses import dataclass

    from megatron.families import ModelFamily, uses_token_layout

    @dataclass
    class WithLayout:
        token_layout: bool

    @dataclass
    class Without:
        hidden: int = 1

    def family(model_config):
        return ModelFamily(name="mine", add_flags=lambda p: p, model_config=model_config,
                           build_model=None, build_datasets=None, flops_per_step=None,
                           make_batch_fn=None, loss_fn=None)

    provides = family(lambda cfg, dropout=True: WithLayout(uses_token_layout(cfg)))
    for extra in (("--context-parallel-size", "2"), ("--reset-attention-mask",)):
        assert _parse(*extra, family=provides).model_family is provides
        with pytest.raises(ConfigError, match=r"not supported by the 'mine' model family: its "
                                              r"model config \(Without\) does not carry "
                                              r"token_layout=True"):
            _parse(*extra, family=family(lambda cfg, dropout=True: Without()))
