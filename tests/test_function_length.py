"""Every function the wheel ships is at most 50 lines, Triton kernel bodies excepted.

Checked on the source of chatcore/, its links to kernels/ and bench/ followed: a function's
length is its `def` line to its last line (`end_lineno - lineno + 1`, decorators excluded).
A Triton kernel body (decorated with `triton.jit`, or handed to `LazyKernel`, which jits it at
its first launch: kernels/_triton.py) is one kernel and is not split.
"""

from __future__ import annotations

import ast

from tests.shipped_sources import relative, shipped_files

LIMIT = 50


def _kernel_bodies(tree: ast.AST) -> set[str]:
    """Names of the functions `tree` jits: `@triton.jit` (or `@jit`), or passed to `LazyKernel(...)`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(
                ast.unparse(d.func if isinstance(d, ast.Call) else d) in ("triton.jit", "jit")
                for d in node.decorator_list):
            names.add(node.name)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "LazyKernel" and node.args \
                and isinstance(node.args[0], ast.Name):
            names.add(node.args[0].id)
    return names


def too_long(source: str, limit: int = LIMIT) -> list[tuple[str, int]]:
    """(function, lines) of each function in `source` longer than `limit`, kernel bodies excepted."""
    tree = ast.parse(source)
    kernels = _kernel_bodies(tree)
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in kernels
            and node.end_lineno - node.lineno + 1 > limit]


def test_every_shipped_function_is_at_most_50_lines() -> None:
    paths = shipped_files()
    assert any(relative(p) == "chatcore/kernels/paged_decode.py" for p in paths)  # the links are followed
    assert any(relative(p) == "chatcore/bench/throughput.py" for p in paths)
    long = {f"{relative(p)}:{name}": lines for p in paths for name, lines in too_long(p.read_text(encoding="utf-8"))}
    assert long == {}


def test_the_check_counts_lines_and_spares_kernel_bodies() -> None:
    body = "".join(f"    x{i} = {i}\n" for i in range(49))
    assert too_long(f"@decorated\ndef f():\n{body}") == []  # 50 lines, the decorator not counted
    assert too_long(f"async def g():\n{body}    return 1\n") == [("g", 51)]
    assert too_long(f"class C:\n    def m(self):\n{body.replace('    ', '        ')}        pass\n") == [("m", 51)]
    assert too_long(f"@triton.jit\ndef k():\n{body}    pass\n") == []
    assert too_long(f"def k():\n{body}    pass\n\n_k = LazyKernel(k)\n") == []
