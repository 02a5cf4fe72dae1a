"""Run a CPM-1-Pretrain checkout's own models against this project and compare with serial.

    python tools/check_cpm1_checkout.py --cpm1 /path/to/CPM-1-Pretrain \
        [--models gpt2 t5] [--layouts tp2 pp2 tp2xpp2] [--ckpt both|on|off] [--steps 5] \
        [--project DIR] [--keep]

Issue 34: CPM-1's unmodified ``GPT2Model`` / ``GPT2ModelPipe`` / ``T5Model`` /
``T5ModelPipe`` (from its ``pretrain_*.py`` ``model_provider``), its ``initialize.py`` calls
and its ``forward_step`` / ``get_batch_pipe`` run against this project through docs/mpu.md's
redirect alone (CPM-1's ``tds/`` left out: ``import tds as deepspeed`` is ours), each case on
4 fresh CPU processes (gloo): tp=2 (dp 2), pp=2 (dp 2), tp=2 x pp=2, with and without
``--checkpoint-activations``. A serial run (plain PyTorch: SGD, torch's ``clip_grad_norm_``
at 1.0) draws the weights; each case loads them (sliced per tensor rank, renamed for the
pipeline), trains as CPM-1's ``training.py`` does (``deepspeed.initialize``, CPM-1's
ds_config in fp32, ``gradient_clipping`` 1.0) and must give the serial per-step losses
within 1e-5. Prints the command, the machine and a row per case; exits 1 on a larger
difference or any failure (a rank's error, a serial weight no rank loaded, no recompute under
``--checkpoint-activations``, a gradient norm clipping would not touch).

The checkout is copied (without ``tds/`` and ``.git``), never changed.
tests/test_cpm1_checkout_tool.py runs this machinery on tests/compat_models/cpm1_models.py.
"""
import argparse
import contextlib
import importlib
import importlib.util
import json
import multiprocessing
import os
import platform
import queue
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import types
from typing import NamedTuple

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {"tp2": (2, 0), "pp2": (1, 2), "tp2xpp2": (2, 2)}
WORLD, TOLERANCE, CLIP, LR = 4, 1e-5, 1.0, 0.1
MICRO, GAS, SEQ, DEC_SEQ, VOCAB, SEED = 2, 4, 8, 6, 64, 1234
#: What the rank processes fork from (a forkserver) has imported, once for every rank.
#: Nothing of the project: Python 3.11's forkserver ignores the parent's sys.path (the
#: ranks get it), and a CPM-1 checkout brings its own package named megatron.
PRELOAD = ["torch", "torch.distributed", "numpy", "deepspeed"]


class Case(NamedTuple):
    model: str        # "gpt2" or "t5"
    tp: int
    pp: int           # CPM-1's --pipe-parallel-size (0: no pipeline)
    ckpt: bool        # --checkpoint-activations
    world: int = WORLD  # 1: the serial reference

    @property
    def label(self) -> str:
        if self.world == 1:
            return f"{self.model}-serial"
        layout = {v: k for k, v in LAYOUTS.items()}[(self.tp, self.pp)]
        return f"{self.model}-{layout}" + ("-ckpt" if self.ckpt else "")


def ds_config() -> dict:
    """CPM-1's ds_config_{gpt2,t5}.json in fp32 at this check's batch sizes."""
    return {"train_batch_size": MICRO * GAS, "train_micro_batch_size_per_gpu": MICRO,
            "steps_per_print": 10**9, "gradient_clipping": CLIP,
            "fp16": {"enabled": False, "loss_scale": 0, "loss_scale_window": 1000,
                     "hysteresis": 2, "initial_scale_power": 16},
            "zero_allow_untested_optimizer": True, "wall_clock_breakdown": False}


def raw_batches(model: str, steps: int, seed: int = 4321) -> list:
    """The raw micro-batches (what CPM-1's data loaders yield), in global order."""
    import torch

    g = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(0, VOCAB, (MICRO, n), generator=g)  # noqa: E731
    if model == "gpt2":
        return [{"text": draw(SEQ + 1)} for _ in range(steps * GAS)]
    return [{"contexts": draw(SEQ), "targets": draw(DEC_SEQ), "labels": draw(DEC_SEQ),
             "ctx_eod_mask": draw(SEQ)} for _ in range(steps * GAS)]


