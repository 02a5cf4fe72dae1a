"""The package's import structure: layers in one order, no import circles.

Every ``import`` in megatron/ and tds/ (module level or inside a function) is read with
``ast``; an import may only point to its own layer or a lower one, and the module graph has
no cycle (a package's ``__init__`` counts as a module). Imports inside an
``if TYPE_CHECKING:`` block are skipped: they are read by type checkers only, never run, so
they are no run-time dependency (a lower layer may name a higher one's type that way). docs/architecture.md draws the
layers; a new module must be placed in one of them here.
"""
import ast
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Lowest first. A module belongs to the entry naming it or its nearest parent package
#: ("megatron" names the package's own ``__init__`` only).
LAYERS = [
    ("base", ["megatron", "megatron.common", "megatron.utils", "megatron.global_vars",
              "megatron.resilience", "megatron.observability"]),
    ("pipeline", ["tds.pipe", "tds.comm_ready"]),  # the schedules: generic, no megatron
    ("kernels", ["megatron.fused_kernels"]),  # below mpu: mpu's fused norms call them
    ("mpu", ["megatron.mpu"]),
    ("model", ["megatron.model", "megatron.optimizer", "megatron.distributed"]),
    ("tds", ["tds", "tds.engine"]),  # DeepSpeed's API over the schedules and megatron's step
    ("data", ["megatron.tokenizer", "megatron.data"]),
    ("config", ["megatron.config"]),
    # the resilience modules that read checkpoint directories
    ("checkpoint", ["megatron.checkpoint", "megatron.resilience.async_save",
                    "megatron.resilience.checkpoint_integrity",
                    "megatron.resilience.startup_allowance", "megatron.resilience.watchdog"]),
    ("conversion", ["megatron.checkpoint_conversion"]),
    ("families", ["megatron.families"]),
    ("run", ["megatron.initialize", "megatron.generation", "megatron.text_generation",
             "megatron.memory", "megatron.observability.training_log",
             "megatron.observability.run_summary"]),
    ("training", ["megatron.training", "megatron.resilience.fault_tolerance"]),
    ("launch", ["megatron.launch"]),  # around the training processes: nothing imports it
]


def _modules():
    found = {}
    for package in ("megatron", "tds"):
        for folder, _, files in os.walk(os.path.join(REPO, package)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    dotted = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                    found[dotted[:-len(".__init__")] if dotted.endswith(".__init__")
                          else dotted] = path
    return found


def _targets(module, path, node, modules):
    """The project modules an import statement names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
        if node.level:
            base = ".".join(base.split(".")[:len(base.split(".")) - node.level + 1])
            target = base + ("." + node.module if node.module else "")
        else:
            target = node.module
        names = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target
                 for a in node.names]
    out = set()
    for name in names:
        while name not in modules and "." in name:
            name = name.rsplit(".", 1)[0]
        if name in modules and name != module:
            out.add(name)
    return out


def _type_checking_only(tree):
    """The import nodes under an ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``) body."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and (
                isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
                or isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"):
            skipped |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skipped


def import_graph():
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        graph[module] = set()
        skipped = _type_checking_only(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in skipped:
                graph[module] |= _targets(module, path, node, modules)
    return graph


def layer_of(module):
    """Index in LAYERS of the entry naming ``module`` or its nearest parent package."""
    best = None
    for index, (_, names) in enumerate(LAYERS):
        for name in names:
            inside = module.startswith(name + ".") and name != "megatron"
            if (module == name or inside) and (best is None or len(name) > len(best[1])):
                best = (index, name)
    assert best is not None, f"{module} is in no layer of tests/test_layering.py: place it"
    return best[0]


def test_every_import_points_to_its_layer_or_below():
    graph = import_graph()
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) -> {t} ({LAYERS[layer_of(t)][0]})"
              for m, targets in sorted(graph.items()) for t in sorted(targets)
              if layer_of(t) > layer_of(m)]
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def test_no_import_circles():
    graph = import_graph()
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_pipeline_schedules_import_no_megatron():
    """tds.pipe (schedules, runner, p2p, contract, PipelineModule) is generic: the engine
    adapter (tds.engine) is what joins it to megatron's optimizer step."""
    graph = import_graph()
    bad = [f"{m} -> {t}" for m, ts in graph.items()
           if m.startswith("tds.pipe") or m == "tds.comm_ready"
           for t in ts if t.startswith("megatron")]
    assert not bad, bad


def test_no_module_getattr_workarounds():
    """No ``__getattr__`` at module level in megatron/ (lazy imports around a circle); tds's
    forwards DeepSpeed's own API, which is its contract."""
    offenders = []
    for module, path in _modules().items():
        if not module.startswith("megatron"):
            continue
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in tree.body):
            offenders.append(module)
    assert not offenders, offenders


