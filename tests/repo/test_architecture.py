"""The import graph keeps the layers: no cycles, no upward imports, no private member across modules.

The graph is read from the source (``ast``), so it sees every import: module level, inside
functions (the lazy ones), and under ``TYPE_CHECKING`` -- a cycle through a lazy import is still
a cycle for the reader, and the next refactor that hoists the import turns it into a crash.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ROOTS = {
    "tensord": REPO / "client" / "tensord",
    "tensord_server": REPO / "server" / "tensord_server",
}
GENERATED = ("tensord._proto",)  # protoc's output: not ours to hold to these rules

# The declared layer order, lowest first.  A module may import its own layer and the layers below
# it, never one above.  The first matching prefix names a module's layer (so list the narrower
# prefixes first); a trailing ``$`` matches the name exactly (a package's own ``__init__``).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # pure, shared by both sides: the wire's constants, dtypes, the layout engine, the error types
    (
        "foundation",
        (
            "tensord._proto",
            "tensord.schema",
            "tensord.protocol",
            "tensord.errors",
            "tensord.dtypes",
            "tensord.layout",
        ),
    ),
    # the SDK, lowest first: torch's terms with no I/O, the wire, the same-host data plane,
    # what a tensor holds of its client, Tensor, the client and the package
    (
        "sdk.base",
        (
            "tensord.memory_format",
            "tensord.device",
            "tensord._convert",
            "tensord._format",
            "tensord._indexing",
            "tensord._torch",
            "tensord._meta",
            "tensord._args",
        ),
    ),
    ("sdk.wire", ("tensord.wire",)),
    ("sdk.local", ("tensord.local",)),
    ("sdk.session", ("tensord._session", "tensord._dlpack")),
    ("sdk.tensor", ("tensord.tensor", "tensord._functions")),
    ("sdk.client", ("tensord.client", "tensord.aio")),
    # the package: its public names (tensord.schema among them), imported on first use
    ("sdk.package", ("tensord$",)),
    ("data", ("tensord_server.data",)),
    ("pool", ("tensord_server.pool",)),
    ("devices", ("tensord_server.devices",)),
    ("domain", ("tensord_server.domain",)),
    # membership and the shared namespace in etcd: implements the domain's NameDirectory
    ("cluster", ("tensord_server.cluster",)),
    # metrics, the dashboard and logs: read the domain and the pools; rpc reports each call to them
    ("observability", ("tensord_server.observability",)),
    ("rpc", ("tensord_server.rpc",)),
    ("tools", ("tensord_server.tools",)),
    ("cli", ("tensord_server.cli", "tensord_server.__main__", "tensord_server$")),
)
# The server's core serves the SDK over the wire; it shares only the foundation with it.
SERVER_CORE = ("pool", "devices", "domain", "observability", "rpc")
SDK_LAYERS = tuple(layer for layer, _ in LAYERS if layer.startswith("sdk."))

# The layers below rpc know nothing of gRPC: these packages are imported only by the rpc layer
# (and the tools above it); in the SDK, only by its wire.
GRPC_PACKAGES = ("grpc", "grpc_health", "grpc_reflection", "grpc_status")
GRPC_FREE_LAYERS = ("pool", "devices", "domain", *(sdk for sdk in SDK_LAYERS if sdk != "sdk.wire"))
# Inside the rpc layer, the transport beside the gRPC server speaks no gRPC either; inside
# the SDK's wire, nor does the op pipeline (the connection sends its Batches).
GRPC_FREE_MODULES = ("tensord_server.rpc.fd_socket", "tensord.wire.batches")

# Layers inside a package, lowest first, as LAYERS orders the packages: a module imports its
# own inner layer and those below it.  Prefixes are relative to the package ("" with ``$``:
# the package's own ``__init__``).
INNER_LAYERS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "tensord_server.domain": (
        # rules and counting: no tensor state
        (
            "rules",
            (
                "$",
                "auth",
                "limits",
                "paging",
                "quotas",
                "kernels",
                "fairness",
                "call_gate",
                "directory",
                "checksum",
            ),
        ),
        # the state every op touches: Storages, the compactor moving them, sessions' handles
        ("state", ("tiers", "storage", "compactor", "spiller", "sessions")),
        # the op families, built on ops.context; none reaches a table above it
        ("ops", ("ops",)),
        # the tables a session keeps beyond its handles, and the reports over all of them
        ("tables", ("share_tokens", "names", "exports", "memory_reports")),
        # the composition root: builds and wires everything below; nothing in the domain
        # imports it
        ("store", ("store",)),
    ),
    "tensord_server.rpc": (
        # what a handler uses: the codec, the status table, the workers, the fd socket
        (
            "parts",
            ("$", "codec", "status", "binding", "tls", "executor", "fd_socket", "nodes"),
        ),
        ("handlers", ("handlers", "other_services")),
        ("calls", ("calls",)),
        ("server", ("grpc_server",)),
    ),
    "tensord.wire": (
        # what a connection is made of: none imports another layer of the wire
        ("parts", ("$", "fork", "address", "config", "status", "pipeline", "channel")),
        # threads that run gRPC work, held out of it while the process forks
        ("threads", ("worker", "streams")),
        # the one builder of every request message
        ("requests", ("requests",)),
        # the op pipeline's state: the queue, the Batch in flight, the releases, the flusher
        ("pipelining", ("batches",)),
        ("connection", ("connection",)),
    ),
    "tensord.local": (
        # the fd socket, mapped segments, GPU imports, kept destinations, parallel copies
        ("parts", ("$", "channel", "segments", "cuda_ipc", "host_cache", "copies")),
        ("mapper", ("mapper",)),
        ("transfers", ("transfers",)),
    ),
}
# The SDK's layers above the wire hand it plain values: they never name a protobuf message.
PROTOBUF_FREE_LAYERS = ("sdk.session", "sdk.tensor", "sdk.client")
PROTOBUF_MODULES = ("tensord.schema", "tensord._proto", "google.protobuf")

# Private members some code must use on objects of libraries it does not own, with the reason.
ALLOWED_PRIVATE: dict[str, str] = {
    "_asdict": "namedtuple's public API (underscore only to avoid field clashes)",
    "_replace": "namedtuple's public API (underscore only to avoid field clashes)",
    "_fields": "namedtuple's public API (underscore only to avoid field clashes)",
}


@dataclass(frozen=True)
class Module:
    name: str
    path: Path
    tree: ast.Module


def modules() -> dict[str, Module]:
    """Every module of both packages, parsed once per test run (a copy of the table each
    call: the checks may add to theirs)."""
    return dict(_parsed_modules())


@functools.cache
def _parsed_modules() -> dict[str, Module]:
    found: dict[str, Module] = {}
    for package, root in ROOTS.items():
        for path in sorted(root.rglob("*.py")):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            if name.startswith(GENERATED):
                continue
            found[name] = Module(name, path, ast.parse(path.read_text(), str(path)))
    return found


def is_package(module: Module) -> bool:
    return module.path.name == "__init__.py"


def resolve_relative(module: Module, node: ast.ImportFrom) -> str:
    base = module.name.split(".")
    if not is_package(module):
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imported_names(module: Module, known: set[str]) -> Iterator[tuple[str, int]]:
    """Every project module ``module`` imports (its deepest known name), with the line."""

    def deepest(name: str) -> str | None:
        if name.startswith(GENERATED):
            return GENERATED[0]  # generated code: a node of the foundation, not read itself
        parts = name.split(".")
        while parts:
            candidate = ".".join(parts)
            if candidate in known:
                return candidate
            parts.pop()
        return None

    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = deepest(alias.name)
                if target:
                    yield target, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = resolve_relative(module, node) if node.level else (node.module or "")
            for alias in node.names:
                target = deepest(f"{base}.{alias.name}") or deepest(base)
                if target:
                    yield target, node.lineno


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {
        name: {target for target, _ in imported_names(mod, known) if target != name}
        for name, mod in mods.items()
    }


def matches(name: str, prefix: str) -> bool:
    if prefix.endswith("$"):
        return name == prefix[:-1]
    return name == prefix or name.startswith(prefix + ".")


def layer_of(name: str) -> tuple[int, str]:
    for rank, (layer, prefixes) in enumerate(LAYERS):
        if any(matches(name, prefix) for prefix in prefixes):
            return rank, layer
    raise AssertionError(f"{name} belongs to no declared layer: add it to LAYERS")


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; the components with more than one module are cycles."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    cycles.append(sorted(component))
    return cycles


def test_the_import_graph_has_no_cycles() -> None:
    cycles = strongly_connected(import_graph())
    assert not cycles, f"import cycles (lazy imports included): {cycles}"


def test_every_module_belongs_to_a_layer() -> None:
    for name in modules():
        layer_of(name)


def test_no_module_imports_a_layer_above_it() -> None:
    mods = modules()
    upward = []
    for name, mod in mods.items():
        rank, layer = layer_of(name)
        for target, line in imported_names(mod, set(mods)):
            target_rank, target_layer = layer_of(target)
            if target in GENERATED:
                continue
            if target_rank > rank:
                upward.append(
                    f"{mod.path.relative_to(REPO)}:{line} ({layer}) -> {target} ({target_layer})"
                )
            elif layer in SERVER_CORE and target_layer in SDK_LAYERS:
                upward.append(
                    f"{mod.path.relative_to(REPO)}:{line} ({layer}) -> SDK module {target}"
                )
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def external_imports(module: Module) -> Iterator[tuple[str, int]]:
    """Every absolute module name ``module`` imports (project or not), with the line."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            yield node.module, node.lineno


