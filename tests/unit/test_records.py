"""``pscontract.records``: the same records as ``@dataclass(frozen=True)``, without importing it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import ClassVar, Optional

import pytest
from support.helpers import REPO

from pscontract import records
from pscontract.records import field, record


def _pair():
    """The same class body, made by dataclasses and by records."""
    def body():
        class Spec:
            """A spec."""

            name: str
            port: Optional[int] = None
            tags: tuple = ()
            env: dict = field(default_factory=dict, compare=False) if made is record else \
                dataclasses.field(default_factory=dict, compare=False)
            secret: Optional[str] = field(default=None, repr=False) if made is record else \
                dataclasses.field(default=None, repr=False)
            KIND: ClassVar[str] = "spec"

            def __post_init__(self) -> None:
                if not self.name:
                    raise ValueError("no name")

        return Spec

    made = record
    ours = record(body())
    made = dataclasses.dataclass(frozen=True)
    theirs = made(body())
    return ours, theirs


def test_records_behave_as_frozen_dataclasses() -> None:
    ours, theirs = _pair()
    for cls in (ours, theirs):
        a = cls("a", 1, env={"X": "1"}, secret="s3cret")
        assert (a.name, a.port, a.tags, a.env, a.secret, cls.KIND) == ("a", 1, (), {"X": "1"}, "s3cret", "spec")
        assert repr(a).rpartition(".")[2] == "Spec(name='a', port=1, tags=(), env={'X': '1'})"  # (no secret)
        assert a == cls("a", port=1, env={"Y": "2"}, secret="s3cret")  # env is not compared
        assert a != cls("a", 2) and hash(a) == hash(cls("a", 1, secret="s3cret"))
        assert cls("b").env == {} and cls("b").env is not cls("c").env  # a fresh dict each
        with pytest.raises(AttributeError):
            a.name = "b"
        with pytest.raises(AttributeError):
            del a.port
        with pytest.raises(TypeError):
            cls()  # name is required
        with pytest.raises(TypeError):
            cls("a", nosuch=1)
        with pytest.raises(TypeError):
            cls("a", name="b")
        with pytest.raises(ValueError, match="no name"):
            cls("")
    with pytest.raises(records.FrozenInstanceError):
        ours("a").port = 2


def test_replace_validates_again_and_asdict_goes_into_nested_records() -> None:
    ours, _ = _pair()
    a = ours("a", 1)
    assert records.replace(a, port=2) == ours("a", 2) and a.port == 1
    with pytest.raises(ValueError, match="no name"):
        records.replace(a, name="")
    with pytest.raises(TypeError):
        records.replace(a, nosuch=1)
    outer = record(type("Outer", (), {"__annotations__": {"inner": "object", "items": "list"}}))
    d = records.asdict(outer(a, [a, 3]))
    assert d == {"inner": {"name": "a", "port": 1, "tags": (), "env": {}, "secret": None},
                 "items": [d["inner"], 3]}
    assert [f.name for f in records.fields(a)] == ["name", "port", "tags", "env", "secret"]


def test_a_mutable_record_is_unhashable_and_settable() -> None:
    @record(frozen=False)
    class Rec:
        code: Optional[int] = None

    r = Rec()
    r.code = 3
    assert r == Rec(3) and Rec.__hash__ is None


def test_a_field_without_default_after_one_with_is_refused() -> None:
    with pytest.raises(TypeError, match="non-default argument 'b'"):
        @record
        class Bad:
            a: int = 1
            b: int


def test_the_launchers_specs_import_no_dataclasses() -> None:
    code = ("import sys; import pscontract, launcher.spec.plan, launcher.run.supervisor, launcher.cli.job; "
            "print(sorted(m for m in ('dataclasses', 'inspect', 'click') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
