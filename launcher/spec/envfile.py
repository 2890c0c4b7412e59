"""``--env-file FILE`` and ``--env 'GLOB'``: more of the job's variables than a command line holds.

An env file is dotenv text, the form Docker's ``--env-file``, Compose and python-dotenv read::

    # a comment, and blank lines, are skipped
    WANDB_PROJECT=mnist            # an unquoted value ends before " #"; spaces around it go
    export HF_HOME=/data/hf        # "export " in front is allowed, so the file can be sourced
    GREETING='no $expansion, no \\escapes'
    MOTD="double quotes: \\n \\t \\" \\\\ \\$ are escapes"
    CERT="-----BEGIN X-----
    a quoted value may span lines
    -----END X-----"
    HF_TOKEN                       # a bare name: this shell's value (as --env NAME)

Values are literal: no ``$VAR`` expansion, no command substitution (a file is data, not a
script). A line that is none of these is a :class:`~launcher.errors.ConfigError` naming
``FILE:LINE`` and the fix; the value of a secret-looking name is never repeated in it.

A glob (``--env 'WANDB_*'``, :func:`is_glob`) selects the launcher's variables whose names
match (:func:`fnmatch.fnmatchcase`); :func:`expand_glob` returns them in name order.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from typing import Mapping

from ..errors import ConfigError
from . import env as jobenv

#: The largest env file read (the environment of one process is at most a few MiB on Linux).
MAX_BYTES = 8 * 1024 * 1024
_GLOB_CHARS = frozenset("*?[")
_DQ_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", '"': '"', "\\": "\\", "$": "$", "`": "`"}


def is_glob(item: str) -> bool:
    """True for a ``--env`` item that is a name pattern (``WANDB_*``, ``NCCL_?``, ``[AB]_X``)."""
    return "=" not in item and ":" not in item and any(c in _GLOB_CHARS for c in item)


def expand_glob(pattern: str, environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """The variables of ``environ`` whose names match ``pattern`` (case-sensitive), by name.

    A name that is not portable (``is_valid_name``) is left out, as :func:`env.forwarded` does:
    YARN and MPICH could not carry it.
    """
    return [(k, environ[k]) for k in sorted(environ)
            if fnmatch.fnmatchcase(k, pattern) and jobenv.is_valid_name(k)]


def read_env_file(path: str, environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """The ``(name, value)`` pairs of the env file ``path``, in file order (a later line wins)."""
    return parse_env_text(_read(path), path, environ)


def _read(path: str) -> str:
    """The file's text: a regular file (never a FIFO that would block) of at most MAX_BYTES, UTF-8."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        raise ConfigError(f"--env-file {path}: cannot read it: {e.strerror or e}; give a file of NAME=VALUE "
                          "lines") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise ConfigError(f"--env-file {path} is {kind}; give a file of NAME=VALUE lines")
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while size <= MAX_BYTES:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise ConfigError(f"--env-file {path}: cannot read it: {e.strerror or e}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > MAX_BYTES:
        raise ConfigError(f"--env-file {path} is larger than {MAX_BYTES // (1024 * 1024)} MiB; no process "
                          "environment holds that much")
    if b"\0" in data:
        line = data[:data.index(b"\0")].count(b"\n") + 1
        raise ConfigError(f"--env-file {path}:{line}: a NUL byte, which no environment variable can hold; "
                          "is it a text file?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ConfigError(f"--env-file {path}:{line}: not UTF-8 text (byte {e.start}); save the file as UTF-8"
                          ) from None


def _bad(path: str, line: int, problem: str, fix: str) -> ConfigError:
    return ConfigError(f"--env-file {path}:{line}: {problem}; {fix}")


def parse_env_text(text: str, path: str, environ: Mapping[str, str]) -> list[tuple[str, str]]:
    """Parse dotenv ``text`` (see the module docstring); ``path`` only names the file in errors."""
    if text.startswith("\ufeff"):  # (a byte-order mark, as some editors save)
        text = text[1:]
    lines = text.split("\n")
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(lines):
        lineno = i + 1
        line = lines[i].rstrip("\r").lstrip(" \t")
        i += 1
        if not line or line.startswith("#"):
            continue
        if line.startswith("export") and line[6:7] in (" ", "\t"):
            line = line[6:].lstrip(" \t")
        name, eq, rest = line.partition("=")
        name = name.rstrip(" \t")
        if not eq:
            word = name.split("#", 1)[0].rstrip(" \t")  # (NAME  # comment)
            if jobenv.is_valid_name(word):
                if word not in environ:
                    raise _bad(path, lineno, f"{word} has no value and is not set in this shell",
                               f"write {word}=VALUE or export {word} before pslaunch")
                out.append((word, environ[word]))
                continue
            raise _bad(path, lineno, "not a NAME=VALUE line", "write NAME=VALUE (a comment starts with #)")
        if not jobenv.is_valid_name(name):
            shown = name if len(name) <= 40 else name[:40] + "..."
            raise _bad(path, lineno, f"{shown!r} is not a variable name",
                       "a name is letters, digits and _ and does not start with a digit, like WANDB_PROJECT")
        value, i = _value(rest.lstrip(" \t"), lines, i, path, lineno, name)
        out.append((name, value))
    return out


def _value(rest: str, lines: list[str], i: int, path: str, lineno: int, name: str) -> tuple[str, int]:
    """The value that starts with ``rest`` (the text after ``=``) on line ``lineno``; a quoted one may
    go on over the following lines. Returns it with the index of the next line to read."""
    if not rest.rstrip("\r") or rest[0] not in "'\"":
        value = rest.rstrip("\r")
        cut = min((value.find(c) for c in (" #", "\t#") if c in value), default=-1)
        if value.startswith("#"):
            cut = 0
        return (value[:cut] if cut >= 0 else value).rstrip(" \t"), i
    quote = rest[0]
    chars: list[str] = []
    pos, text = 1, rest
    while True:
        while pos < len(text):
            c = text[pos]
            if c == quote:
                after = text[pos + 1:].rstrip("\r").strip(" \t")
                if after and not after.startswith("#"):
                    hidden = "" if jobenv.is_secret(name) else f" ({after[:30]!r})"
                    raise _bad(path, lineno, f"text after the closing {quote} of {name}'s value{hidden}",
                               "quote the whole value, or put a # before a comment")
                return "".join(chars), i
            if c == "\\" and quote == '"' and pos + 1 < len(text):
                nxt = text[pos + 1]
                chars.append(_DQ_ESCAPES.get(nxt, "\\" + nxt))
                pos += 2
                continue
            chars.append(c)
            pos += 1
        if i >= len(lines):
            raise _bad(path, lineno, f"the {quote} that opens {name}'s value is never closed",
                       f"end the value with {quote} (a value may span lines only inside quotes)")
        if chars and chars[-1] == "\r":
            chars.pop()
        chars.append("\n")
        text, pos, i = lines[i], 0, i + 1