def grpc_imports(mods: dict[str, Module]) -> list[str]:
    found = []
    for name, mod in mods.items():
        if layer_of(name)[1] not in GRPC_FREE_LAYERS and name not in GRPC_FREE_MODULES:
            continue
        for target, line in external_imports(mod):
            if target.split(".")[0] in GRPC_PACKAGES:
                found.append(f"{mod.path.relative_to(REPO)}:{line} imports {target}")
    return found


def test_pool_devices_and_domain_know_nothing_of_grpc() -> None:
    """A thin gRPC layer over a domain that knows nothing of gRPC: the status codes, the call
    contexts and the interceptors live in rpc/; in the SDK, everything gRPC is the wire's."""
    found = grpc_imports(modules())
    assert not found, "gRPC imported below the rpc layer or outside the SDK's wire:\n" + "\n".join(
        found
    )


def protobuf_imports(mods: dict[str, Module]) -> list[str]:
    """Imports of the schema or of protobuf by the SDK's layers above the wire, type-only
    ones included (``Meta.from_pb`` in tensord._meta is where a handle's message is read)."""
    found = []
    for name, mod in mods.items():
        if layer_of(name)[1] not in PROTOBUF_FREE_LAYERS:
            continue
        for target, line in external_imports(mod):
            if target.startswith(PROTOBUF_MODULES) or any(
                f"{target}.{alias}".startswith(PROTOBUF_MODULES)
                for alias in imported_aliases(mod, line)
            ):
                found.append(f"{mod.path.relative_to(REPO)}:{line} imports {target}")
    return found


