"""Shared pytest fixtures (fresh random seeds, printed so a failure can be replayed; the
sample data sets) and the parallel run's hooks (tests/parallel_suite.py)."""
import os
import random

import pytest

import parallel_suite


# ---------------------------------------------------------------- parallel runs (pytest-xdist)
@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own, which reads these options
def pytest_cmdline_main(config):
    parallel_suite.default_to_parallel(config)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hooks: absent under -p no:xdist
def pytest_xdist_auto_num_workers(config):
    return parallel_suite.auto_workers(config)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    parallel_suite.tell_worker(node)


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # before pytest-xdist's default scheduler
def pytest_xdist_make_scheduler(config, log):
    return parallel_suite.make_scheduler(config, log)


def pytest_configure(config):
    parallel_suite.start_run(config)
    # serial runs and every worker of every run on this host: alone means alone on the host
    config.stash[_NEIGHBOURS] = parallel_suite.Neighbours(parallel_suite.machine_folder())


def pytest_unconfigure(config):
    parallel_suite.end_run(config)


#: Marks a run includes only when its ``-m`` expression names them: a ``-m`` on the command
#: line replaces pytest.ini's ``-m "not stress and not exhaustive"``, so without this a
#: quick ``-m "not slow"`` would run every exhaustive matrix.
OPT_IN_MARKS = ("exhaustive", "stress")


def _leave_out_unnamed_opt_in_marks(config, items):
    expression = config.option.markexpr or ""
    unnamed = [mark for mark in OPT_IN_MARKS if mark not in expression]
    dropped = {item for item in items
               if any(item.get_closest_marker(mark) for mark in unnamed)}
    if dropped:
        config.hook.pytest_deselected(items=[item for item in items if item in dropped])
        items[:] = [item for item in items if item not in dropped]


def pytest_collection_modifyitems(config, items):
    _leave_out_unnamed_opt_in_marks(config, items)
    parallel_suite.write_groups(config, items)


_NEIGHBOURS = pytest.StashKey()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup, call and teardown of a test: alone, or beside others (see parallel_suite)."""
    neighbours = item.config.stash[_NEIGHBOURS]
    if neighbours is None:
        return (yield)
    with neighbours.hold(alone=item.get_closest_marker("alone") is not None):
        return (yield)


# ---------------------------------------------------------------- fixtures
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
def gpt2_data(request, tmp_path_factory):
    """A small real corpus, a GPT-2 BPE vocab trained on it, and its indexed dataset.

    Returns a dict with ``prefix``, ``vocab``, ``merges``, ``corpus`` paths (built once per
    test run with the project's own tools, shared by the xdist workers).
    """
    return parallel_suite.once_per_run(request.config, "gpt2_data",
                                       lambda: _gpt2_data(tmp_path_factory))


def _gpt2_data(tmp_path_factory):
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
def gpt2_one_node_losses(request, gpt2_data, tmp_path_factory):
    """Losses of examples/run_gpt2.sh on one node with 4 processes (tests/launch_runs.py's
    tiny run): the reference the two-node, DeepSpeed-launcher and Slurm launches must match,
    run once per test run (shared by the xdist workers)."""
    from launch_runs import finish, launch, launch_env, log_losses

    def run():
        env = launch_env(gpt2_data, tmp_path_factory.mktemp("one_node"))
        return log_losses(finish([launch(env)]))

    return parallel_suite.once_per_run(request.config, "gpt2_one_node_losses", run)


@pytest.fixture(scope="session")
def t5_data(request, tmp_path_factory):
    """The sample corpus, a sentencepiece model trained on it (T5 layout: pad=0, eos=1,
    sentinels appended at load time) and its indexed dataset, for pretrain_t5.py.

    Returns a dict with ``prefix``, ``spm`` (the .model), ``corpus`` and ``root`` (built once
    per test run, shared by the xdist workers).
    """
    return parallel_suite.once_per_run(request.config, "t5_data",
                                       lambda: _t5_data(tmp_path_factory))


def _t5_data(tmp_path_factory):
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
