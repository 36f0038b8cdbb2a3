"""One-way layers: the runtime (everything that serves a request, the `folio` package) never imports the
tools (everything that measures or prepares, the `folio_tools` package in tools/), nothing imports the
command line, and no two packages import each other.

A package is `folio/<name>/` or a top-level `folio/<name>.py`, and the same under tools/folio_tools/.
Every import counts, function-local ones too; only `if TYPE_CHECKING:` blocks are left out (annotations,
never executed). A function-local import of a folio module is itself a violation: it is how a cycle hides
from a check like this one.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLIO = REPO / "folio"
FOLIO_TOOLS = REPO / "tools" / "folio_tools"

# The command line sits on top: it parses flags and dispatches to the runtime (run, chat, serve, ...).
# The tools add their own commands (bench, eval, quantize, kv-calc) through an entry point, which
# folio.cli loads by name, never by import. Nothing imports the command line.
CLI = frozenset({"folio.cli"})
# Tools measure or prepare; they may import the runtime and each other (without cycles), never the CLI.
TOOLS = frozenset(
    {
        "folio_tools",
        "folio_tools.cli",  # registers the tools' subcommands on the runtime's parser
        "folio_tools.bench",
        "folio_tools.eval",
        "folio_tools.quantize",
        "folio_tools.kv_calc",
        "folio_tools.results",
    }
)
# The runtime serves requests; it never imports a tool or the CLI.
RUNTIME = frozenset(
    {
        "folio",  # folio/__init__.py: LLM, SamplingParams
        "folio.config",
        "folio.cpp_extension",
        "folio.distributed",  # the tensor-parallel group and the rendezvous (imports no other folio package)
        "folio.engine",
        "folio.engine_args",
        "folio.memory",  # the heap's large blocks reused; weights in 2 MiB-page arenas
        "folio.kv_cache",
        "folio.layers",
        "folio.loaders",
        "folio.lora",  # LoRA adapters: read from PEFT folders, placed in the layers' slots each step
        "folio.models",
        "folio.ops",  # the one kernel loader
        "folio.outputs",
        "folio.paths",
        "folio.platform",
        "folio.reasoning",  # <think> text split from the answer
        "folio.weight_formats",  # runtime weight formats (int8, int4, nf4, GGUF blocks); offline: folio_tools.quantize
        "folio.sample",
        "folio.sampling_params",
        "folio.scale_out",  # replicas on Ray Serve (the optional extra folio[ray])
        "folio.server",
        "folio.spec_decode",  # speculative decoding's proposers
        "folio.step",  # the values that cross the scheduler/runner boundary
        "folio.structured",
        "folio.tool_calls",  # tool-call formats: parsing, streaming, prompts, forced-call schemas
        "folio.worker",
    }
)


# The runtime's packages in ranks: a module may import its own rank or a lower one, never a higher
# (cycles within a rank are caught by the cycle checks). A value module may rank below its package:
# `structured.params` is a plain value that sampling parameters carry, unlike the grammar compiler.
RANKS = {
    # values and configuration
    "folio.config": 0,
    "folio.engine_args": 0,
    "folio.outputs": 0,
    "folio.sampling_params": 0,
    "folio.structured.params": 0,
    "folio.paths": 0,
    "folio.memory": 0,
    "folio.platform": 0,
    # kernels and collectives
    "folio.cpp_extension": 1,
    "folio.ops": 1,
    "folio.distributed": 1,
    # the pieces a model is made of, and the values between scheduler and runner
    "folio.kv_cache": 2,
    "folio.sample": 2,
    "folio.layers": 2,
    "folio.weight_formats": 2,
    "folio.step": 2,
    "folio.models": 3,
    # what loads a model, and what works beside it
    "folio.loaders": 4,
    "folio.lora": 4,
    "folio.structured": 4,
    "folio.spec_decode": 4,
    "folio.reasoning": 4,
    "folio.tool_calls": 4,
    "folio.worker": 5,
    "folio.engine": 6,
    "folio.server": 7,
    "folio": 7,  # folio/__init__.py: LLM and SamplingParams for users
    "folio.scale_out": 8,
}


def rank_of(module: str) -> int | None:
    """The rank of the longest RANKS entry that is `module` or a package holding it."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        rank = RANKS.get(".".join(parts[:end]))
        if rank is not None:
            return rank
    return None


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. folio_tools.bench.serve.command
    target: str  # the imported module, e.g. folio.loaders.catalog
    line: int
    local: bool  # inside a function body

    @property
    def edge(self) -> tuple[str, str]:
        return package_of(self.module), package_of(self.target)

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.target}" + (" inside a function" if self.local else "")


