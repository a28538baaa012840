"""Count the lines and the code lines of Python files, here or at a git revision.

    python scripts/code_lines.py FILE... [REV:FILE...]

Code lines are the lines that hold a token of code: blank lines, comments and
docstrings (of modules, classes and functions) do not count. ``REV:FILE`` reads the
file as it was at a git revision, so a refactor can be measured before and after::

    python scripts/code_lines.py 90a6b4f:django_syncguard/backends/redis_wakeups.py \\
        django_syncguard/backends/redis/wakeups.py
"""

from __future__ import annotations

import ast
import io
import subprocess
import sys
import tokenize

_NOT_CODE = {
    tokenize.COMMENT,
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENDMARKER,
}


def docstring_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        kinds = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
        if isinstance(node, kinds) and node.body:
            first = node.body[0]
            value = getattr(first, "value", None)
            is_doc = isinstance(value, ast.Constant) and isinstance(value.value, str)
            if isinstance(first, ast.Expr) and is_doc:
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def code_lines(source: str) -> int:
    docs = docstring_lines(ast.parse(source))
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in _NOT_CODE:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docs)
    return len(lines)


def read(spec: str) -> str:
    if ":" in spec:
        return subprocess.run(
            ["git", "show", spec], capture_output=True, text=True, check=True
        ).stdout
    with open(spec, encoding="utf-8") as file:
        return file.read()


def main(specs: list[str]) -> None:
    total_lines = total_code = 0
    for spec in specs:
        source = read(spec)
        lines, code = len(source.splitlines()), code_lines(source)
        total_lines, total_code = total_lines + lines, total_code + code
        print(f"{lines:6d} {code:6d}  {spec}")
    print(f"{total_lines:6d} {total_code:6d}  total (lines, code lines)")


if __name__ == "__main__":
    main(sys.argv[1:])
