"""The package layering ARCHITECTURE.md draws, checked on every module's imports (ast, no import)."""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> Iterator[str]:
    """Every module ``path`` imports, absolute, including lazy imports inside functions."""
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _graph() -> dict[str, set[str]]:
    return {
        _module(p): set(_imports(p))
        for top in ("app", "contract", "connector")
        for p in sorted((REPO / top).rglob("*.py"))
    }


GRAPH = _graph()


def _under(name: str, *packages: str) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in packages)


def _violations(sources: tuple[str, ...], forbidden: tuple[str, ...]) -> list[tuple[str, str]]:
    return sorted(
        (mod, imp)
        for mod, imports in GRAPH.items()
        if _under(mod, *sources)
        for imp in imports
        if _under(imp, *forbidden)
    )


def test_the_graph_is_read() -> None:
    assert "app.core.service" in GRAPH and "app.api.routes.blocks" in GRAPH and "connector.vllm" in GRAPH
    assert "app.core.service" in GRAPH["app.api.routes.blocks"]


# the vLLM wing and the two module paths users write in vLLM's config besides ``connector.vllm``
VLLM_SIDE = ("connector.vllm", "connector.vllm_tier", "connector.vllm_offloading")


@pytest.mark.parametrize(
    ("sources", "forbidden"),
    [
        (("app.core", "app.events", "app.storage", "app.index", "app.config", "app.errors"), ("app.api", "app.main")),
        # the KV events' wing builds on the core and the index; neither knows it (the core sees an EventSink)
        (("app.core", "app.storage", "app.index", "app.config", "app.errors"), ("app.events",)),
        (("app.storage", "app.index", "app.config", "app.errors"), ("app.core",)),
        # the edge speaks to the core alone; the value types it needs have a home there (app/core/values.py)
        (("app.api",), ("app.storage", "app.index")),
        (
            ("app.api", "app.core", "app.events", "app.storage", "app.index", "app.config", "app.errors", "app.main"),
            ("app.tools",),
        ),
        (("connector",), ("app",)),
        (("app",), ("connector",)),
        (("contract",), ("app", "connector")),
        # the HTTP edge, by kind: routes and middleware know nothing of the server that runs them, nor each other
        (("app.api.routes", "app.api.middleware", "app.api.errors"), ("app.api.server", "app.api.openapi")),
        (("app.api.routes",), ("app.api.middleware",)),
        (("app.api.middleware",), ("app.api.routes",)),
        # the connector's wings: the client and the device copies stand alone; planning asks the gateway (through
        # the client) but touches no device; the worker joins the three; only the vLLM wing knows vLLM's side
        (("connector.http",), ("connector.planning", "connector.device", "connector.worker", *VLLM_SIDE)),
        (("connector.device",), ("connector.http", "connector.planning", "connector.worker", *VLLM_SIDE)),
        (("connector.planning",), ("connector.device", "connector.worker", *VLLM_SIDE)),
        (("connector.worker",), VLLM_SIDE),
    ],
)
def test_lower_layers_do_not_import_higher_ones(sources: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    assert _violations(sources, forbidden) == []


def test_the_shared_contract_is_stdlib_only() -> None:
    """``contract`` is what both halves share: no third-party import, nothing of ``app`` or ``connector``."""
    shared = [mod for mod in GRAPH if _under(mod, "contract")]
    assert {"contract.keys", "contract.wire"} <= set(shared)
    for mod in shared:
        tops = {imp.split(".")[0] for imp in GRAPH[mod]}
        assert tops <= {*sys.stdlib_module_names, "__future__", "contract"}, (mod, tops)


def test_only_the_vllm_modules_import_vllm() -> None:
    importers = {mod for mod, imports in GRAPH.items() for imp in imports if _under(imp, "vllm")}
    assert importers == {
        "connector.vllm.connector",
        "connector.vllm.layout",
        "connector.vllm.metrics",
        "connector.vllm.offloading",
        "connector.vllm.tier",
    }


def test_api_is_split_by_kind() -> None:
    """``app/api`` holds the error table, the route table (what auth and a 405 read), the spec edits and the file
    reloading; the rest is a route, a middleware or the server."""
    flat = {mod for mod in GRAPH if mod.startswith("app.api.") and mod.count(".") == 2}
    assert flat == {
        "app.api.errors",
        "app.api.openapi",
        "app.api.reloading",
        "app.api.routing",
        "app.api.routes",
        "app.api.middleware",
        "app.api.server",
    }


def test_only_the_app_builder_assembles_the_server() -> None:
    """The server is put together in one place (``app.main.create_server``), so tests can run what ``serve`` runs."""
    users = {
        mod
        for mod, imports in GRAPH.items()
        if not _under(mod, "app.api.server")
        for imp in imports
        if _under(imp, "app.api.server")
    }
    assert users == {"app.main"}


def _cycles(packages: tuple[str, ...]) -> list[list[str]]:
    """Import cycles among the modules of ``packages`` (lazy imports count: a cycle is a cycle)."""
    nodes = {mod for mod in GRAPH if _under(mod, *packages)}
    edges = {mod: {imp for imp in GRAPH[mod] if imp in nodes and imp != mod} for mod in nodes}
    found: list[list[str]] = []
    state: dict[str, int] = {}

    def visit(mod: str, stack: list[str]) -> None:
        state[mod] = 1
        for nxt in sorted(edges[mod]):
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt) :], mod, nxt] if nxt in stack else [mod, nxt])
            elif nxt not in state:
                visit(nxt, [*stack, mod])
        state[mod] = 2

    for mod in sorted(nodes):
        if mod not in state:
            visit(mod, [])
    return found


