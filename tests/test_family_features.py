"""A family's optional features are what it provides: the pipeline ones through its
``build_model(cfg, pipeline=True)`` (checked when it is built), sequence parallelism and
recompute when the model config it builds carries them; a declared ``supports`` narrows
them. (tests/test_bert_example.py trains a family written before ``supports`` existed at pp 2;
tests/test_family_outside.py refuses a flag outside a declared ``supports``.)"""
import dataclasses
import types

import pytest

from megatron.config import parse_args
from megatron.common.errors import ConfigError

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8",
        "--seq-length", "32", "--batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
        "--tokenizer-type", "GPT2BPETokenizer"]


def _family(**changes):
    from megatron.families import get_family

    return dataclasses.replace(get_family("gpt2"), **{"name": "mine", "supports": None,
                                                      **changes})


def _parse(family, *extra, world_size=2):
    return parse_args(BASE + list(extra), world_size=world_size, rank=0, check_files=False,
                      family=family)


def _bare_config(cfg, dropout=True):
    """A model config that carries neither switch: the layers never see the flags."""
    return types.SimpleNamespace(num_layers=cfg.model.num_layers)


def test_features_come_from_the_model_config_and_supports_narrows_them():
    provided = _family()  # GPT-2's config carries sequence_parallel and recompute
    args = _parse(provided, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                  "--checkpoint-activations")
    assert args.sequence_parallel and args.checkpoint_activations
    assert _parse(provided, "--pipeline-model-parallel-size", "2").pipeline_model_parallel_size \
        == 2  # provided by build_model(pipeline=True): checked when it is built
    bare = _family(model_config=_bare_config)
    with pytest.raises(ConfigError) as caught:
        _parse(bare, "--tensor-model-parallel-size", "2", "--sequence-parallel",
               "--checkpoint-activations")
    message = str(caught.value)
    for flag, name in (("--sequence-parallel", "sequence_parallel"),
                       ("--checkpoint-activations", "checkpoint_activations")):
        assert f"{flag} is not supported by the 'mine' model family: its model config " \
               f"(SimpleNamespace) does not carry {name}=True" in message
    narrowed = _family(supports=frozenset({"pipeline"}))
    with pytest.raises(ConfigError, match=r"--checkpoint-activations is not supported by the "
                                          r"'mine' model family \(its supports declares "
                                          r"pipeline\)"):
        _parse(narrowed, "--checkpoint-activations")


def test_a_pipeline_run_refuses_a_model_that_is_not_a_pipeline_module():
    import torch

    from megatron.training.backend_factory import check_pipeline_module

    family = _family()
    cfg = _parse(family, "--pipeline-model-parallel-size", "2")
    with pytest.raises(ConfigError, match=r"--pipeline-model-parallel-size 2: the 'mine' model "
                                          r"family's build_model\(cfg, pipeline=True\) returned "
                                          r"a Linear, not a tds PipelineModule"):
        check_pipeline_module(torch.nn.Linear(2, 2), cfg)


def test_conversion_of_a_family_without_a_name_table_says_so(tmp_path):
    """tools/convert_checkpoint.py --family (a registered name here) of a family with no HF
    name table: an HF input is refused by name, and nothing is written."""
    import importlib.util
    import json
    import os

    from megatron import families

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "convert_checkpoint", os.path.join(root, "tools", "convert_checkpoint.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "bert"}))
    families.register("mine", _family)
    try:
        with pytest.raises(ConfigError, match=r"the 'mine' model family declares no Hugging "
                                              r"Face name table \(ModelFamily.hf_names\)"):
            tool.main.__wrapped__(["--family", "mine", "--input", str(hf), "--output",
                                   str(tmp_path / "out")])
    finally:
        families._FACTORIES.pop("mine")
    assert not (tmp_path / "out").exists()


def test_load_family_by_import_path_file_or_name(tmp_path):
    from megatron.families import get_family, load_family
    from megatron.families.gpt2 import FAMILY

    assert load_family("megatron.families.gpt2:FAMILY") is FAMILY is get_family("gpt2")
    assert load_family("gpt2") is FAMILY
    mine = tmp_path / "mine.py"
    mine.write_text("import dataclasses\nfrom megatron.families.gpt2 import FAMILY\n"
                    "MINE = dataclasses.replace(FAMILY, name='mine')\nNOT = 3\n")
    assert load_family(f"{mine}:MINE").name == "mine"
    for spec, message in ((f"{mine}:NOPE", "has no 'NOPE'"),
                          (f"{mine}:NOT", r"NOT is not a megatron.families.ModelFamily "
                                          r"\(its type: int\)"),
                          ("no_such_module_here:X", "cannot import 'no_such_module_here'")):
        with pytest.raises(ConfigError, match=message):
            load_family(spec)
