"""Shared pytest fixtures: fresh random seeds, printed so a failure can be replayed."""
import os
import random

import pytest


@pytest.fixture
def seed(request):
    """A fresh seed per test (``MEGATRON_TEST_SEED`` pins it), shown in the test report."""
    value = int(os.environ.get("MEGATRON_TEST_SEED") or random.SystemRandom().randrange(2**31))
    request.node.user_properties.append(("seed", value))
    print(f"seed={value} (rerun with MEGATRON_TEST_SEED={value})")
    return value


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_tool(*argv):
    import subprocess
    import sys

    subprocess.run([sys.executable, *argv], check=True, cwd=REPO, capture_output=True)


@pytest.fixture(scope="session")
def gpt2_data(tmp_path_factory):
    """A small real corpus, a GPT-2 BPE vocab trained on it, and its indexed dataset.

    Returns a dict with ``prefix``, ``vocab``, ``merges``, ``corpus`` paths (built once per
    test session with the project's own tools).
    """
    root = tmp_path_factory.mktemp("gpt2_data")
    corpus, tok = root / "corpus.jsonl", root / "tok"
    _run_tool("tools/make_sample_corpus.py", "--output", str(corpus), "--max-mb", "0.4")
    _run_tool("tools/train_tokenizer.py", "--type", "gpt2", "--input", str(corpus),
              "--vocab-size", "500", "--output-dir", str(tok))
    prefix = root / "corpus"
    _run_tool("tools/preprocess_data.py", "--input", str(corpus), "--tokenizer-type",
              "GPT2BPETokenizer", "--vocab-file", str(tok / "vocab.json"), "--merge-file",
              str(tok / "merges.txt"), "--append-eod", "--output-prefix", str(prefix),
              "--workers", "1")
    return {"prefix": f"{prefix}_text_document", "vocab": str(tok / "vocab.json"),
            "merges": str(tok / "merges.txt"), "corpus": str(corpus), "root": str(root)}


@pytest.fixture(scope="session")
def gpt2_one_node_losses(gpt2_data, tmp_path_factory):
    """Losses of examples/run_gpt2.sh on one node with 4 processes (tests/launch_runs.py's
    tiny run): the reference the two-node, DeepSpeed-launcher and Slurm launches must match,
    run once per session."""
    from launch_runs import finish, launch, launch_env, log_losses

    return log_losses(finish([launch(launch_env(gpt2_data,
                                                tmp_path_factory.mktemp("one_node")))]))


@pytest.fixture(scope="session")
def t5_data(tmp_path_factory):
    """The sample corpus, a sentencepiece model trained on it (T5 layout: pad=0, eos=1,
    sentinels appended at load time) and its indexed dataset, for pretrain_t5.py.

    Returns a dict with ``prefix``, ``spm`` (the .model), ``corpus`` and ``root``.
    """
    root = tmp_path_factory.mktemp("t5_data")
    corpus, tok = root / "corpus.jsonl", root / "tok"
    _run_tool("tools/make_sample_corpus.py", "--output", str(corpus), "--max-mb", "0.4")
    _run_tool("tools/train_tokenizer.py", "--type", "sentencepiece", "--input", str(corpus),
              "--vocab-size", "400", "--output-dir", str(tok))
    prefix = root / "corpus"
    _run_tool("tools/preprocess_data.py", "--input", str(corpus), "--tokenizer-type",
              "SentencePieceTokenizer", "--tokenizer-model", str(tok / "spm.model"),
              "--append-eod", "--output-prefix", str(prefix), "--workers", "1")
    return {"prefix": f"{prefix}_text_document", "spm": str(tok / "spm.model"),
            "corpus": str(corpus), "root": str(root)}