def imported_aliases(module: Module, line: int) -> list[str]:
    """The names a ``from X import ...`` on ``line`` takes (``from tensord import schema``)."""
    return [
        alias.name
        for node in ast.walk(module.tree)
        if isinstance(node, ast.ImportFrom) and node.lineno == line
        for alias in node.names
    ]


def test_tensor_client_and_session_never_import_the_schema() -> None:
    """Tensor (and the client, and what a tensor holds of it) keep torch's surface and hand
    plain values to tensord.wire.requests, which builds every message."""
    found = protobuf_imports(modules())
    assert not found, "protobuf imported above the SDK's wire:\n" + "\n".join(found)


def inner_layer_of(package: str, name: str) -> tuple[int, str]:
    relative = name[len(package) + 1 :] if name != package else ""
    for rank, (layer, prefixes) in enumerate(INNER_LAYERS[package]):
        if any(matches(relative, prefix) for prefix in prefixes):
            return rank, layer
    raise AssertionError(f"{name} belongs to no inner layer of {package}: add it to INNER_LAYERS")


def inner_layer_crossings(graph: dict[str, set[str]]) -> list[str]:
    """Imports inside a package of INNER_LAYERS from a lower inner layer to a higher one."""
    crossings = []
    for package in INNER_LAYERS:
        for name in sorted(graph):
            if not matches(name, package):
                continue
            rank, layer = inner_layer_of(package, name)
            for target in sorted(graph[name]):
                if not matches(target, package):
                    continue
                target_rank, target_layer = inner_layer_of(package, target)
                if target_rank > rank:
                    crossings.append(f"{name} ({layer}) -> {target} ({target_layer})")
    return crossings