# ---------------------------------------------------------------- CPM-1 environment
def install_stand_ins() -> None:
    """Modules CPM-1's framework imports at module level that a CPU machine lacks."""
    import torch

    def module(name, **attrs):
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        return mod

    # apex: CUDA-only fused kernels. FusedLayerNorm -> torch.nn.LayerNorm (what CPM-1
    # falls back to itself); FusedAdam is imported by training.py, not used here;
    # multi_tensor_applier / amp_C are the fp16 utilities' CUDA kernels (fp32 here).
    fln = module("apex.normalization.fused_layer_norm", FusedLayerNorm=torch.nn.LayerNorm)
    norm = module("apex.normalization", fused_layer_norm=fln)
    mta = module("apex.multi_tensor_apply", multi_tensor_applier=None)
    opt = module("apex.optimizers", FusedAdam=torch.optim.Adam)
    apex = module("apex", normalization=norm, multi_tensor_apply=mta, optimizers=opt)
    stand_ins = {m.__name__: m for m in (apex, norm, fln, mta, opt, module("amp_C"))}
    # six / jieba: imported by CPM-1's tokenizers, which this check does not build (no
    # vocabulary file); stood in only where they are not installed.
    for mod in (module("six", PY2=False, PY3=True), module("jieba")):
        if importlib.util.find_spec(mod.__name__) is None:
            stand_ins[mod.__name__] = mod
    sys.modules.update(stand_ins)


def redirect_mpu(project: str) -> None:
    """docs/mpu.md, "A CPM-1 checkout": this project's package ``megatron`` loaded under a
    name of its own, its CPM namespace registered as ``megatron.mpu``, all before CPM-1's
    ``megatron`` is imported (mpu reaches the rest of the package relatively)."""
    package = os.path.join(project, "megatron")
    spec = importlib.util.spec_from_file_location(
        "megatron_tds", os.path.join(package, "__init__.py"),
        submodule_search_locations=[package])
    sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[spec.name])
    cpm = importlib.import_module("megatron_tds.mpu.cpm")
    stray = sorted(n for n in sys.modules if n.split(".")[0] == "megatron")
    if stray:  # CPM-1's package must be the only one named megatron
        raise RuntimeError(f"mpu's imports reached {', '.join(stray)} by the absolute name "
                           f"(CPM-1's package here); make that import relative")
    sys.modules["megatron.mpu"] = cpm


@contextlib.contextmanager
def cpu_devices(local_ranks: int):
    """CPM-1's device calls on a CPU machine. Inside, ``torch.cuda.device_count()`` is
    ``local_ranks``: ``_initialize_distributed`` builds the mpu groups only when it is > 0
    and, given ``--local_rank``, asserts ``local_rank == rank % device_count``; it is the
    real count again afterwards (DeepSpeed and tds see a CPU machine). From then on
    ``set_device`` and ``synchronize`` (CPM-1's Timers) do nothing and ``current_device()``
    (where its attention allocates) is the CPU."""
    import torch

    torch.cuda.set_device = lambda *_: None
    torch.cuda.synchronize = lambda *_: None
    torch.cuda.current_device = lambda: torch.device("cpu")
    real = torch.cuda.device_count
    torch.cuda.device_count = lambda: local_ranks
    try:
        yield
    finally:
        torch.cuda.device_count = real


class TokenizerStandIn:
    """CPM-1's tokenizer needs a vocabulary file; get_batch reads only these ids (the
    vocabulary size is set by hand: ``args.padded_vocab_size``)."""
    eod = eod_id = VOCAB - 1
    pad_id = 0


def _check_origin(module, root: str) -> None:
    if not os.path.realpath(module.__file__).startswith(os.path.realpath(root) + os.sep):
        raise RuntimeError(f"{module.__name__} was imported from {module.__file__}, not "
                           f"from {root}")


