"""tds is built on DeepSpeed's public API only, and changes nothing of DeepSpeed's.

Static: every name tds takes from ``deepspeed`` (an import, or an attribute of an imported
DeepSpeed module) is in :data:`DOCUMENTED`, DeepSpeed's documented API (deepspeed.readthedocs.io:
"Pipeline Parallelism" for ``deepspeed.pipe`` and ``deepspeed.runtime.pipe.topology``,
"Activation Checkpointing" for ``deepspeed.checkpointing``, "Communication" for
``deepspeed.comm``, "Training Setup" / "Model Checkpointing" for the top level); no
``__class__`` is assigned and no attribute of a DeepSpeed object is set in tds's code but
the one data entry listed in :data:`DATA_SET`. At run time: after tds is imported and its
pipeline engine has trained a step, every function and class attribute of DeepSpeed's
modules that tds touches is the same object as before.
"""
import ast
import os

from harness import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DOCUMENTED = {
    # top level (Training Setup, Model Checkpointing)
    "deepspeed", "deepspeed.initialize", "deepspeed.init_distributed", "deepspeed.add_config_arguments",
    "deepspeed.DeepSpeedConfig", "deepspeed.DeepSpeedEngine", "deepspeed.zero",
    "deepspeed.checkpointing", "deepspeed.comm", "deepspeed.pipe", "deepspeed.ops",
    "deepspeed.__version__",
    # Pipeline Parallelism
    "deepspeed.pipe.PipelineModule", "deepspeed.pipe.LayerSpec", "deepspeed.pipe.TiedLayerSpec",
    "deepspeed.runtime.pipe.topology.ProcessTopology",
    "deepspeed.runtime.pipe.topology.PipeModelDataParallelTopology",
    # Activation Checkpointing (non_reentrant_checkpoint: the config's pipeline.use_reentrant)
    "deepspeed.checkpointing.checkpoint", "deepspeed.checkpointing.non_reentrant_checkpoint",
    # Communication
    "deepspeed.comm.init_distributed", "deepspeed.comm.is_initialized",
}
#: Data (not code) of DeepSpeed's that tds sets: the op-compatibility table's entry for the
#: CPU shared-memory all-reduce, which only DeepSpeed's inference uses (its JIT build costs a
#: minute at the first communication start-up on a CPU).
DATA_SET = {"deepspeed.ops.__compatible_ops__"}


