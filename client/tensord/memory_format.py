"""``tensord.channels_last`` and its kin: torch.memory_format's four values.

Each is a singleton that names its format as the layout engine does
(``tensord.channels_last.name == "channels_last"``).  Wherever the SDK takes a
memory format it also takes torch's own objects (``torch.channels_last``), and
refuses anything else with torch's TypeError text.
"""

from __future__ import annotations

import sys
from typing import Any, ClassVar

from tensord import errors
from tensord.layout import CHANNELS_LAST, CHANNELS_LAST_3D, CONTIGUOUS_FORMAT, PRESERVE_FORMAT


class MemoryFormat:
    """One memory format (torch.memory_format).  Compare with ``is`` or ``==``."""

    __slots__ = ("name",)
    _by_name: ClassVar[dict[str, MemoryFormat]] = {}

    name: str

    def __new__(cls, name: str) -> MemoryFormat:
        # one object per name, so unpickling and copying give back the module's singleton
        existing = cls._by_name.get(name)
        if existing is not None:
            return existing
        self = super().__new__(cls)
        object.__setattr__(self, "name", name)
        cls._by_name[name] = self
        return self

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError("a MemoryFormat is immutable")

    def __repr__(self) -> str:
        return f"tensord.{self.name}"

    __str__ = __repr__

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (MemoryFormat, (self.name,))


contiguous_format = MemoryFormat(CONTIGUOUS_FORMAT)
channels_last = MemoryFormat(CHANNELS_LAST)
channels_last_3d = MemoryFormat(CHANNELS_LAST_3D)
preserve_format = MemoryFormat(PRESERVE_FORMAT)


def python_type_name(value: Any) -> str:
    """What torch's argument parser prints for a value's type (CPython's tp_name):
    a class defined in Python by its bare name, an extension type as module.name
    (``numpy.int64``, ``torch.dtype``), a built-in by its name."""
    cls = type(value)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return "Tensor"
    heap_type = bool(cls.__flags__ & (1 << 9))  # Py_TPFLAGS_HEAPTYPE
    if heap_type or cls.__module__ == "builtins":
        return cls.__name__
    return f"{cls.__module__}.{cls.__name__}"


def is_memory_format(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return isinstance(value, MemoryFormat) or (
        torch is not None and isinstance(value, torch.memory_format)
    )


def memory_format_name(value: Any, function: str) -> str:
    """A tensord or torch memory format -> its name ("channels_last"); anything else
    raises torch's TypeError for ``function``'s ``memory_format`` argument."""
    if isinstance(value, MemoryFormat):
        return value.name
    if is_memory_format(value):
        return str(value).removeprefix("torch.")
    raise errors.TensordTypeError(
        f"{function}(): argument 'memory_format' must be torch.memory_format, not "
        f"{python_type_name(value)}"
    )


def no_positional_or_unknown(function: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """torch's texts for methods whose only argument is the keyword ``memory_format``."""
    if args:
        were = "was" if len(args) == 1 else "were"
        raise errors.TensordTypeError(
            f"{function}() takes 0 positional arguments but {len(args)} {were} given"
        )
    if kwargs:
        raise errors.TensordTypeError(
            f"{function}() got an unexpected keyword argument '{next(iter(kwargs))}'"
        )