def package_of(module: str) -> str:
    """folio_tools.bench.serve.command -> folio_tools.bench; folio.cli -> folio.cli; folio -> folio."""
    return ".".join(module.split(".")[:2])


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    return {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for child in ast.walk(node)
    }


def _function_nodes(tree: ast.AST) -> set[int]:
    return {
        id(child)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        for child in ast.walk(node)
    }


def imports_of(path: Path, root: Path, roots: tuple[Path, ...] = ()) -> Iterator[Import]:
    """Every import of a module of `root` (or of `roots`) in `path`, with relative imports resolved."""
    roots = roots or (root,)
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped, in_functions = _type_checking_nodes(tree), _function_nodes(tree)
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from folio import commands` imports the module folio.commands, not only the package folio
            submodules = [f"{base}.{alias.name}" for alias in node.names if _is_module(f"{base}.{alias.name}", roots)]
            targets = submodules or [base]
        else:
            continue
        for target in targets:
            if any(target == r.name or target.startswith(r.name + ".") for r in roots):
                yield Import(module, target, node.lineno, id(node) in in_functions)


def _is_module(name: str, roots: tuple[Path, ...]) -> bool:
    head, *rest = name.split(".")
    relative = Path(*rest)
    return any(
        (root / relative).with_suffix(".py").is_file() or (root / relative / "__init__.py").is_file()
        for root in roots
        if root.name == head
    )


def all_imports(*roots: Path) -> list[Import]:
    return [imp for root in roots for path in sorted(root.rglob("*.py")) for imp in imports_of(path, root, roots)]


def package_edges(imports: list[Import], exempt: frozenset[tuple[str, str]] = frozenset()) -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for imp in imports:
        source, target = imp.edge
        if source != target and imp.edge not in exempt:
            edges.setdefault(source, set()).add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per back edge of a depth-first walk; empty if and only if the graph is acyclic."""
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1 on the stack, 2 done

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for successor in sorted(edges.get(node, ())):
            if state.get(successor) == 1:
                found.append(stack[stack.index(successor) :] + [successor])
            elif successor not in state:
                visit(successor, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
    return found


def _report(violations: list[object]) -> str:
    return "\n".join(f"  {v}" for v in violations)


IMPORTS = all_imports(FOLIO, FOLIO_TOOLS)


def test_every_package_has_a_layer() -> None:
    packages = {
        package_of(name)
        for root in (FOLIO, FOLIO_TOOLS)
        for name in [module_name(p, root) for p in root.glob("*.py")]
        + [f"{root.name}.{p.name}" for p in root.iterdir() if (p / "__init__.py").is_file()]
    }
    assert not packages - (CLI | TOOLS | RUNTIME), "give each new package a layer in this test"
    assert not (CLI & TOOLS) and not (CLI & RUNTIME) and not (TOOLS & RUNTIME)


def test_no_cycles_between_packages() -> None:
    found = cycles(package_edges(IMPORTS))
    assert not found, "import cycles between packages:\n" + _report([" -> ".join(c) for c in found])


def test_no_cycles_between_modules() -> None:
    """Within a package too: a report writer never imports its runner (the values they share live in a
    module of their own)."""
    edges: dict[str, set[str]] = {}
    for imp in IMPORTS:
        if imp.module != imp.target:
            edges.setdefault(imp.module, set()).add(imp.target)
    found = cycles(edges)
    assert not found, "import cycles between modules:\n" + _report([" -> ".join(c) for c in found])


def test_the_runtime_never_imports_a_tool_or_the_cli() -> None:
    bad = [imp for imp in IMPORTS if imp.edge[0] in RUNTIME and imp.edge[1] in TOOLS | CLI]
    assert not bad, "the runtime imports a tool or the command line:\n" + _report(bad)


def test_the_runtime_package_never_imports_the_tools_package() -> None:
    """The command line included: the runtime wheel installs and serves without folio_tools."""
    bad = [imp for imp in IMPORTS if imp.edge[0] in RUNTIME | CLI and imp.target.split(".")[0] == FOLIO_TOOLS.name]
    assert not bad, "the folio package imports folio_tools (load it through the entry point):\n" + _report(bad)


def test_runtime_packages_import_only_their_rank_or_lower() -> None:
    assert set(map(package_of, RANKS)) == RUNTIME, "give each runtime package a rank in RANKS"
    bad = [
        f"{imp} (rank {rank_of(imp.module)} -> {rank_of(imp.target)})"
        for imp in IMPORTS
        if imp.edge[0] in RUNTIME and imp.edge[1] in RUNTIME and rank_of(imp.target) > rank_of(imp.module)
    ]
    assert not bad, "a lower layer imports a higher one:\n" + _report(bad)


# The scheduler never touches tensors: the modules that decide a step import no torch, but for type
# annotations (the grammar bitmask, a tensor, is built apart, by engine/structured_output.py).
SCHEDULING = ("engine/scheduler", "engine/beam_scheduling", "engine/batching", "engine/stats", "engine/request",
              "engine/runner_view", "spec_decode/scheduling")  # fmt: skip


def test_the_scheduler_imports_no_torch() -> None:
    bad = []
    for name in SCHEDULING:
        tree = ast.parse((FOLIO / f"{name}.py").read_text(encoding="utf-8"))
        annotations_only = _type_checking_nodes(tree)
        for node in ast.walk(tree):
            if id(node) in annotations_only:
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{name}.py:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "torch"]
    assert not bad, "the scheduler imports torch:\n" + _report(bad)


def test_the_runner_never_imports_the_block_pool() -> None:
    """The free list is the scheduler's: the runner is told which blocks to use, and never picks one."""
    owners = ("folio.kv_cache.block_pool", "folio.kv_cache.manager")
    bad = [imp for imp in IMPORTS if imp.module.startswith("folio.worker.") and imp.target in owners]
    assert not bad, "the runner imports the block pool or its manager:\n" + _report(bad)


def test_tools_never_import_the_cli() -> None:
    bad = [imp for imp in IMPORTS if imp.edge[0] in TOOLS and imp.edge[1] in CLI]
    assert not bad, "a tool imports the command line (register a subparser instead):\n" + _report(bad)


# Function-local imports that open an optional extra where it is used, so the command line starts
# without the extra installed and without its import cost (Ray Serve: ~1 s). None of them hides a
# cycle: the cycle checks above count them.
OPTIONAL_EXTRAS = frozenset({("folio.cli.commands", "folio.scale_out.deploy")})


def test_no_function_local_imports_of_folio_modules() -> None:
    bad = [imp for imp in IMPORTS if imp.local and (imp.module, imp.target) not in OPTIONAL_EXTRAS]
    assert not bad, "import folio modules at the top of the module:\n" + _report(bad)


def test_the_walker_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The checks above are only as good as the walk: relative, function-local and `from pkg import
    module` imports are found, TYPE_CHECKING blocks are not, and a cycle through them is reported."""
    root = tmp_path / "pkg"
    (root / "a").mkdir(parents=True)
    (root / "b").mkdir()
    (root / "__init__.py").write_text("")
    (root / "a" / "__init__.py").write_text("")
    (root / "b" / "__init__.py").write_text("")
    (root / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a.x\n")
    (root / "a" / "x.py").write_text("from ..b import y\n")
    (root / "b" / "y.py").write_text("def f():\n    from pkg import c\n    import pkg.a.x\n")
    found = all_imports(root)
    assert {(i.module, i.target, i.local) for i in found} == {
        ("pkg.a.x", "pkg.b.y", False),
        ("pkg.b.y", "pkg.c", True),
        ("pkg.b.y", "pkg.a.x", True),
    }
    assert cycles(package_edges(found)) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert cycles(package_edges(found, exempt=frozenset({("pkg.b", "pkg.a")}))) == []
