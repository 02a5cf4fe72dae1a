#!/usr/bin/env python
"""Make the demo corpus: docstrings of the installed Python standard library and packages.

    python tools/make_sample_corpus.py --output data/sample.jsonl --max-mb 4

Real English prose that nobody here wrote, built at run time, nothing downloaded. Files are
parsed with ``ast`` (nothing is imported or executed) in a fixed order: the standard library
first, then site-packages, folders and files sorted. Docstrings shorter than ``--min-words``
words, and repeats, are skipped. Each line is ``{"text": docstring, "source": "path:line"}``.
The content depends on the installed Python and packages; the order and filtering do not.
"""
import argparse
import ast
import hashlib
import json
import multiprocessing
import os
import sys
import sysconfig
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.common.errors import ConfigError, entry_point  # noqa: E402

SKIP_DIRS = {"__pycache__", "test", "tests", "testing", "site-packages", "dist-packages",
             "idle_test", "lib2to3", "node_modules"}
MAX_FILE_BYTES = 2_000_000  # bigger .py files are generated tables, not prose
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def source_roots():
    """The standard library folder, then the site-packages folders (no duplicates)."""
    paths = sysconfig.get_paths()
    roots = []
    for key in ("stdlib", "purelib", "platlib"):
        path = os.path.realpath(paths[key])
        if os.path.isdir(path) and path not in roots:
            roots.append(path)
    return roots


def iter_python_files(root):
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def docstrings(path):
    """(line, docstring) for the module, classes and functions of one file; [] if unparsable."""
    try:
        if os.path.getsize(path) > MAX_FILE_BYTES:
            return []
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), filename=path)
    except (SyntaxError, ValueError, RecursionError, OSError, MemoryError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, _DOC_NODES):
            doc = ast.get_docstring(node, clean=True)
            if doc:
                out.append((getattr(node, "lineno", 1), doc))
    return out


def _all_files():
    for root in source_roots():
        for path in iter_python_files(root):
            yield root, path


def _parse(item):
    root, path = item
    return root, path, docstrings(path)


def _records(found, root, path, min_words, seen):
    """JSONL lines for one file's docstrings: long enough and not seen before."""
    for line, doc in found:
        if len(doc.split()) < min_words:
            continue
        digest = hashlib.sha1(doc.encode("utf-8", "replace")).digest()
        if digest in seen:
            continue
        seen.add(digest)
        source = f"{os.path.relpath(path, root)}:{line}"
        yield json.dumps({"text": doc, "source": source}, ensure_ascii=False) + "\n"


def write_corpus(output, max_mb, min_words, workers=2):
    """Write the corpus; returns (documents, bytes). Parsing runs in ``workers`` processes,
    results are taken in file order, so the output does not depend on ``workers``."""
    limit = int(max_mb * 1e6)
    seen, docs, size = set(), 0, 0
    tmp = f"{output}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as out, \
            multiprocessing.get_context("fork").Pool(workers) as pool:
        for root, path, found in pool.imap(_parse, _all_files(), chunksize=4):
            for record in _records(found, root, path, min_words, seen):
                out.write(record)
                docs += 1
                size += len(record.encode("utf-8"))
                if size >= limit:
                    break
            if size >= limit:
                break
    os.replace(tmp, output)
    return docs, size


@entry_point
def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", required=True, help="JSONL file to write")
    parser.add_argument("--max-mb", type=float, default=4.0, help="stop after this many MB")
    parser.add_argument("--min-words", type=int, default=20, help="skip shorter docstrings")
    args = parser.parse_args(argv)
    if args.max_mb <= 0:
        raise ConfigError("--max-mb must be positive")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    start = time.time()
    docs, size = write_corpus(args.output, args.max_mb, args.min_words)
    print(f"wrote {docs} documents, {size / 1e6:.2f} MB to {args.output} in "
          f"{time.time() - start:.1f}s", file=sys.stderr)


if __name__ == "__main__":
    main()