def test_the_checker_sees_a_planted_upward_import_and_circle(tmp_path, monkeypatch):
    """The walker itself can fail: a fake tree with an upward import and a circle."""
    for rel, text in {"megatron/__init__.py": "", "megatron/mpu/__init__.py":
                      "from ..training import loop\n", "megatron/training/__init__.py": "",
                      "megatron/training/loop.py": "from .. import mpu\n",
                      "tds/__init__.py": ""}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    monkeypatch.setattr(__import__(__name__), "REPO", str(tmp_path))
    graph = import_graph()
    assert "megatron.training.loop" in graph["megatron.mpu"]
    (tmp_path / "megatron/mpu/typed.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..training import loop\n"
        "else:\n    from .. import training\n")
    graph = import_graph()  # the type-only import is no edge; the else branch's is
    assert graph["megatron.mpu.typed"] == {"megatron.training"}
    assert layer_of("megatron.training.loop") > layer_of("megatron.mpu")
    assert "megatron.mpu" in graph["megatron.training.loop"]


def test_start_up_imports_only_what_the_run_uses(gpt2_data, tmp_path):
    """Every rank pays its imports (~1 s each for DeepSpeed and dynamo on a CPU): importing the
    library and the entry scripts loads neither, and a run at pp = 1 without --deepspeed
    (torch DDP) never loads DeepSpeed; --compile's hints load dynamo when asked for."""
    import subprocess
    import sys

    from gpt2_runs import gpt2_argv

    argv = gpt2_argv(gpt2_data, "--batch-size", "2", "--train-iters", "2",
                     "--save", str(tmp_path / "ckpt"), "--save-interval", "2")
    script = f"""
import sys
import megatron.mpu, megatron.model, megatron.training, pretrain_gpt2, pretrain_t5
loaded = lambda: sorted(m for m in ("deepspeed", "tds", "torch._dynamo") if m in sys.modules)
assert loaded() == [], loaded()
pretrain_gpt2.main({argv!r})
assert "deepspeed" not in sys.modules and "tds" not in sys.modules, loaded()
from megatron.model.compile import prepare_for_compile
prepare_for_compile()
assert "torch._dynamo" in sys.modules
print("IMPORTS OK")
"""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, text=True,
                         capture_output=True, timeout=300)
    assert out.returncode == 0 and "IMPORTS OK" in out.stdout, out.stderr[-3000:]


#: What megatron/ may hold besides packages: the Megatron-LM entry point every script calls
#: (``megatron.initialize``) and the old Megatron-LM module paths users import from, kept as
#: re-exports of their new homes.
TOP_LEVEL_MODULES = {"__init__.py", "initialize.py", "utils.py", "global_vars.py",
                     "text_generation.py"}
REEXPORTS = {"megatron.utils": "megatron.common.utils",
             "megatron.global_vars": "megatron.common.global_vars",
             "megatron.text_generation": "megatron.generation.text_generation"}


def test_the_top_level_holds_packages_and_the_named_modules_only():
    top = os.path.join(REPO, "megatron")
    loose = {n for n in os.listdir(top) if n.endswith(".py")}
    assert loose == TOP_LEVEL_MODULES, (
        f"loose modules in megatron/: {sorted(loose - TOP_LEVEL_MODULES)} (put them in the "
        f"package of their purpose); missing: {sorted(TOP_LEVEL_MODULES - loose)}")
    for old, new in REEXPORTS.items():  # a re-export holds its import and nothing else
        tree = ast.parse(open(os.path.join(REPO, *old.split(".")) + ".py").read())
        body = [n for n in tree.body if not isinstance(n, ast.Expr)]  # the docstring
        assert len(body) == 1 and isinstance(body[0], ast.ImportFrom), old
        assert body[0].level == 1 and "megatron." + body[0].module == new, old


def test_megatron_lm_import_paths_still_import():
    """The paths Megatron-LM's users write keep working, naming the same objects."""
    import importlib

    for old, new in REEXPORTS.items():
        old_mod, new_mod = importlib.import_module(old), importlib.import_module(new)
        public = [n for n in vars(new_mod) if not n.startswith("_")
                  and getattr(getattr(new_mod, n), "__module__", None) == new]
        assert public, new
        assert all(getattr(old_mod, n) is getattr(new_mod, n) for n in public), old
    from megatron import mpu  # noqa: F401
    from megatron.initialize import initialize_megatron  # noqa: F401
    from megatron.training import pretrain  # noqa: F401
    from megatron.tokenizer import build_tokenizer  # noqa: F401
    from megatron.utils import print_rank_0  # noqa: F401
    from megatron.global_vars import get_args  # noqa: F401
    from megatron.text_generation import generate  # noqa: F401
