"""Progress of the long tools: a tqdm bar on a terminal (a pseudo-terminal here), complete
periodic lines through a pipe (CI logs), counting the real work."""
import fcntl
import io
import os
import pty
import re
import struct
import subprocess
import sys
import termios

import pytest

from gpt2_runs import REPO
from megatron.observability.progress import PlainProgress, progress


def _run_in_pty(cmd, env):
    """Run ``cmd`` with stdout/stderr on a pseudo-terminal; return (exit code, output)."""
    master, slave = pty.openpty()
    # a real terminal has a size; tqdm sizes its bar from it
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=120), b"".join(chunks).decode("utf-8", "replace")


def _preprocess(data, tmp_path, name):
    return [sys.executable, "tools/preprocess_data.py", "--input", data["corpus"],
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", data["vocab"],
            "--merge-file", data["merges"], "--output-prefix", str(tmp_path / name),
            "--log-interval", "50"]


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEGATRON_PROGRESS")}
    return dict(env, PYTHONPATH=REPO)


def _num_docs(data):
    with open(data["corpus"]) as handle:
        return sum(1 for line in handle if line.strip())


def test_plain_lines_through_a_pipe(gpt2_data, tmp_path):
    result = subprocess.run(_preprocess(gpt2_data, tmp_path, "pipe"), cwd=REPO, env=_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "\r" not in result.stderr and "\x1b" not in result.stderr
    counts = [int(n) for n in re.findall(r"^tokenizing: (\d+) docs \|", result.stderr, re.M)]
    docs = _num_docs(gpt2_data)
    # one line per --log-interval documents, then the final count
    assert counts == list(range(50, docs + 1, 50)) + [docs], counts
    assert re.search(rf"^tokenizing: {docs} docs \| .* \| done$", result.stderr, re.M)


def test_bar_on_a_terminal(gpt2_data, tmp_path):
    code, out = _run_in_pty(_preprocess(gpt2_data, tmp_path, "tty"), _env())
    assert code == 0, out
    docs = _num_docs(gpt2_data)
    assert "\r" in out  # redrawn in place
    assert re.search(rf"tokenizing: {docs}docs \[[0-9:]+, +[0-9.]+docs/s", out), out[-2000:]
    assert "| done" not in out  # no plain lines on a terminal


def test_tokenizer_training_shows_merges_bar(gpt2_data, tmp_path):
    cmd = [sys.executable, "tools/train_tokenizer.py", "--type", "gpt2", "--input",
           gpt2_data["corpus"], "--vocab-size", "300", "--output-dir", str(tmp_path / "tok")]
    code, out = _run_in_pty(cmd, _env())
    assert code == 0, out
    assert re.search(r"learning merges: 100%\|[^\r\n]*\| 43/43 ", out), out[-2000:]
    with open(tmp_path / "tok" / "merges.txt") as handle:
        assert len(handle.read().splitlines()) == 1 + 43  # header + merges counted by the bar


@pytest.mark.parametrize("every,interval_s,expected", [(3, 1e9, [3, 6, 9, 10]),
                                                       (None, 0.0, list(range(1, 11)) + [10]),
                                                       (None, 1e9, [])])
def test_plain_progress_prints_when_due(every, interval_s, expected):
    out = io.StringIO()
    for _ in PlainProgress(range(10), 10, "work", "items", out, every, interval_s):
        pass
    lines = out.getvalue().splitlines()
    if not expected:  # shorter than the interval: silent, no lone "done" line
        assert lines == []
        return
    assert [int(re.match(r"work: (\d+)/10 items", line).group(1)) for line in lines] == expected
    assert lines[-1].endswith("| done") and "(100%)" in lines[-1]
    assert sum(line.endswith("done") for line in lines) == 1


def test_environment_forces_a_mode(monkeypatch):
    monkeypatch.setenv("MEGATRON_PROGRESS", "bar")
    assert not isinstance(progress(total=1, stream=io.StringIO()), PlainProgress)
    monkeypatch.setenv("MEGATRON_PROGRESS", "plain")
    assert isinstance(progress(total=1), PlainProgress)
