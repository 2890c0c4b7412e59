"""Frozen records: what ``@dataclass(frozen=True)`` gives the launcher's specs, at a fraction of its cost.

``dataclasses`` imports ``inspect`` (with ``ast``, ``dis`` and ``tokenize``) and compiles a
few functions for every class it makes: 12 ms to import and 0.5 ms a class on a small machine,
a third of a launcher's start-up before its first process runs. :func:`record` reads the same
class body (annotated fields, defaults, :func:`field`) and gives the same instances (keyword or
positional construction, ``__post_init__``, frozen attributes, equality, hash and repr over the
fields) through one shared ``__init__``: nothing is compiled.

Type checkers see ``dataclasses`` itself (the names are aliased under ``TYPE_CHECKING``).
Standard library only: nodes import it with :mod:`pscontract`.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # pragma: no cover
    from dataclasses import FrozenInstanceError, asdict, field, fields, replace  # noqa: F401 (the same API)
    from dataclasses import dataclass as record
else:
    _MISSING = object()

    class FrozenInstanceError(AttributeError):
        """Raised on assigning to (or deleting) a field of a frozen record."""

    class Field:
        """One field: its name, default (or factory) and whether repr and comparisons show it."""

        __slots__ = ("name", "default", "default_factory", "repr", "compare")

        def __init__(self, default=_MISSING, default_factory=_MISSING, repr=True, compare=True):  # noqa: A002
            if default is not _MISSING and default_factory is not _MISSING:
                raise ValueError("cannot specify both default and default_factory")
            self.name = ""
            self.default = default
            self.default_factory = default_factory
            self.repr = repr
            self.compare = compare

        def __repr__(self):
            return f"Field(name={self.name!r})"

    def field(*, default=_MISSING, default_factory=_MISSING, repr=True, compare=True):  # noqa: A002
        """A field's settings, as :func:`dataclasses.field` (default, default_factory, repr, compare)."""
        return Field(default, default_factory, repr, compare)

    def _is_classvar(annotation) -> bool:
        text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
        return text.replace("typing.", "").startswith("ClassVar")

    def _init(self, *args, **kwargs):
        cls = type(self)
        fields_ = cls.__record_fields__
        if len(args) > len(fields_):
            raise TypeError(f"{cls.__name__}() takes {len(fields_)} arguments but {len(args)} were given")
        for i, f in enumerate(fields_):
            if i < len(args):
                if f.name in kwargs:
                    raise TypeError(f"{cls.__name__}() got multiple values for argument {f.name!r}")
                value = args[i]
            elif f.name in kwargs:
                value = kwargs.pop(f.name)
            elif f.default is not _MISSING:
                value = f.default
            elif f.default_factory is not _MISSING:
                value = f.default_factory()
            else:
                raise TypeError(f"{cls.__name__}() missing required argument: {f.name!r}")
            object.__setattr__(self, f.name, value)
        if kwargs:
            raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {next(iter(kwargs))!r}")
        post = getattr(self, "__post_init__", None)
        if post is not None:
            post()

    def _key(self):
        return tuple(getattr(self, f.name) for f in type(self).__record_fields__ if f.compare)

    def _eq(self, other):
        if other.__class__ is self.__class__:
            return _key(self) == _key(other)
        return NotImplemented

    def _hash(self):
        return hash(_key(self))

    def _repr(self):
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in type(self).__record_fields__ if f.repr)
        return f"{type(self).__qualname__}({shown})"

    def _frozen_setattr(self, name, value):
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def _frozen_delattr(self, name):
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def _make(cls, frozen):
        own = cls.__dict__.get("__annotations__", {})
        inherited = [f for base in reversed(cls.__mro__[1:]) for f in base.__dict__.get("__record_fields__", ())]
        fields_ = {f.name: f for f in inherited}
        for name, annotation in own.items():
            if _is_classvar(annotation):
                continue
            value = cls.__dict__.get(name, _MISSING)
            f = value if isinstance(value, Field) else Field(default=value)
            f.name = name
            if isinstance(value, Field):
                if f.default is _MISSING:
                    delattr(cls, name)
                else:
                    setattr(cls, name, f.default)
            fields_[name] = f
        seen_default = False
        for f in fields_.values():
            has_default = f.default is not _MISSING or f.default_factory is not _MISSING
            if seen_default and not has_default:
                raise TypeError(f"non-default argument {f.name!r} follows default argument")
            seen_default = seen_default or has_default
        cls.__record_fields__ = tuple(fields_.values())
        methods = {"__init__": _init, "__repr__": _repr, "__eq__": _eq}
        if frozen:
            methods.update(__setattr__=_frozen_setattr, __delattr__=_frozen_delattr)
        for name, fn in methods.items():
            if name not in cls.__dict__:
                setattr(cls, name, fn)
        if "__hash__" not in cls.__dict__ or cls.__dict__["__hash__"] is None:
            cls.__hash__ = _hash if frozen else None  # (as dataclasses: eq without frozen is unhashable)
        return cls

    def record(cls=None, *, frozen=True):
        """Make ``cls`` a record (``@record``, or ``@record(frozen=False)`` for a mutable one)."""
        if cls is None:
            return lambda c: _make(c, frozen)
        return _make(cls, frozen)

    def fields(obj):
        """The record's (or record class's) fields, in order."""
        return (obj if isinstance(obj, type) else type(obj)).__record_fields__

    def replace(obj, **changes):
        """A new record like ``obj`` with ``changes`` (validated again by its ``__post_init__``)."""
        values = {f.name: getattr(obj, f.name) for f in type(obj).__record_fields__}
        unknown = set(changes) - set(values)
        if unknown:
            raise TypeError(f"{type(obj).__name__} has no field {sorted(unknown)[0]!r}")
        values.update(changes)
        return type(obj)(**values)

    def asdict(obj):
        """The record's fields as a dict, records inside it (also in lists, tuples and dicts) too."""
        def convert(value):
            if hasattr(type(value), "__record_fields__") and not isinstance(value, type):
                return {f.name: convert(getattr(value, f.name)) for f in type(value).__record_fields__}
            if isinstance(value, (list, tuple)):
                return type(value)(convert(v) for v in value)
            if isinstance(value, dict):
                return {convert(k): convert(v) for k, v in value.items()}
            return value

        return convert(obj)