def test_the_edge_has_no_import_cycle() -> None:
    assert _cycles(("app.api", "app.main")) == []


def test_the_events_wing_has_no_import_cycle() -> None:
    assert {"app.events.model", "app.events.publisher", "app.core.event_sink"} <= set(GRAPH)
    assert _cycles(("app.events",)) == []


def _trees() -> dict[str, ast.Module]:
    return {
        _module(p): ast.parse(p.read_text(), str(p))
        for top in ("app", "contract", "connector")
        for p in sorted((REPO / top).rglob("*.py"))
    }


TREES = _trees()


def _own_names(tree: ast.Module) -> set[str]:
    """Names a module defines for its own objects: functions, classes, and attributes set on ``self``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)  # dataclass fields, slots
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("_"):
            names.add(node.value)  # __slots__ entries
    return names


def _package(mod: str) -> str:
    """The package a module's objects belong to for privacy: ``app.core``, ``app.api.routes``, ``connector``..."""
    parts = mod.split(".")
    return ".".join(parts[:3] if parts[:2] == ["app", "api"] else parts[:2] if parts[0] == "app" else parts[:1])


def test_no_module_reads_another_package_s_private_attributes() -> None:
    """``x._name`` only where ``_name`` belongs to objects of the reading module's own package: a collaborator from
    elsewhere is used through what it offers (its private attributes, or a library's, are not an interface)."""
    own_by_package: dict[str, set[str]] = {}
    for mod, tree in TREES.items():
        own_by_package.setdefault(_package(mod), set()).update(_own_names(tree))
    found = []
    for mod, tree in TREES.items():
        own = own_by_package[_package(mod)]
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if node.attr not in own:
                found.append(f"{mod}:{node.lineno} .{node.attr}")
    assert found == []


def test_the_core_does_not_probe_its_collaborators() -> None:
    """What a store can do is declared in its protocol (with do-nothing defaults), never discovered by getattr or
    hasattr: a backend that leaves an ability out must not silently change how the core behaves."""
    probes = [
        f"{mod}:{node.lineno}"
        for mod, tree in TREES.items()
        if _under(mod, "app.core")
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
    ]
    assert probes == []


def test_app_passes_state_as_parameters_not_context_variables() -> None:
    """A PUT's block meta reaches the index as a parameter (app/core/event_sink.py), not through a ``ContextVar``
    that no signature on the way mentions."""
    users = sorted(mod for mod, imports in GRAPH.items() if _under(mod, "app") and "contextvars.ContextVar" in imports)
    assert users == []


