"""Every public function, class, method and property of the SDK has a docstring.

The API reference is generated from these docstrings and ``help(x.view)`` shows them,
so a public name without one is a hole in the documentation.  The public surface is
``tensord.__all__`` and ``tensord.aio``'s public names; of each class, the public
attributes it or a tensord base class defines (dunders and what ``object`` or a
built-in base such as ``Exception`` or ``tuple`` gives are not ours to document).
A docstring counts only where it is written on the object itself: an inherited one
would describe another method.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Iterator
from typing import Any

import pytest
import tensord
import tensord.aio


def _ours(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module == "tensord" or module.startswith("tensord.")


def _public_names(module: types.ModuleType) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, v in vars(module).items() if not n.startswith("_") and _ours(v)]
    return list(names)


def _documentable(attr: Any) -> Any:
    """The object whose ``__doc__`` documents a class attribute, or None for plain data."""
    if isinstance(attr, (staticmethod, classmethod)):
        return attr.__func__
    if isinstance(attr, (property, types.FunctionType)):
        return attr
    if isinstance(attr, type) and _ours(attr):
        return attr
    return None  # a data attribute (a constant, a slot, a dataclass field)


def _class_members(cls: type) -> Iterator[tuple[str, Any]]:
    """(qualified name, attribute) for each public attribute a tensord class defines."""
    seen: set[str] = set()
    for owner in cls.__mro__:
        if not _ours(owner):
            continue  # object, Exception, tuple, str...: their names are theirs
        for name, attr in vars(owner).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            yield f"{owner.__module__}.{owner.__qualname__}.{name}", attr


def _undocumented(obj: Any, qualname: str) -> Iterator[str]:
    if isinstance(obj, type):
        if not _ours(obj):
            return
        if not (vars(obj).get("__doc__") or "").strip():
            yield qualname
        for member_name, attr in _class_members(obj):
            target = _documentable(attr)
            if target is not None and not (target.__doc__ or "").strip():
                yield member_name
    elif isinstance(obj, types.FunctionType) and _ours(obj) and not (obj.__doc__ or "").strip():
        yield qualname


def _public_surface() -> list[tuple[str, Any]]:
    surface = []
    for module in (tensord, tensord.aio):
        for name in _public_names(module):
            surface.append((f"{module.__name__}.{name}", getattr(module, name)))
    return surface


def undocumented() -> list[str]:
    """Every public callable, class or property of the SDK that has no docstring."""
    missing: set[str] = set()
    for qualname, obj in _public_surface():
        missing.update(_undocumented(obj, qualname))
    return sorted(missing)


def _members_of(obj: Any) -> list[tuple[str, Any]]:
    return list(_class_members(obj)) if isinstance(obj, type) and _ours(obj) else []


def test_the_public_surface_is_walked() -> None:
    # the walk reaches the classes and the kinds of member that most need words
    names = {name for _, obj in _public_surface() for name, _ in _members_of(obj)}
    for expected in (
        "tensord.tensor.Tensor.view",
        "tensord.tensor.Tensor.shape",  # a property
        "tensord.client.Client.zeros",
        "tensord.aio.AsyncClient.close",
        "tensord.aio.AsyncTensor.sync_tensor",
        "tensord.device.Size.numel",
        "tensord.device.Device.type",
    ):
        assert expected in names, expected


def test_the_check_finds_a_missing_docstring() -> None:
    class Undocumented:
        __module__ = "tensord.example"

        def method(self) -> None:
            pass

        @property
        def value(self) -> int:
            return 1

        @staticmethod
        def helper() -> None:
            """Documented."""

        LIMIT = 3  # data: nothing to document

    def function() -> None:
        pass

    function.__module__ = "tensord.example"
    found = set(_undocumented(Undocumented, "Undocumented")) | set(
        _undocumented(function, "function")
    )
    assert found == {
        "Undocumented",
        "tensord.example.test_the_check_finds_a_missing_docstring.<locals>.Undocumented.method",
        "tensord.example.test_the_check_finds_a_missing_docstring.<locals>.Undocumented.value",
        "function",
    }


def test_every_public_name_has_a_docstring() -> None:
    missing = undocumented()
    if missing:
        pytest.fail(f"{len(missing)} public names have no docstring:\n  " + "\n  ".join(missing))


def test_docstrings_name_only_parameters_of_the_signature() -> None:
    # a Google-style Args: entry must name a parameter (the API reference refuses others)
    wrong = []
    for qualname, obj in _public_surface():
        targets = [(qualname, obj)] if isinstance(obj, types.FunctionType) else []
        for member_name, attr in _members_of(obj):
            target = _documentable(attr)
            if isinstance(target, types.FunctionType):
                targets.append((member_name, target))
        for name, function in targets:
            parameters = set(inspect.signature(function).parameters)
            for documented in _args_section(function.__doc__ or ""):
                if documented.lstrip("*") not in parameters:
                    wrong.append(f"{name}: {documented}")
    assert not wrong, wrong


def _args_section(doc: str) -> list[str]:
    """The parameter names an ``Args:`` section lists (Google style)."""
    lines = inspect.cleandoc(doc).splitlines()
    names: list[str] = []
    inside = False
    indent = None
    for line in lines:
        if line.strip() in ("Args:", "Arguments:", "Parameters:"):
            inside, indent = True, None
            continue
        if not inside:
            continue
        if line and not line.startswith(" "):
            inside = False  # the next section, or prose
            continue
        if not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        if indent is None:
            indent = width
        if width == indent:
            names.append(line.strip().split(":", 1)[0].split(" (", 1)[0])
    return names


def test_the_args_check_reads_a_google_section() -> None:
    doc = """Summary.

    Args:
        dim: A dimension,
            continued.
        *shape: The sizes.

    Returns:
        name: not a parameter.
    """
    assert _args_section(doc) == ["dim", "*shape"]
