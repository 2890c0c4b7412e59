"""``--config job.yaml``: a YAML mapping of long option names to values, read defensively.

The file is read with limits, so that a mistaken or hostile file is one line on stderr and
exit 2, never a hang, a traceback or the OOM killer:

* a regular file (not a device or FIFO) of at most :data:`MAX_BYTES`, UTF-8 text;
* YAML nested at most :data:`MAX_DEPTH` levels, with at most :data:`MAX_NODES` nodes, counted
  *after* alias expansion (``&a [*b, *b, ...]`` chains, the "billion laughs", are refused by
  their expanded size before anything walks them);
* no key given twice in one mapping (YAML would keep the last one silently);
* every value of the type its option takes, checked here rather than coerced by click
  (``num-workers: 1.5`` would become 1): a whole number for an integer option, a number for a
  seconds option, true/false for a flag, a string or a list of strings for ``command``, names
  to strings or numbers for ``env``; ``null`` is refused (remove the key for the default).
"""

from __future__ import annotations

import difflib
import math
import os
import re
import shlex
import stat
from typing import Any

import click

from ..errors import ConfigError
from .clickutil import Duration, FiniteFloat, WorkerCount

MAX_BYTES = 1024 * 1024
MAX_DEPTH = 50
MAX_NODES = 10_000

_LIST_OPTIONS = ("command",)  # besides the repeatable (multiple=True) options
_ENV_OPTIONS = ("env", "env_server", "env_worker")


def option_keys(command: click.Command) -> dict[str, click.Parameter]:
    """YAML key (``num_workers``, dashes as underscores) -> the click parameter it sets."""
    keys: dict[str, click.Parameter] = {}
    for p in command.params:
        if p.name in ("config", "version", "help") or p.name is None:
            continue
        keys[p.name] = p
        for opt in getattr(p, "opts", []):
            if opt.startswith("--"):
                keys[opt[2:].replace("-", "_")] = p
    return keys


