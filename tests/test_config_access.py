"""Library code reads the run configuration through its typed sections, under one name.

``cfg.model.hidden_size``, ``cfg.parallel.tp``, ``cfg.t5.enc_seq_length`` in megatron/;
flat reads (``args.hidden_size``) stay for users' Megatron-style providers. The validation
pass (megatron/config and the families' ``derive`` / ``validate`` hooks) works on the
argparse namespace, named ``ns``, before the configuration is frozen.
"""
import ast
import os

from megatron.config import SECTIONS, build_parser
from megatron.families import get_family

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN_CONFIG_NAMES = ("args", "cfg", "flags")
DERIVED = {"world_size", "rank", "data_parallel_size", "compute_dtype", "params_dtype",
           "padded_vocab_size", "true_vocab_size", "lr_warmup_iters", "layer_stacks"}


def _flag_names():
    names = set(DERIVED)
    for family in ("gpt2", "t5"):
        names |= {a.dest for a in build_parser(family=get_family(family))._actions}
    return names - {"help"} - set(SECTIONS) - {"t5"}


def flat_reads(root):
    """``(file, line, text)`` of every ``args.<flag>`` / ``cfg.<flag>`` / ``flags.<flag>``
    read in library code outside megatron/config."""
    flags, found = _flag_names(), []
    for folder, _, files in os.walk(os.path.join(root, "megatron")):
        if os.path.relpath(folder, root).startswith(os.path.join("megatron", "config")):
            continue
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path, encoding="utf-8").read(), path)):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                        node.value.id in RUN_CONFIG_NAMES and node.attr in flags:
                    found.append((os.path.relpath(path, root), node.lineno,
                                  f"{node.value.id}.{node.attr}"))
    return found


def test_library_code_reads_typed_sections():
    found = flat_reads(REPO)
    assert not found, "flat run-configuration reads in library code:\n" + "\n".join(
        f"{path}:{line}: {text}" for path, line, text in found)


def test_the_check_finds_a_planted_flat_read(tmp_path):
    (tmp_path / "megatron" / "training").mkdir(parents=True)
    (tmp_path / "megatron" / "training" / "x.py").write_text(
        "def f(cfg):\n    return cfg.model.hidden_size + cfg.hidden_size\n")
    assert flat_reads(str(tmp_path)) == [(os.path.join("megatron", "training", "x.py"), 2,
                                          "cfg.hidden_size")]