def _tds_files():
    for folder, _, files in os.walk(os.path.join(REPO, "tds")):
        for name in files:
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def _deepspeed_names(path):
    """Dotted DeepSpeed names the file uses, and the DeepSpeed names it assigns to."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    aliases, used, assigned = {}, set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "deepspeed":
                    aliases[alias.asname or alias.name.split(".")[0]] = \
                        alias.name if alias.asname else "deepspeed"
                    used.add(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and \
                node.module.split(".")[0] == "deepspeed" and not node.level:
            for alias in node.names:
                used.add(f"{node.module}.{alias.name}")
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"

    def dotted(node):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id in aliases:
            return ".".join([aliases[node.id]] + parts[::-1])
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = dotted(node)
            if name is not None:
                used.add(name)
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and \
                len(node.args) >= 2 and isinstance(node.args[1], ast.Constant):
            base = dotted(node.args[0]) or (aliases.get(node.args[0].id)
                                           if isinstance(node.args[0], ast.Name) else None)
            if base is not None:
                used.add(f"{base}.{node.args[1].value}")
        if isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute) and sub.attr == "__class__":
                        assigned.add(f"{ast.unparse(sub)} (a __class__ assignment)")
                    if isinstance(sub, (ast.Attribute, ast.Subscript)):
                        base = sub.value if isinstance(sub, ast.Subscript) else sub
                        name = dotted(base)
                        if name is not None:
                            assigned.add(name)
    return used, assigned


def _collected():
    used, assigned = {}, {}
    for path in _tds_files():
        u, a = _deepspeed_names(path)
        rel = os.path.relpath(path, REPO)
        for name in u:
            used.setdefault(name, []).append(rel)
        for name in a:
            assigned.setdefault(name, []).append(rel)
    return used, assigned


def _compatible_ops_entry(path):
    """tds/__init__.py sets one entry of ``deepspeed.ops.__compatible_ops__`` (a dict it
    fetched with getattr): that is the only write, by its key."""
    source = open(path, encoding="utf-8").read()
    return 'compatible["deepspeed_shm_comm"] = False' in source


def test_tds_uses_only_deepspeeds_documented_api():
    used, assigned = _collected()
    undocumented = {name: files for name, files in used.items()
                    if name not in DOCUMENTED | DATA_SET}
    assert not undocumented, undocumented
    assert "deepspeed.runtime.pipe.engine.PipelineEngine" not in used  # no subclass of it
    assert not assigned, assigned  # no DeepSpeed attribute or class is set
    assert _compatible_ops_entry(os.path.join(REPO, "tds", "__init__.py"))


def test_the_checker_sees_an_undocumented_import_and_a_patch(tmp_path):
    """The walker itself can fail."""
    path = tmp_path / "bad.py"
    path.write_text("import deepspeed.runtime.utils as ds_utils\n"
                    "from deepspeed.runtime.engine import DeepSpeedEngine\n"
                    "ds_utils.mask_nan_or_inf_with_val_inplace = print\n"
                    "def f(opt):\n    opt.__class__ = int\n")
    used, assigned = _deepspeed_names(str(path))
    assert "deepspeed.runtime.engine.DeepSpeedEngine" in used
    assert "deepspeed.runtime.utils.mask_nan_or_inf_with_val_inplace" in assigned
    assert any("__class__" in name for name in assigned)


MODULES = ("deepspeed", "deepspeed.comm", "deepspeed.comm.torch", "deepspeed.pipe",
           "deepspeed.runtime.pipe.module", "deepspeed.runtime.pipe.engine",
           "deepspeed.runtime.engine", "deepspeed.runtime.activation_checkpointing.checkpointing",
           "deepspeed.runtime.zero.stage_1_and_2", "deepspeed.runtime.bf16_optimizer",
           "deepspeed.runtime.utils")


def _snapshot():
    """id() of every function and class attribute of DeepSpeed's modules tds touches."""
    import importlib
    import inspect

    ids = {}
    for name in MODULES:
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            if inspect.isfunction(value) or inspect.isclass(value):
                ids[f"{name}.{attr}"] = id(value)
            if inspect.isclass(value) and value.__module__.startswith("deepspeed"):
                for member, item in vars(value).items():
                    ids[f"{name}.{attr}.{member}"] = id(item)
    return ids


class _First(__import__("torch").nn.Linear):
    def forward(self, inputs):
        return (super().forward(inputs[0] if isinstance(inputs, tuple) else inputs),)


class _Last(__import__("torch").nn.Linear):
    def forward(self, inputs):
        return super().forward(inputs[0])


def _train_a_step_between_snapshots():
    import torch
    import torch.nn.functional as F

    before = _snapshot()
    import tds
    from megatron import mpu
    from tds.pipe import LayerSpec, PipeModelDataParallelTopology, PipelineModule

    mpu.initialize_model_parallel(1, 2)
    torch.manual_seed(0)
    specs = [LayerSpec(_First, 4, 4), LayerSpec(_Last, 4, 3)]
    model = PipelineModule(layers=specs, topology=PipeModelDataParallelTopology(2, 1, 1),
                           loss_fn=lambda out, y: F.cross_entropy(out, y))
    model._input_type, model._input_grad = ["float"], [True]
    engine, *_ = tds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(),
                                                                      lr=0.1),
                                config={"train_micro_batch_size_per_gpu": 2,
                                        "gradient_accumulation_steps": 2,
                                        "gradient_clipping": 1.0})
    data = iter([((torch.randn(2, 4),), torch.randint(0, 3, (2,))) for _ in range(2)])
    loss = float(engine.train_batch(data))
    after = _snapshot()
    changed = sorted(k for k in before if after.get(k) != before[k])
    return changed, loss


def test_deepspeed_is_unchanged_after_tds_trains_a_step():
    for changed, loss in run_distributed(_train_a_step_between_snapshots, 2):
        assert changed == [] and loss > 0, changed