def test_the_domain_and_rpc_packages_keep_their_inner_layers() -> None:
    """Inside the domain the op families never reach the tables above them nor the store
    that builds them; inside rpc the handlers never reach the calls or the server; inside
    the SDK's wire and its same-host plane the parts never reach what is built of them."""
    crossings = inner_layer_crossings(import_graph())
    assert not crossings, "imports against the inner layers:\n" + "\n".join(crossings)


def is_private(attr: str) -> bool:
    return (
        attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__")) and attr != "_"
    )


def names_defined_in(tree: ast.Module) -> set[str]:
    """Private names the module itself defines: functions, classes, attributes set anywhere."""
    defined: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "setattr"
            and len(node.args) > 1
        ):
            # setattr(obj, "_x", ...) and slots declared as strings are definitions too
            arg = node.args[1]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                defined.add(arg.value)
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == "__slots__":
                    for element in ast.walk(node.value):
                        if isinstance(element, ast.Constant) and isinstance(element.value, str):
                            defined.add(element.value)
    return defined


def test_no_private_member_is_used_across_modules() -> None:
    mods = modules()
    known = set(mods)
    crossings = []
    for mod in mods.values():
        own = names_defined_in(mod.tree)
        for node in ast.walk(mod.tree):
            if isinstance(node, ast.Attribute) and is_private(node.attr):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                    continue
                if node.attr in own or node.attr in ALLOWED_PRIVATE:
                    continue
                if f"{ast.unparse(owner)}.{node.attr}" in known:
                    continue  # a private submodule, imported by the package that owns it
                crossings.append(f"{mod.path.relative_to(REPO)}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom):
                base = resolve_relative(mod, node) if node.level else (node.module or "")
                for alias in node.names:
                    if is_private(alias.name) and f"{base}.{alias.name}" not in known:
                        crossings.append(
                            f"{mod.path.relative_to(REPO)}:{node.lineno} from {base} import {alias.name}"
                        )
    assert not crossings, "private members used outside their module:\n" + "\n".join(crossings)


def test_the_checks_see_what_they_claim() -> None:
    """The checks above would pass on an empty graph: make sure they read the real one."""
    graph = import_graph()
    assert len(graph) > 20
    lazy = [t for deps in graph.values() for t in deps]
    assert lazy, "no imports found"
    assert strongly_connected({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert strongly_connected({"a": {"b"}, "b": {"c"}, "c": set()}) == []
    sample = Module(
        "tensord_server.domain.sample",
        REPO / "sample.py",
        ast.parse("import grpc\nfrom grpc_health.v1 import health\nimport json\n"),
    )
    assert grpc_imports({sample.name: sample}) == [
        "sample.py:1 imports grpc",
        "sample.py:2 imports grpc_health.v1",
    ]
    transport = Module("tensord_server.rpc.fd_socket", REPO / "fd.py", ast.parse("import grpc\n"))
    assert grpc_imports({transport.name: transport}) == ["fd.py:1 imports grpc"]
    upward = {
        "tensord_server.domain.ops.views": {"tensord_server.domain.store"},
        "tensord_server.domain.store": {"tensord_server.domain.ops.views"},
    }
    assert inner_layer_crossings(upward) == [
        "tensord_server.domain.ops.views (ops) -> tensord_server.domain.store (store)"
    ]
    tensor_like = Module(
        "tensord.tensor",
        REPO / "sample.py",
        ast.parse(
            "from tensord import schema as pb\n"
            "from google.protobuf import message\n"
            "from tensord.wire import requests\n"
        ),
    )
    assert protobuf_imports({tensor_like.name: tensor_like}) == [
        "sample.py:1 imports tensord",
        "sample.py:2 imports google.protobuf",
    ]
    assert layer_of("tensord.wire.connection")[0] < layer_of("tensord.tensor")[0]


# Importing a layer below rpc loads no gRPC at all: not through its own imports (checked
# above from the source) and not through a package's __init__ (tensord's is lazy).
GRPC_FREE_IMPORTS = (
    "tensord_server.pool",
    "tensord_server.devices",
    "tensord_server.domain",
    "tensord",
    "tensord.errors",
    "tensord.layout",
    "tensord.dtypes",
    "tensord.schema",
)


@pytest.mark.slow
def test_the_layers_below_rpc_load_no_grpc_when_imported() -> None:
    # one fresh interpreter per module: each must stand alone
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(root.parent) for root in ROOTS.values())}
    for module in GRPC_FREE_IMPORTS:
        check = (
            f"import {module}, sys; "
            "loaded = sorted(m for m in sys.modules if m.split('.')[0] in "
            f"{GRPC_PACKAGES!r} or m.startswith('tensord.wire')); "
            "assert not loaded, loaded"
        )
        result = subprocess.run(
            [sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, f"import {module} loads gRPC:\n{result.stderr}"


@pytest.mark.slow
def test_tensord_s_lazy_names_are_its_public_names_and_its_type_checked_imports() -> None:
    """``tensord/__init__``: the table __getattr__ imports from, ``__all__``, and the
    ``if TYPE_CHECKING:`` imports type checkers and the API reference read name the same."""
    import tensord

    init = modules()["tensord"].tree
    checked: set[str] = set()
    for node in ast.walk(init):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for statement in node.body:
                if isinstance(statement, ast.ImportFrom):
                    checked.update(alias.asname or alias.name for alias in statement.names)
    lazy = {name for names in tensord._LAZY.values() for name in names}
    assert lazy == set(tensord.__all__) - {"__version__"}
    assert checked == lazy | {"aio", "schema"}
    for name in tensord.__all__:
        assert getattr(tensord, name) is not None, name
    assert set(tensord.__all__) <= set(dir(tensord))


# ---- docs/architecture.md is the map of this tree ------------------------------------------

ARCHITECTURE_DOC = REPO / "docs" / "architecture.md"


def doc_layer_rows(text: str) -> list[str]:
    """The layer column of the doc's table of layers, in its order (rows ``| rank | layer |``
    whose rank is a whole number: the SDK's own table ranks its layers 1.0, 1.1, ...)."""
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            rows.append(cells[1])
    return rows


def unnamed_modules(text: str, names: list[str]) -> list[str]:
    """The modules of ``names`` the doc never names: neither in backticks nor in a path
    (``pool/allocator.py``, ``tensord.wire``, ``(`runner`, ...)``)."""
    missing = []
    for name in names:
        stem = name.rsplit(".", 1)[-1]
        named = re.search(r"[`/.(]" + re.escape(stem) + r"[`/.,) ]", text)
        if named is None:
            missing.append(name)
    return missing


def test_the_architecture_doc_lists_the_server_layers_in_order() -> None:
    server_layers = [layer for layer, _ in LAYERS if not layer.startswith("sdk.")]
    rows = doc_layer_rows(ARCHITECTURE_DOC.read_text())
    assert rows == ["foundation", "SDK", *server_layers[1:]], (
        "docs/architecture.md's table of layers differs from LAYERS: update one of them"
    )


def test_the_architecture_doc_names_every_module() -> None:
    names = sorted(name for name in modules() if "." in name)
    missing = unnamed_modules(ARCHITECTURE_DOC.read_text(), names)
    assert not missing, f"docs/architecture.md never names these modules: {missing}"


def test_the_doc_checks_find_what_is_missing() -> None:
    table = "| rank | layer |\n|---|---|\n| 0 | foundation | x |\n| 1.0 | base | y |\n| 2 | pool | z |\n"
    assert doc_layer_rows(table) == ["foundation", "pool"]
    text = "`pool/allocator.py` and `tensord.wire`, (`runner`, `nodes`)"
    assert unnamed_modules(
        text,
        ["tensord_server.pool.allocator", "tensord.wire", "x.runner", "x.nodes", "x.cache"],
    ) == ["x.cache"]
