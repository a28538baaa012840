"""Print a package's longest files and functions and its internal import graph.

    python scripts/code_shape.py django_syncguard

Runtime imports only: imports under ``if TYPE_CHECKING:`` are listed apart, since
they never load the module they name. Used to show the package's layering (no core
module imports ``backends/``; no backend imports ``checks``).
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


def imported(node: ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if not node.level:
        return [node.module or ""]
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    target = ".".join(base + ([node.module] if node.module else []))
    return [target] if node.module else [f"{target}.{alias.name}" for alias in node.names]


def type_checking_nodes(tree: ast.Module) -> set[int]:
    hidden = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden |= {id(child) for stmt in node.body for child in ast.walk(stmt)}
    return hidden


def main(package: Path) -> None:
    files, functions = [], []
    graph: dict[str, set[str]] = defaultdict(set)
    typing_only: dict[str, set[str]] = defaultdict(set)
    for path in sorted(package.rglob("*.py")):
        if "migrations" in path.parts:
            continue
        text = path.read_text()
        module = module_name(path, package)
        files.append((len(text.splitlines()), module))
        tree = ast.parse(text)
        hidden = type_checking_nodes(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                functions.append((length, f"{module}:{node.name}"))
            elif isinstance(node, ast.ImportFrom):
                targets = imported(node, module, path.name == "__init__.py")
                ours = [
                    t.removeprefix(package.name + ".")
                    for t in targets
                    if t.startswith(package.name)
                ]
                if ours:
                    (typing_only if id(node) in hidden else graph)[module].update(ours)
    print("## longest files")
    for lines, name in sorted(files, reverse=True)[:10]:
        print(f"{lines:5d}  {name}")
    print("## longest functions")
    for lines, name in sorted(functions, reverse=True)[:10]:
        print(f"{lines:5d}  {name}")
    print("## imports at run time")
    for name in sorted(graph):
        print(f"{name} -> {', '.join(sorted(graph[name]))}")
    print("## imports for type checking only")
    for name in sorted(typing_only):
        print(f"{name} -> {', '.join(sorted(typing_only[name]))}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "django_syncguard").resolve())
