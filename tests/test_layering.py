"""The import rules of the repository, read from the source.

- The folders are layers (`LAYERS`), each importing at module level only the layers below it:
  `kvstore/shared/` (what the daemon and its clients share) and `kvstore/proto/`, then
  `config/`, `tiers/`, `store/`, `server/` (kvstored) and `ctl/` (kvctl); the client
  (`kvstore_client/`) and the kernels (`kvstore_kernels/`) sit on the shared layer alone.
- The client and the kernels import from the `kvstore` package only the shared modules
  (`SHARED`: everything in `kvstore/shared/` and `kvstore/proto/`), at any level, and the
  kernels never import the client.
- The shared modules import only each other; the daemon never imports the client or the kernels.
- No two modules of the repository import each other, directly or through others, at module
  level: imports under `if TYPE_CHECKING:` count (a type is a dependency too); imports inside
  a function do not. Relative imports count as the modules they name.
- `import kvstore_client` loads none of the daemon's modules (checked in a fresh interpreter).
- No module over MAX_MODULE_LINES lines, no function over MAX_FUNCTION_LINES.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.harness import python_env

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {
    "kvstore": ROOT / "kvstore",
    "kvstore_client": ROOT / "kvstore_client",
    "kvstore_kernels": ROOT / "kvstore_kernels",
}
# Each folder's layer: a module imports (at module level) only from its own layer and those below.
LAYERS = {
    "kvstore": 0,  # the package itself: __version__
    "kvstore.shared": 0,
    "kvstore.proto": 0,
    "kvstore.config": 1,
    "kvstore.tiers": 2,
    "kvstore.store": 3,
    "kvstore.server": 4,
    "kvstore.ctl": 5,
    "kvstore_kernels": 1,
    "kvstore_client": 2,
}


def layer_of(module: str) -> tuple[str, int]:
    """The folder `module` lies in and its layer."""
    for depth in (2, 1):
        folder = ".".join(module.split(".")[:depth])
        if folder in LAYERS and (depth == 1 or folder != module or folder in ("kvstore.shared",)):
            return folder, LAYERS[folder]
    raise KeyError(module)


def modules() -> dict[str, Path]:
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


MODULES = modules()
SHARED = {"kvstore", *(name for name in MODULES if name.startswith(("kvstore.shared", "kvstore.proto")))}


def package_of(path: Path) -> str:
    """The dotted package a module file lies in (its own name for a package's __init__)."""
    for package, folder in PACKAGES.items():
        if path.is_relative_to(folder):
            return ".".join((package, *path.parent.relative_to(folder).parts))
    raise ValueError(path)


def imports(path: Path, *, top_level_only: bool) -> set[str]:
    """The repository's modules `path` imports (at module level only, with `top_level_only`),
    relative imports (`from . import x`, `from .x import y`) resolved to absolute names."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if top_level_only and isinstance(node, ast.If | ast.Try):  # `if TYPE_CHECKING:` too
            nodes.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package_of(path).split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, module] if module else base)
            named = [f"{module}.{alias.name}" for alias in node.names]
            names = named if node.level and not node.module else [module, *named]  # `from . import x`: x
        else:
            continue
        found.update(name for name in names if name in MODULES)
    return found


def test_the_client_and_the_kernels_import_only_the_shared_modules() -> None:
    wrong = {
        f"{name} imports {target}"
        for name, path in MODULES.items()
        if not name.startswith("kvstore.") and name != "kvstore"
        for target in imports(path, top_level_only=False)
        if target.split(".")[0] == "kvstore" and target not in SHARED
    }
    assert not wrong, sorted(wrong)
    kernels_to_client = {
        f"{name} imports {target}"
        for name, path in MODULES.items()
        if name.startswith("kvstore_kernels")
        for target in imports(path, top_level_only=False)
        if target.startswith("kvstore_client")
    }
    assert not kernels_to_client, sorted(kernels_to_client)


def test_the_shared_modules_import_only_each_other_and_the_daemon_no_client() -> None:
    wrong = {
        f"{name} imports {target}"
        for name, path in MODULES.items()
        if name.split(".")[0] == "kvstore"
        for target in imports(path, top_level_only=False)
        if (name in SHARED and target not in SHARED) or target.split(".")[0] != "kvstore"
    }
    assert not wrong, sorted(wrong)


def test_no_import_cycle() -> None:
    graph = {name: imports(path, top_level_only=True) - {name} for name, path in MODULES.items()}
    cycles = set()
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            node, trail = stack.pop()
            for target in graph[node]:
                if target == start:
                    cycles.add(" -> ".join(sorted(trail)))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, [*trail, target]))
    assert not cycles, sorted(cycles)


def test_importing_the_client_loads_none_of_the_daemon() -> None:
    probe = "import sys, kvstore_client; print(' '.join(sorted(sys.modules)))"
    loaded = set(
        subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=python_env()
        ).stdout.split()
    )
    daemon = {name for name in MODULES if name.split(".")[0] == "kvstore" and name not in SHARED}
    assert not loaded & daemon, sorted(loaded & daemon)
    assert "yaml" not in loaded and "kvstore.shared.paths" not in loaded


MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A `@triton.jit` function: its body is the kernel, one unit the limits do not cut."""
    return any(ast.unparse(decorator).startswith(("triton.jit", "jit")) for decorator in node.decorator_list)


def test_no_module_or_function_is_over_the_size_limits() -> None:
    """Modules of at most MAX_MODULE_LINES lines (the generated protobuf modules aside) and
    functions of at most MAX_FUNCTION_LINES, def line to last line (the Triton kernels' bodies
    aside): a longer one is a sequence of named steps, or two ideas, waiting to be split."""
    over = []
    for name, path in MODULES.items():
        if ".proto" in name:
            continue
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES:
            over.append(f"{path.relative_to(ROOT)}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not is_triton_kernel(node):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    over.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}(): {lines} lines")
    assert not over, over


DAEMON_PACKAGES = (
    "yaml",
    "redis",
    "prometheus_client",
    "rich",
    "lz4",
    "uvloop",
    "grpc_health",
    "grpc_reflection",
)


def test_a_worker_needs_none_of_the_daemons_packages() -> None:
    """`kvstore[client]` leaves the `daemon` extra out: the client and the kernels import with
    every daemon package missing, and pyproject's own dependencies name none of them."""
    import tomllib

    probe = (
        f"import sys\nfor name in {DAEMON_PACKAGES!r}:\n    sys.modules[name] = None\n"
        "import kvstore_client, kvstore_kernels\n"
        "from kvstore_client import KVSpec, KVStoreClient\n"
        "import kvstore_client.hf, kvstore_client.routes, kvstore_client.bounce\n"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, env=python_env())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"]).lower().replace("-", "_")
    daemon = " ".join(project["optional-dependencies"]["daemon"]).lower().replace("-", "_")
    for package in (
        "pyyaml",
        "redis",
        "prometheus_client",
        "rich",
        "lz4",
        "uvloop",
        "grpcio_health",
        "grpcio_reflection",
    ):
        assert package not in base and package in daemon, package


def test_the_daemon_without_its_packages_says_which_extra_to_install() -> None:
    probe = "import sys\nsys.modules['yaml'] = None\nimport kvstore.server.daemon\n"
    ran = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=python_env())
    assert ran.returncode != 0
    assert ran.stderr.strip().splitlines()[-1] == (
        "ImportError: PyYAML is missing: kvstored and kvctl need the daemon's packages "
        "(pip install 'kvstore[daemon]')"
    )


def test_each_folder_imports_only_its_layer_and_those_below() -> None:
    """The client and the kernels stand beside the daemon's folders, not on them: they are
    checked against the shared layer alone (the test above)."""
    wrong = set()
    for name, path in MODULES.items():
        if not name.startswith("kvstore."):
            continue
        folder, layer = layer_of(name)
        for target in imports(path, top_level_only=True):
            if not target.startswith("kvstore."):
                continue
            other, other_layer = layer_of(target)
            if other_layer > layer:
                wrong.add(f"{name} ({folder}) imports {target} ({other})")
    assert not wrong, sorted(wrong)
    flat = sorted(path.name for path in (ROOT / "kvstore").glob("*.py") if path.name != "__init__.py")
    assert not flat, f"modules outside the layer folders: {flat}"


def test_relative_imports_stay_within_their_package() -> None:
    """A relative import (the kernels use them) is read as the module it names, for every rule
    above; it never reaches out of its own top-level package."""
    outside = {
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for name, path in MODULES.items()
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.level and node.level > len(package_of(path).split("."))
    }
    assert not outside, sorted(outside)
    assert "kvstore_kernels.triton_copy" in imports(
        PACKAGES["kvstore_kernels"] / "__init__.py", top_level_only=False
    )
