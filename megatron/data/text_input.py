"""Read raw documents from JSONL, a JSON array (GPT2-Chinese's ``train.json``) or plain text.

Formats (``detect_format`` looks at the first non-blank character):

* JSONL: one JSON object per line, e.g. ``{"text": "..."}``; blank lines are ignored.
* JSON array: ``["doc 1", "doc 2", ...]`` (each string is a document for every key) or
  ``[{"text": ...}, ...]``.
* Plain text: documents separated by one or more blank lines.

Work units are ``(lineno, kind, payload)``: for JSONL the raw line (parsed by the worker, so
parsing runs in parallel), otherwise the already parsed item. :func:`parse_unit` turns a unit
into ``{key: text}`` or raises ``ValueError`` with a message the caller prefixes with
``file:line``.
"""
import json
import os

from megatron.common.errors import DataError

FORMATS = ("jsonl", "json", "text")
_DECODER = json.JSONDecoder()


def check_input(path):
    """Raise DataError unless ``path`` is a readable, non-empty file."""
    if not os.path.exists(path):
        raise DataError(f"input file {path} not found; check --input")
    if os.path.isdir(path):
        raise DataError(f"input {path} is a directory; pass the file(s) with --input")
    if os.path.getsize(path) == 0:
        raise DataError(f"input file {path} is empty; nothing to process")


def detect_format(path):
    """'json' when the file starts with '[', 'jsonl' with '{', else 'text'."""
    with open(path, encoding="utf-8", errors="replace") as f:
        while True:
            chunk = f.read(4096)
            if not chunk:
                raise DataError(f"input file {path} holds only whitespace; nothing to process")
            stripped = chunk.lstrip()
            if stripped:
                return {"[": "json", "{": "jsonl"}.get(stripped[0].lstrip("\ufeff")[:1], "text")


def _iter_jsonl(f):
    for lineno, line in enumerate(f, 1):
        if line.strip():
            yield lineno, "jsonl", line


def _iter_text(f):
    lines, start = [], None
    for lineno, line in enumerate(f, 1):
        if line.strip():
            if start is None:
                start = lineno
            lines.append(line)
        elif lines:
            yield start, "item", "".join(lines).rstrip("\n")
            lines, start = [], None
    if lines:
        yield start, "item", "".join(lines).rstrip("\n")


def _skip_ws(text, pos):
    n = len(text)
    while pos < n and text[pos] in " \t\r\n\ufeff":
        pos += 1
    return pos


def _iter_json_array(f, path):
    """Items of a top-level JSON array with their line numbers, parsed one at a time."""
    text = f.read()
    pos, line = _skip_ws(text, 0), 1
    if not text.startswith("[", pos):
        raise DataError(f"{path}: a JSON input must be an array of documents "
                        f'(["doc 1", "doc 2"] or [{{"text": ...}}])')
    line += text.count("\n", 0, pos)

    def advance(new_pos):  # keep ``line`` in step with ``pos``
        nonlocal pos, line
        line += text.count("\n", pos, new_pos)
        pos = new_pos

    advance(_skip_ws(text, pos + 1))
    if text.startswith("]", pos):
        return
    while True:
        try:
            item, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            raise DataError(f"{path}:{exc.lineno}: malformed JSON array item ({exc.msg}); "
                            f"fix the item or skip it with a JSONL file and --skip-bad-lines"
                            ) from None
        yield line, "item", item
        advance(_skip_ws(text, end))
        if text.startswith(",", pos):
            advance(_skip_ws(text, pos + 1))
        elif text.startswith("]", pos):
            if _skip_ws(text, pos + 1) != len(text):
                raise DataError(f"{path}:{line}: text after the closing ']' of the JSON array")
            return
        else:
            raise DataError(f"{path}:{line}: expected ',' or ']' after an array item; the JSON "
                            f"array is malformed")


def iter_units(path, fmt=None):
    """Yield ``(lineno, kind, payload)`` work units of ``path`` (see the module docstring).

    Args:
        path: input file.
        fmt: one of FORMATS, or None to detect it from the content.
    """
    check_input(path)
    fmt = fmt or detect_format(path)
    if fmt not in FORMATS:
        raise DataError(f"unknown input format {fmt!r}; use one of {', '.join(FORMATS)}")
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            if fmt == "jsonl":
                yield from _iter_jsonl(f)
            elif fmt == "json":
                yield from _iter_json_array(f, path)
            else:
                yield from _iter_text(f)
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                            f"convert it to UTF-8") from None


def parse_unit(kind, payload, keys):
    """``{key: text}`` for one work unit, or ValueError saying what is wrong with it.

    Args:
        kind: "jsonl" (payload is a raw line) or "item" (payload is a parsed value).
        payload: the line or value.
        keys: the JSON keys to extract (``--json-keys``).
    """
    if kind == "jsonl":
        try:
            payload = json.loads(payload)
        except json.JSONDecodeError as exc:
            raise ValueError(f"malformed JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(payload, dict):
            raise ValueError(f"expected a JSON object like {{\"{keys[0]}\": ...}}, "
                             f"got {type(payload).__name__}")
    if isinstance(payload, str):  # JSON-array strings and plain-text paragraphs
        return {key: payload for key in keys}
    if not isinstance(payload, dict):
        raise ValueError(f"expected a string or an object with {keys}, got "
                         f"{type(payload).__name__}")
    out = {}
    for key in keys:
        value = payload.get(key)
        if not isinstance(value, str):
            found = ", ".join(map(repr, list(payload)[:5])) or "none"
            what = "missing" if value is None else f"of type {type(value).__name__}, not a string"
            raise ValueError(f"key {key!r} is {what} (keys found: {found}); check --json-keys")
        out[key] = value
    return out


def iter_documents(paths, keys, fmt=None, skip_bad=False, on_skip=None):
    """Yield ``{key: text}`` per document of ``paths``, in order (single process).

    Args:
        paths: input files.
        keys: keys to extract.
        fmt: forced format or None (detect per file).
        skip_bad: skip malformed units (``on_skip(path, lineno, msg)`` is told) instead of
            raising DataError.
    """
    for path in paths:
        for lineno, kind, payload in iter_units(path, fmt):
            try:
                yield parse_unit(kind, payload, keys)
            except ValueError as exc:
                if not skip_bad:
                    raise DataError(f"{path}:{lineno}: {exc} (or pass --skip-bad-lines)") from None
                if on_skip:
                    on_skip(path, lineno, str(exc))