class Cpm1Checkout:
    """The checkout's code, reached as CPM-1's ``pretrain_*.py`` reaches it. A source for
    ``run_all`` has ``setup`` (in each rank: returns the CPM mpu), ``model``,
    ``forward_step``, ``ds_kwargs``, ``prefixes`` and ``layer_prefix`` (serial names);
    tests/test_cpm1_checkout_tool.py has another.

    Args:
        cpm_dir: a CPM-1-Pretrain checkout without ``tds/`` (see ``stage_checkout``).
        project: this project's root (its ``megatron/mpu`` and ``tds``).
    """
    prefixes = {"embedding": "language_model.embedding.",
                "final_norm": "language_model.transformer.final_layernorm."}

    def __init__(self, cpm_dir: str, project: str = PROJECT):
        self.cpm_dir, self.project = cpm_dir, project

    def _argv(self, case: Case, config_path: str) -> list:
        a = [f"pretrain_{case.model}.py", "--model-parallel-size", str(case.tp),
             "--pipe-parallel-size", str(case.pp), "--num-layers", "2", "--hidden-size", "32",
             "--num-attention-heads", "4", "--max-position-embeddings", "16",
             "--batch-size", str(MICRO), "--gas", str(GAS), "--distributed-backend", "gloo",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--init-method-std", "0.2",
             "--seed", str(SEED), "--clip-grad", str(CLIP), "--lr", str(LR),
             "--local_rank", os.environ["LOCAL_RANK"],  # as DeepSpeed's launcher passes it
             "--deepspeed", "--deepspeed_config", config_path]
        if case.model == "gpt2":  # run_gpt2.sh's --hidden-bias
            a += ["--seq-length", str(SEQ), "--hidden-bias"]
        else:
            a += ["--kv-hidden-size", "8", "--ff-hidden-size", "64", "--enc-seq-length",
                  str(SEQ), "--dec-seq-length", str(DEC_SEQ)]
        if case.ckpt:
            a += ["--checkpoint-activations", "--checkpoint-num-layers", "1"]
        return a

    def setup(self, case: Case, config_path: str):
        """Redirect, CPM-1's global variables (tokenizer left out), its initialize calls."""
        install_stand_ins()
        redirect_mpu(self.project)
        sys.path.insert(0, self.cpm_dir)
        import numpy as np
        if not hasattr(np, "float"):  # CPM-1's indexed_dataset (pretrain_*) predates 1.24
            np.float = float
        import megatron
        from megatron import mpu
        import tds
        _check_origin(megatron, self.cpm_dir)
        _check_origin(tds, self.project)
        if mpu is not sys.modules.get("megatron_tds.mpu.cpm"):
            raise RuntimeError(f"megatron.mpu is {mpu}, not this project's CPM namespace")
        import megatron.common.global_vars as gv
        import megatron.initialize as init

        sys.argv = self._argv(case, config_path)
        gv._parse_args()  # set_global_variables without _build_tokenizer:
        args = gv.get_args()
        args.padded_vocab_size = VOCAB  # _build_tokenizer's padding, by hand
        gv._GLOBAL_TOKENIZER = TokenizerStandIn()
        gv._set_tensorboard_writer(args)
        gv._set_adlr_autoresume(args)
        gv._set_timers()
        with cpu_devices(max(int(os.environ["LOCAL_WORLD_SIZE"]), args.local_rank + 1)):
            init._initialize_distributed()
            init._set_random_seed(args.seed)
        init._initialize_mem_buffs()
        self.args = args
        self.pretrain = importlib.import_module(f"pretrain_{case.model}")
        _check_origin(self.pretrain, self.cpm_dir)
        return mpu

    def model(self, case: Case):
        return self.pretrain.model_provider()

    def forward_step(self, model, raw):
        return self.pretrain.forward_step(iter([raw]), model)[0]

    def ds_kwargs(self, config_path: str) -> dict:
        return {"args": self.args}  # its --deepspeed_config is config_path

    def layer_prefix(self, case: Case, k: int) -> str:
        return f"language_model.transformer.layers.{k}."


# ---------------------------------------------------------------- one rank
def _serial_key(source, case, specs, name: str) -> str:
    """A pipeline parameter's name in the serial model: the tied embedding, the i-th
    untied LayerSpec (a transformer layer) and the last untied one (final LayerNorm)."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    head, rest = name.split(".", 1)
    if head == "tied_modules":
        return source.prefixes["embedding"] + rest.split(".", 1)[1]
    plain = [i for i, s in enumerate(specs)
             if isinstance(s, LayerSpec) and not isinstance(s, TiedLayerSpec)]
    k = plain.index(int(head))
    if k == len(plain) - 1:
        return source.prefixes["final_norm"] + rest
    return source.layer_prefix(case, k) + rest


def load_serial_weights(source, case, model, mpu, full: dict) -> list:
    """Copy the serial weights in: tensor-parallel ones sliced along ``partition_dim``
    (contiguous slices: CPM-1 splits its fused QKV per head, so a rank gets whole heads)."""
    import torch

    tp_rank, tp = mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()
    specs = getattr(model, "_layer_specs", None)
    keys = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = name if specs is None else _serial_key(source, case, specs, name)
            w = full[key]
            if getattr(p, "tensor_model_parallel", False) or getattr(p, "model_parallel", False):
                w = w.chunk(tp, dim=p.partition_dim)[tp_rank]
            if w.shape != p.shape:
                raise ValueError(f"{name} <- {key}: {tuple(w.shape)} vs {tuple(p.shape)}")
            p.copy_(w)
            keys.append(key)
    return keys


def _counted(fn, calls: dict):
    """``fn``, counting its calls in ``calls["recompute"]`` (recompute must happen when
    --checkpoint-activations is on, and only then)."""
    def counted(*args, **kwargs):
        calls["recompute"] += 1
        return fn(*args, **kwargs)
    return counted


def _train_serial(source, model, data, steps, init_path):
    """Plain PyTorch: mean loss of GAS micro-batches, torch's clip, SGD."""
    import torch

    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, init_path)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for raw in data[step * GAS:(step + 1) * GAS]:
            loss = source.forward_step(model, raw)
            (loss / GAS).backward()
            total += float(loss.detach()) / GAS
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        losses.append(total)
    return {"losses": losses, "norms": norms,
            "params": sorted(n for n, _ in model.named_parameters())}


