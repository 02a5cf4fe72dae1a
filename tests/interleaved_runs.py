"""Helpers for the interleaved (virtual pipeline) equivalence tests: several runs per
launch, and serial references computed once per session."""
import importlib

from gpt2_runs import gpt2_argv
from t5_runs import t5_argv

STEPS = 3  # Adam's first update is sign-like: wrong gradients show from step 3 on
ENTRY = {"gpt2": "pretrain_gpt2", "t5": "pretrain_t5"}
STACKS = {"gpt2": 1, "t5": 2}


def num_layers(family, pp, v):
    """The smallest --num-layers splitting into p v equal chunks: one layer per chunk
    (T5: p v / 2 per stack), or for T5 with p v odd two per chunk, one chunk then holding
    the last encoder and the first decoder layer."""
    stacks = STACKS[family]
    return pp * v // stacks if pp * v % stacks == 0 else pp * v


def family_argv(family, data, layers, *extra):
    """A dropout-free tiny run of ``family`` (hidden 32, sequences 16) for STEPS steps."""
    common = ("--num-layers", str(layers), "--train-iters", str(STEPS),
              "--hidden-dropout", "0", "--attention-dropout", "0", "--batch-size", "1")
    if family == "gpt2":
        return gpt2_argv(data, *common, "--seq-length", "16", "--max-position-embeddings",
                         "16", *extra)
    return t5_argv(data, *common, "--enc-seq-length", "16", "--dec-seq-length", "8", *extra)


def layout_flags(tp, pp, v, m, *extra):
    """Flags of a layout: m micro-batches per step on each data-parallel rank."""
    flags = ["--model-parallel-size", str(tp), "--pipe-parallel-size", str(pp), "--gas", str(m)]
    if v > 1:
        flags += ["--virtual-pipeline-model-parallel-size", str(v)]
    return [*flags, *extra]


def train_many(family, runs):
    """Rank body: ``pretrain_<family>.main(argv)`` for each argv in turn, in one process.

    Returns:
        per run, ``(per-step losses, [(iteration, validation loss)])``.
    """
    main = importlib.import_module(ENTRY[family]).main
    return [(state.losses, state.eval_losses) for state in map(main, runs)]


class SerialReferences:
    """Serial (tp = pp = dp = 1) losses and final weights per (layers, global batch),
    computed on demand (all missing ones in one launch) and kept for the session."""

    def __init__(self, data, tmp_path_factory):
        self.data, self.tmp, self.cache = data, tmp_path_factory, {}

    def get(self, family, keys):
        """``{(layers, batch): (losses, full weights)}`` of ``family``'s serial runs."""
        from harness import run_distributed
        from megatron.checkpoint import read_native

        missing = sorted({k for k in keys if (family, *k) not in self.cache})
        if missing:
            root = self.tmp.mktemp(f"serial_{family}")
            runs = [family_argv(family, self.data[family], layers, "--gas", str(batch),
                                "--save", str(root / f"l{layers}_b{batch}"), "--no-save-optim")
                    for layers, batch in missing]
            losses = run_distributed(train_many, 1, family, runs, timeout=400)[0]
            for (layers, batch), (curve, _) in zip(missing, losses):
                weights = read_native(str(root / f"l{layers}_b{batch}")).state
                self.cache[(family, layers, batch)] = (curve, weights)
        return {k: self.cache[(family, *k)] for k in keys}