def test_the_index_is_composed_not_mixed() -> None:
    """The index holds its parts (the event log, the staging intents, the whole-table scans) and hands each its group
    commit: no class of ``app.index`` has two bases, so no method reaches another part's state through ``self``."""
    mixed = [
        f"{mod}.{node.name}"
        for mod, tree in TREES.items()
        if _under(mod, "app.index")
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and len(node.bases) > 1
    ]
    assert mixed == []


CONNECTOR_WINGS = ("connector.http", "connector.planning", "connector.device", "connector.worker", "connector.vllm")


def test_the_connector_is_split_by_wing() -> None:
    """``connector/`` holds its wings; the only modules at its top are the two module paths users write in vLLM's
    config besides the ``connector.vllm`` package (``connector.vllm_tier``, ``connector.vllm_offloading``)."""
    top = {mod for mod in GRAPH if mod.startswith("connector.") and mod.count(".") == 1}
    assert top == {*CONNECTOR_WINGS, "connector.vllm_tier", "connector.vllm_offloading"}
    assert GRAPH["connector.vllm_tier"] <= {"connector.vllm.tier", "connector.vllm.tier.KVGateTier"}
    assert GRAPH["connector.vllm_offloading"] <= {
        "connector.vllm.offloading",
        "connector.vllm.offloading.KVGateOffloadingConnector",
    }


def test_the_connector_wings_have_no_import_cycle() -> None:
    """Between wings (a wing is one node) and between modules: none."""

    def wing(mod: str) -> str | None:
        return next((w for w in CONNECTOR_WINGS if _under(mod, w)), None)

    edges: dict[str, set[str]] = {w: set() for w in CONNECTOR_WINGS}
    for mod, imports in GRAPH.items():
        if (src := wing(mod)) is not None:
            edges[src] |= {dst for imp in imports if (dst := wing(imp)) not in (None, src)}
    order: list[str] = []
    while len(order) < len(edges):  # peel off the wings nothing left imports from: all of them, or a cycle is left
        free = sorted(w for w in edges if w not in order and edges[w] <= set(order))
        assert free, {w: edges[w] - set(order) for w in edges if w not in order}
        order += free
    assert _cycles(("connector",)) == []


def _block_meta_fields() -> set[str]:
    """The fields of the block meta the writers send (``contract.wire.BlockMetaValue``), read from its class."""
    cls = next(
        node
        for node in ast.walk(TREES["contract.wire"])
        if isinstance(node, ast.ClassDef) and node.name == "BlockMetaValue"
    )
    return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of a module's docstring nodes (prose: they may say "parent" as a word)."""
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def _names_of(tree: ast.Module, words: set[str]) -> list[str]:
    """Where code names one of ``words``: an identifier, attribute, argument, keyword or column, or a word of a string
    that is not a docstring (SQL, a column's name)."""
    prose = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        names: set[str] = set()
        if isinstance(node, ast.Name):
            names = {node.id}
        elif isinstance(node, ast.Attribute):
            names = {node.attr}
        elif isinstance(node, ast.arg | ast.keyword) and node.arg is not None:
            names = {node.arg}
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            names = set(re.findall(r"\w+", node.value))
        found += [f"{getattr(node, 'lineno', '?')} {name}" for name in sorted(names & words)]
    return found


# the revisions that made the event log's column per block-meta field (0006) and folded them into one value (0009)
META_COLUMN_REVISIONS = ("0006_event_log.py", "0009_event_meta.py")


def test_a_new_block_meta_field_changes_nothing_in_the_index_or_alembic() -> None:
    """The event log keeps the block meta as one value, the header's own form (app/index/eventlog.py): a new field
    is its grammar (contract/wire.py), its JSON and its vLLM encoding (app/events/), and nothing under app/index or
    alembic/ names it, or any field of the meta (issue 44). Before 0009 a field was a column, a row's attribute and
    a writer's argument there."""
    fields = _block_meta_fields()
    assert fields >= {"parent", "tokens"}
    named = [
        f"{mod}:{where}" for mod, tree in TREES.items() if _under(mod, "app.index") for where in _names_of(tree, fields)
    ]
    for path in sorted((REPO / "alembic").rglob("*.py")):
        if path.name not in META_COLUMN_REVISIONS:
            named += [f"{path.relative_to(REPO)}:{w}" for w in _names_of(ast.parse(path.read_text()), fields)]
    assert named == []