def _train_parallel(source, case, model, mpu, data, steps, paths, calls):
    """CPM-1's setup_model_and_optimizer, then train_step (forward_step, model.backward,
    model.step) or train_step_pipe (train_batch)."""
    import torch
    import torch.distributed as dist
    from deepspeed.pipe import PipelineModule

    import tds as deepspeed

    init_path, config_path = paths
    keys = load_serial_weights(source, case, model, mpu, torch.load(init_path,
                                                                     weights_only=True))
    pipe = isinstance(model, PipelineModule)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=LR), lr_scheduler=None,
        mpu=None if pipe else mpu, dist_init_required=False, **source.ds_kwargs(config_path))
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    mine, losses = data[dp_rank::dp], []
    if pipe:
        for setter in ("batch_fn", "input_grad", "input_type", "input_pipe_partitioned"):
            attr = "_megatron_batch_fn" if setter == "batch_fn" else "_" + setter
            if hasattr(engine.module, attr):
                getattr(engine, "set_" + setter)(getattr(engine.module, attr))
        module = engine.module  # DeepSpeed's recompute, as tds wrapped it
        module.activation_checkpoint_func = _counted(module.activation_checkpoint_func, calls)
        it = iter(mine)
        losses = [float(engine.train_batch(data_iter=it)) for _ in range(steps)]
    for step in range(0 if pipe else steps):
        total, per = torch.zeros(()), GAS // dp
        for raw in mine[step * per:(step + 1) * per]:
            loss = source.forward_step(engine, raw)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / per
        dist.all_reduce(total, group=mpu.get_data_parallel_group())
        losses.append(float(total) / dp)
    return {"losses": losses, "loaded": sorted(set(keys)),
            "engine": f"{type(engine).__module__}.{type(engine).__name__}"}


def rank_main(source, case: Case, steps: int, root: str, rank: int, port: int, result_q):
    """One rank of one case; reports ``(rank, "ok", result)`` or ``(rank, "error", text)``."""
    log = open(os.path.join(root, case.label, f"rank{rank}.log"), "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(case.world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(case.world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        import torch
        torch.set_num_threads(1)
        paths = (os.path.join(root, f"{case.model}_serial_init.pt"),
                 os.path.join(root, "ds_config.json"))
        mpu = source.setup(case, paths[1])
        calls = {"recompute": 0}
        mpu.checkpoint = _counted(mpu.checkpoint, calls)  # the serial models' recompute
        model = source.model(case)
        data = raw_batches(case.model, steps, getattr(source, "data_seed", 4321))
        if case.world == 1:
            result = _train_serial(source, model, data, steps, paths[0])
        else:
            result = _train_parallel(source, case, model, mpu, data, steps, paths, calls)
        result["recompute"] = calls["recompute"]
        result_q.put((rank, "ok", result))
    except BaseException:
        result_q.put((rank, "error", traceback.format_exc()))


# ---------------------------------------------------------------- the launcher
def run_case(source, case: Case, steps: int, root: str, timeout: float = 600) -> list:
    """Run one case on ``case.world`` fresh processes; the per-rank results, or a
    RuntimeError with the first failing rank's traceback and the tail of its log."""
    os.makedirs(os.path.join(root, case.label), exist_ok=True)
    ctx = multiprocessing.get_context("forkserver")  # main() sets what it preloads
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result_q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(source, case, steps, root, r, port, result_q),
                         daemon=True) for r in range(case.world)]
    for p in procs:
        p.start()
    results, errors, deadline = {}, {}, time.monotonic() + timeout
    while len(results) + len(errors) < case.world and time.monotonic() < deadline:
        with contextlib.suppress(queue.Empty):
            rank, status, payload = result_q.get(timeout=0.5)
            (results if status == "ok" else errors)[rank] = payload
        if errors or any(p.exitcode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + 5)  # the others' reports
    for p in procs:
        p.join(timeout=5 if len(results) == case.world else 0.1)
        if p.is_alive():
            p.kill()
            p.join()
    if len(results) == case.world:
        return [results[r] for r in range(case.world)]
    rank = min(errors) if errors else min(set(range(case.world)) - set(results))
    text = errors.get(rank, f"rank {rank} did not report within {timeout:.0f}s")
    log, tail = os.path.join(root, case.label, f"rank{rank}.log"), ""
    with contextlib.suppress(OSError), open(log, errors="replace") as f:
        tail = "".join(f.readlines()[-15:])
    raise RuntimeError(f"{case.label}: rank {rank} failed\n{text}\n--- log tail ({log}) ---\n"
                       f"{tail}")