def read_text(path: str) -> str:
    """The file's text: a regular file of at most :data:`MAX_BYTES`, UTF-8."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)  # a FIFO must not block here
    except OSError as e:
        raise ConfigError(f"cannot read --config {path}: {e.strerror or e}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        raise ConfigError(f"--config {path} is {kind}; give a YAML file")
    os.set_blocking(fd, True)
    with os.fdopen(fd, "rb") as f:
        try:
            data = f.read(MAX_BYTES + 1)
        except OSError as e:
            raise ConfigError(f"cannot read --config {path}: {e.strerror or e}") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(f"--config {path} is larger than {MAX_BYTES // 1024} KiB; a job's options fit in a "
                          "few lines")
    if b"\0" in data:
        raise ConfigError(f"--config {path} is a binary file, not YAML text")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {path} is not UTF-8 text (byte {e.start}); is it a YAML file?") from None


#: what YAML 1.1 reads as a number in base 60 (``2:4`` is 124, ``1:30.5`` is 90.5)
SEXAGESIMAL = re.compile(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?")
#: ``num-workers: MIN:MAX`` (the option itself checks the numbers)
WORKER_SPAN = re.compile(r"\s*\d+\s*:\s*\d+\s*")


def _loader_class() -> type:
    import yaml

    class Loader(yaml.SafeLoader):
        """The safe loader with the limits above (compose-time depth and node counts)."""

        def __init__(self, stream: str, path: str) -> None:
            super().__init__(stream)
            self.path = path
            self.depth = 0
            self.nodes = 0

        def where(self, node: Any) -> str:
            mark = getattr(node, "start_mark", None)
            return f"{self.path}:{mark.line + 1}" if mark is not None else self.path

        def compose_node(self, parent: Any, index: Any) -> Any:
            self.depth += 1
            self.nodes += 1
            if self.depth > MAX_DEPTH:
                raise ConfigError(f"{self.path}:{self.peek_event().start_mark.line + 1}: nested more than "
                                  f"{MAX_DEPTH} levels deep; a job's options are a flat mapping")
            if self.nodes > MAX_NODES:
                raise ConfigError(f"{self.path}: more than {MAX_NODES:,} YAML values; a job's options fit in "
                                  "a few lines")
            try:
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def resolve(self, kind: Any, value: Any, implicit: Any) -> Any:
            """YAML 1.2's plain scalars for YAML 1.1's base 60: ``2:4`` (``-n MIN:MAX``) stays the text
            the option parses, never the number 124."""
            if kind is yaml.ScalarNode and implicit[0] and SEXAGESIMAL.fullmatch(value):
                return "tag:yaml.org,2002:str"
            return super().resolve(kind, value, implicit)

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            if isinstance(node, yaml.MappingNode):
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                        continue
                    key = key_node.value
                    if key in seen:
                        raise ConfigError(f"{self.where(key_node)}: key {key!r} is given twice (first on line "
                                          f"{seen[key]}); keep one")
                    seen[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep=deep)

    return Loader


def expanded_size(root: Any) -> int:
    """Nodes in the document with every alias expanded, stopping once past :data:`MAX_NODES`.

    Aliases make the composed graph a DAG whose expansion can be exponential; sizes are
    computed once per node (memoised), so this is linear in the distinct nodes.
    """
    import yaml

    sizes: dict[int, int] = {}
    # iterative post-order: depth is bounded by MAX_DEPTH, but no recursion is needed
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, ready = stack.pop()
        if id(node) in sizes:
            continue
        if isinstance(node, yaml.ScalarNode):
            sizes[id(node)] = 1
            continue
        children = ([c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode)
                    else list(node.value))
        if ready:
            sizes[id(node)] = min(MAX_NODES + 1, 1 + sum(sizes[id(c)] for c in children))
        else:
            stack.append((node, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
    return sizes[id(root)]


def parse_yaml(text: str, path: str) -> Any:
    """The document, within the limits (:class:`ConfigError` otherwise)."""
    import yaml

    loader = None
    try:
        loader = _loader_class()(text, path)  # (the reader checks every character here)
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise ConfigError(f"{path}: nested too deeply; a job's options are a flat mapping") from None
        if node is None:
            return None
        if expanded_size(node) > MAX_NODES:
            raise ConfigError(f"{path}: more than {MAX_NODES:,} YAML values once its aliases (*name) are "
                              "expanded; write the values out")
        try:
            return loader.construct_document(node)
        except ValueError as e:  # e.g. an integer of more than 4,300 digits
            raise ConfigError(f"{path}: a value cannot be read: {' '.join(str(e).split())[:200]}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else path
        problem = getattr(e, "problem", None) or getattr(e, "reason", None) or "not valid YAML"
        raise ConfigError(f"{where}: {' '.join(str(problem).split())}") from None
    finally:
        if loader is not None:
            loader.dispose()


# --- values -----------------------------------------------------------------------------------


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true/false"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _scalar_text(value: Any, where: str) -> str:
    """A string or number as a string; anything else refused."""
    if isinstance(value, bool) or value is None or not isinstance(value, (str, int, float)):
        hint = " (quote it: 'yes', 'true')" if isinstance(value, bool) else ""
        raise ConfigError(f"{where} is {_kind(value)}; expected a string or a number{hint}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where} is {value}; expected a finite number or a string")
    return value if isinstance(value, str) else str(value)


def convert(key: str, value: Any, param: click.Parameter, path: str) -> Any:
    """One YAML value, checked against its option's type; returned in the form click takes."""
    assert param.name is not None
    where = f"{path}: {key}"
    if value is None:
        raise ConfigError(f"{where} has no value (null); give one, or remove the key for the default")
    if param.name in _ENV_OPTIONS and isinstance(value, dict):
        items = []
        for name, v in value.items():
            if not isinstance(name, str):
                raise ConfigError(f"{where}: the name {name!r} is {_kind(name)}; expected a variable name")
            if v is None:
                items.append(name)  # the bare NAME form: this shell's value
            else:
                items.append(f"{name}={_scalar_text(v, f'{where}: {name}')}")
        return items
    if getattr(param, "multiple", False) or param.name in _LIST_OPTIONS:
        if param.name == "command" and isinstance(value, str):
            try:
                return shlex.split(value)
            except ValueError as e:
                raise ConfigError(f"{where}: {e} (in the command string)") from None
        if isinstance(value, str) and param.name != "command":
            value = [value]
        if not isinstance(value, list):
            example = ("command: [python, train.py]" if param.name == "command"
                       else f"{key}: [A=1, B=2]")
            raise ConfigError(f"{where} is {_kind(value)}; expected a list such as {example}")
        return [_scalar_text(v, f"{where} item {i}") for i, v in enumerate(value, 1)]
    if isinstance(value, (list, dict)):
        raise ConfigError(f"{path}: {key} takes a single value, not {_kind(value)}")
    if getattr(param, "is_flag", False):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} is {_kind(value)}; expected true or false")
        return value
    if isinstance(value, bool) and getattr(param, "_flag_needs_value", False):
        if not value:  # (ui: true is --ui alone)
            raise ConfigError(f"{where} is false; remove the key for no {key}")
        return param.flag_value  # type: ignore[attr-defined]
    if isinstance(value, bool):
        raise ConfigError(f"{path}: {key} takes a value, not true/false")
    ptype = getattr(param, "type", None)
    if isinstance(ptype, (click.types.IntParamType, WorkerCount)):
        if isinstance(value, int) and value.bit_length() > 63:
            raise ConfigError(f"{where} is a number of {int(value.bit_length() * 0.30103) + 1} digits, far too large")
        span = isinstance(ptype, WorkerCount) and isinstance(value, str) and WORKER_SPAN.fullmatch(value)
        if isinstance(value, float) or (isinstance(value, str) and not value.strip().lstrip("+-").isdigit()
                                        and not span):
            also = " (or MIN:MAX, e.g. 2:4)" if isinstance(ptype, WorkerCount) else ""
            raise ConfigError(f"{where} is {str(value)[:40]!r}; expected a whole number{also}")
        return value
    if isinstance(ptype, Duration):  # (seconds, or a number with a unit: 30m, 1h)
        try:
            return ptype.convert(value, param, None)
        except click.BadParameter as e:
            raise ConfigError(f"{where}: {e.message}") from None
    if isinstance(ptype, (click.types.FloatParamType, FiniteFloat)):
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{where} is {value!r}; expected a number") from None
        if not math.isfinite(float(value)):
            raise ConfigError(f"{where} is {value}; expected a finite number")
        return value
    return _scalar_text(value, where)


def load_config(path: str, command: click.Command) -> dict[str, Any]:
    """The options ``path`` sets, keyed by click parameter name (checked; see the module docstring)."""
    data = parse_yaml(read_text(path), path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of option names to values, got {_kind(data)}")
    keys = option_keys(command)
    out: dict[str, Any] = {}
    for raw_key, value in data.items():
        if not isinstance(raw_key, str):
            raise ConfigError(f"{path}: the key {str(raw_key)[:40]!r} is {_kind(raw_key)}; keys are the long "
                              "option names, e.g. num-workers")
        key = raw_key.replace("-", "_")
        param = keys.get(key)
        if param is None:
            hint = difflib.get_close_matches(key, list(keys), n=1)
            suggestion = f" (did you mean {hint[0].replace('_', '-')!r}?)" if hint else ""
            shown = raw_key if len(raw_key) <= 40 else raw_key[:40] + "..."
            raise ConfigError(f"{path}: unknown key {shown!r}{suggestion}; keys are the long option "
                              "names, e.g. num-workers, hostfile, env")
        assert param.name is not None
        if param.name in out:
            raise ConfigError(f"{path}: {raw_key} and another spelling of it are both given; keep one")
        out[param.name] = convert(raw_key, value, param, path)
    return out
