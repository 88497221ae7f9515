"""Files that ship inside the ``tensord_server`` package: the bundled allocator traces.

``traces/<name>.events.json.gz`` is a recorded PyTorch allocator trace and
``traces/<name>.pytorch[_variant]_stats.json`` PyTorch's own figures for it.
They are found through :mod:`importlib.resources` anchored at ``tensord_server``
(not at this module), so they are found the same way from a checkout, an
editable install, a wheel and the Docker image, and wherever the modules that
use them move within the package.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

#: the suffix of a bundled trace's events file; its name is the file name less this
TRACE_SUFFIX = ".events.json.gz"

#: the trace replayed when none is named (the ResNet-50 training run)
DEFAULT_TRACE_NAME = "resnet50_train"


def traces_dir() -> Path:
    """The bundled traces' folder.  A ``Path``: the package is always installed unzipped."""
    return Path(str(files("tensord_server") / "data" / "traces"))


def bundled_traces() -> list[str]:
    """The names of the bundled traces, sorted: ``["gpt_train", "lstm_train", ...]``."""
    folder = traces_dir()
    if not folder.is_dir():
        return []
    return sorted(p.name[: -len(TRACE_SUFFIX)] for p in folder.glob("*" + TRACE_SUFFIX))


def bundled_trace(name: str) -> Path:
    """The events file of the bundled trace ``name``; ``KeyError`` naming the ones there are."""
    if name not in bundled_traces():
        raise KeyError(
            f"no bundled trace {name!r}; bundled: {', '.join(bundled_traces()) or 'none'}"
        )
    return traces_dir() / (name + TRACE_SUFFIX)


def resolve_trace(spec: str | Path) -> Path:
    """A trace file's path: ``spec`` itself when it is a file, else the bundled trace of that name.

    A file wins over a bundled trace of the same name; neither gives
    ``FileNotFoundError`` that lists the bundled names.
    """
    path = Path(spec)
    if path.is_file():
        return path
    if str(spec) in bundled_traces():
        return bundled_trace(str(spec))
    raise FileNotFoundError(
        f"no trace file {str(spec)!r} and no bundled trace of that name "
        f"(bundled: {', '.join(bundled_traces()) or 'none'})"
    )