def compare(case: Case, serial: dict, results: list) -> dict:
    """One table row: the largest per-step loss difference over ranks and steps, and the
    problems that fail the case besides it."""
    diffs = [abs(a - b) for r in results for a, b in zip(r["losses"], serial["losses"])]
    problems = [f"rank {i} reported {len(r['losses'])} steps"
                for i, r in enumerate(results) if len(r["losses"]) != len(serial["losses"])]
    missing = sorted(set(serial["params"]) - set().union(*(r["loaded"] for r in results)))
    if missing:
        problems.append(f"serial weights no rank loaded: {missing}")
    recompute = sum(r["recompute"] for r in results)
    if case.ckpt != (recompute > 0):
        problems.append(f"{recompute} recompute calls with --checkpoint-activations "
                        f"{'on' if case.ckpt else 'off'}")
    diff = max(diffs) if diffs else float("nan")
    return {"case": case.label, "engine": results[0]["engine"].rsplit(".", 1)[-1],
            "diff": diff, "recompute": recompute, "ok": not problems and diff <= TOLERANCE,
            "problems": problems, "losses": results[0]["losses"]}


def run_all(source, cases: list, steps: int, root: str, timeout: float = 600, log=print):
    """The serial reference once per model, then every case: rows for ``format_table``."""
    with open(os.path.join(root, "ds_config.json"), "w") as f:
        json.dump(ds_config(), f)
    rows, serials = [], {}
    for model in dict.fromkeys(c.model for c in cases):
        try:
            serials[model] = run_case(source, Case(model, 1, 0, False, 1), steps, root,
                                      timeout)[0]
        except RuntimeError as exc:
            rows.append({"case": f"{model}-serial", "ok": False, "problems": [str(exc)]})
            continue
        norms = serials[model]["norms"]
        log(f"{model} serial: losses {['%.7f' % x for x in serials[model]['losses']]}, "
            f"gradient norms {['%.2f' % n for n in norms]}")
        rows.append({"case": f"{model}-serial", "serial": serials[model],
                     "ok": min(norms) > CLIP, "problems": [] if min(norms) > CLIP else
                     [f"gradient norm {min(norms):.3f} <= {CLIP}: clipping would not act"]})
    for case in cases:
        if case.model not in serials:
            rows.append({"case": case.label, "ok": False, "problems": ["not run: no serial"]})
            continue
        try:
            row = compare(case, serials[case.model], run_case(source, case, steps, root,
                                                              timeout))
        except RuntimeError as exc:
            row = {"case": case.label, "ok": False, "problems": [str(exc)]}
        log(format_row(row))
        rows.append(row)
    return rows


def _first_error(problems: list) -> str:
    """A failure's exception line (the table cell; the full text is printed below it)."""
    lines = problems[0].split("--- log tail")[0].strip().splitlines()
    errors = [ln for ln in lines if re.match(r"[\w.]+(Error|Exception|Exit)\b", ln)]
    return (errors[-1] if errors else lines[0])[:160]


def format_row(row: dict) -> str:
    if "serial" in row:
        norms = row["serial"]["norms"]
        verdict = "ok" if row["ok"] else "FAIL: " + row["problems"][0]
        return (f"| {row['case']} | plain PyTorch | - | reference (gradient norm "
                f"{min(norms):.2f} to {max(norms):.2f}, clipped to {CLIP}) | {verdict} |")
    if "diff" not in row:
        return f"| {row['case']} | - | - | - | FAIL: {_first_error(row['problems'])} |"
    verdict = "ok" if row["ok"] else "FAIL: " + "; ".join(row["problems"] or ["> 1e-5"])
    return (f"| {row['case']} | {row['engine']} | {row['recompute']} | {row['diff']:.2g} | "
            f"{verdict} |")


