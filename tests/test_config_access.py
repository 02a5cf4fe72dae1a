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


#: End-of-line markers of a ``getattr`` whose object only looks like the run configuration:
#: ``# saved args`` for a namespace read from an old checkpoint (it may lack newer fields),
#: ``# user args`` for a user's own namespace handed through DeepSpeed's API.
NOT_A_RUN_CONFIG = ("# saved args", "# user args")
CONFIG_ROOTS = ("cfg", "args", "self.cfg")
ANY_NAMES = ("cfg", "run_config")


def declared_fields():
    """Every name :class:`RunConfig` declares: its public slots, its sections and their
    fields (the families' own sections included)."""
    from dataclasses import fields

    from megatron.config import RunConfig

    names = {s for s in RunConfig.__slots__ if not s.startswith("_")} | set(SECTIONS)
    sections = list(SECTIONS.values())
    for family in ("gpt2", "t5"):
        if get_family(family).settings is not None:
            names.add(family)
            sections.append(get_family(family).settings)
    for section in sections:
        names |= {f.name for f in fields(section)}
    return names


def _root(node):
    """``cfg`` / ``args`` / ``self.cfg`` when ``node`` is an attribute chain starting there."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                node.value.id == "self":
            return f"self.{node.attr}"
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def _is_any(annotation):
    return isinstance(annotation, ast.Name) and annotation.id == "Any" or \
        isinstance(annotation, ast.Constant) and annotation.value == "Any"


def untyped_config_uses(source, path="<planted>"):
    """``(line, text)`` of each ``getattr(<cfg/args/self.cfg ...>, "<declared field>", ...)``
    (unless marked :data:`NOT_A_RUN_CONFIG`) and each ``cfg: Any`` / ``run_config: Any``
    parameter in ``source``."""
    declared, lines, found = declared_fields(), source.splitlines(), []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "getattr" and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and node.args[1].value in declared and \
                _root(node.args[0]) in CONFIG_ROOTS:
            text = "\n".join(lines[node.lineno - 1:node.end_lineno])
            if not any(marker in text for marker in NOT_A_RUN_CONFIG):
                found.append((node.lineno, f"getattr({ast.unparse(node.args[0])}, "
                                           f"{node.args[1].value!r}, ...)"))
        elif isinstance(node, ast.arg) and node.arg in ANY_NAMES and _is_any(node.annotation):
            found.append((node.lineno, f"{node.arg}: Any"))
    return found


def library_files(root):
    for package in ("megatron", "tds"):
        for folder, _, files in os.walk(os.path.join(root, package)):
            if os.path.relpath(folder, root).startswith(os.path.join("megatron", "config")):
                continue
            yield from (os.path.join(folder, n) for n in sorted(files) if n.endswith(".py"))


def test_library_code_reads_declared_fields_of_a_typed_run_config():
    found = [f"{os.path.relpath(path, REPO)}:{line}: {text}" for path in library_files(REPO)
             for line, text in untyped_config_uses(open(path, encoding="utf-8").read(), path)]
    assert not found, ("run-configuration reads through getattr with a default, or cfg typed "
                       "Any (read the declared field; type cfg: RunConfig or the section):\n"
                       + "\n".join(found))


def test_the_check_finds_a_planted_getattr_and_any():
    planted = '''
from typing import Any


def f(cfg: Any, args, run_config: "Any", other: Any):
    a = getattr(cfg.parallel, "pipeline_schedule", "1f1b")
    b = getattr(cfg, "model_family", None)
    c = getattr(args, "hidden_size", 0)
    d = getattr(args, "hidden_size", 0)  # saved args: an old checkpoint's namespace
    e = getattr(other, "hidden_size", 0)
    f = getattr(cfg, "not_a_field_anywhere", 0)
    return getattr(self.cfg.model,
                   "num_layers", 1)
'''
    assert untyped_config_uses(planted) == [
        (5, "cfg: Any"), (5, "run_config: Any"),
        (6, "getattr(cfg.parallel, 'pipeline_schedule', ...)"),
        (7, "getattr(cfg, 'model_family', ...)"), (8, "getattr(args, 'hidden_size', ...)"),
        (12, "getattr(self.cfg.model, 'num_layers', ...)")]


def test_megatron_names_the_schedules_tds_defines():
    """megatron.config spells the schedule names once for megatron (importing tds at start-up
    would load DeepSpeed); they are tds.pipe.schedules' own."""
    from megatron.config import PIPELINE_SCHEDULES, V_SCHEDULE, ZERO_BUBBLE_SCHEDULES
    from tds.pipe.schedules import SCHEDULES, ZERO_BUBBLE

    assert PIPELINE_SCHEDULES == SCHEDULES and ZERO_BUBBLE_SCHEDULES == ZERO_BUBBLE
    assert V_SCHEDULE in ZERO_BUBBLE