def format_table(rows: list) -> str:
    return "\n".join(["| case | engine | recompute calls | max abs loss diff | result |",
                      "| --- | --- | --- | --- | --- |"] + [format_row(r) for r in rows])


# ---------------------------------------------------------------- command line
def stage_checkout(cpm_dir: str, dest: str) -> str:
    """Copy the checkout without ``tds/`` (this project's stands in) and ``.git``."""
    if not all(os.path.isfile(os.path.join(cpm_dir, *f)) for f in
               (("megatron", "initialize.py"), ("pretrain_gpt2.py",), ("pretrain_t5.py",))):
        raise FileNotFoundError(f"{cpm_dir} does not look like a CPM-1-Pretrain checkout "
                                f"(megatron/initialize.py, pretrain_gpt2.py, pretrain_t5.py)")
    ignore = lambda d, names: [n for n in names  # noqa: E731
                               if os.path.samefile(d, cpm_dir) and n in ("tds", ".git")]
    shutil.copytree(cpm_dir, dest, ignore=ignore)
    return dest


def machine() -> str:
    import deepspeed
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration), open("/proc/cpuinfo") as f:
        cpu = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    return (f"{platform.node()}: {cpu}, {os.cpu_count()} cores visible, "
            f"{platform.system()} {platform.release()}; Python {platform.python_version()}, "
            f"torch {torch.__version__}, deepspeed {deepspeed.__version__}; CPU, gloo")


def revision(path: str) -> str:
    git = lambda *a: subprocess.run(["git", "-C", path, *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=30).stdout.strip()
    head = git("rev-parse", "--short", "HEAD")
    dirty = head and git("status", "--porcelain", "--untracked-files=no")
    return (head or "no git revision") + (" (uncommitted changes)" if dirty else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpm1", required=True, help="a CPM-1-Pretrain checkout (left unchanged)")
    p.add_argument("--project", default=PROJECT, help="megatron-tds root (default: this one)")
    p.add_argument("--models", nargs="+", choices=["gpt2", "t5"], default=["gpt2", "t5"])
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    p.add_argument("--ckpt", choices=["both", "off", "on"], default="both",
                   help="--checkpoint-activations: both, off or on")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--timeout", type=float, default=600, help="seconds per case")
    p.add_argument("--keep", action="store_true", help="keep the work folder (rank logs)")
    a = p.parse_args(argv)
    project, cpm_dir = os.path.abspath(a.project), os.path.abspath(a.cpm1)
    sys.path.insert(0, project)  # the ranks' tds (and mpu, through the redirect)
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    ckpts = {"both": (False, True), "off": (False,), "on": (True,)}[a.ckpt]
    cases = [Case(m, *LAYOUTS[lay], ck) for m in a.models for ck in ckpts for lay in a.layouts]
    root = tempfile.mkdtemp(prefix="cpm1_check_")
    try:
        try:
            source = Cpm1Checkout(stage_checkout(cpm_dir, os.path.join(root, "cpm1")), project)
        except OSError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print("command:", shlex.join([os.path.basename(sys.executable)] + sys.argv))
        print("machine:", machine())
        print(f"project: {project} at {revision(project)}; CPM-1: {cpm_dir} at "
              f"{revision(cpm_dir)}")
        print(f"cases: {WORLD} processes each, {a.steps} steps of {GAS} micro-batches of "
              f"{MICRO}, fp32, clip {CLIP}, tolerance {TOLERANCE:g}\n", flush=True)
        start = time.monotonic()
        rows = run_all(source, cases, a.steps, root, a.timeout,
                       log=lambda s: print(s, flush=True))
        print(f"\n{format_table(rows)}\n\n{len(rows)} rows in {time.monotonic() - start:.0f} s")
        for row in (r for r in rows if not r["ok"] and "diff" not in r and "serial" not in r):
            print(f"\n--- {row['case']} ---\n{row['problems'][0]}")
        failed = [r["case"] for r in rows if not r["ok"]]
        print("FAILED: " + ", ".join(failed) if failed else "all cases within 1e-5")
        return 1 if failed else 0
    finally:
        if a.keep:
            print(f"work folder kept: {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
