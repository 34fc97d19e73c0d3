"""The readability gates: the line budget and README table (checked by the script that writes the
table), a docstring atop every module, and a clean `ruff check` of the whole repository."""
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def loc_check() -> str:
    result = subprocess.run([sys.executable, "tools/loc.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True)
    return result.stdout


def test_readme_tables_and_sizes():
    """tools/loc.py --check: the README's module tables are current, and no module or class is
    over its size (MAX_MODULE_LINES, MAX_CLASS_LINES)."""
    problems = [line for line in loc_check().splitlines() if "budget" not in line]
    assert problems == [] or problems[0].startswith("ok"), problems


def test_line_budgets():
    """The core, core + extensions and the server fit tools/loc.py's CORE_BUDGET, TOTAL_BUDGET
    and SERVER_BUDGET."""
    assert "budget" not in loc_check()


def test_every_module_opens_with_a_docstring():
    for path in (ROOT / "nanoserve").rglob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        name = path.relative_to(ROOT).as_posix()
        assert doc and len(doc.splitlines()) >= 2, f"{name} needs a module docstring"


def test_counting_skips_comments_and_docstrings():
    sys.path.insert(0, str(ROOT / "tools"))
    from loc import count_code_lines
    source = ('"""doc\nstring"""\n# comment\nx = 1  # trailing\n\n'
              'def f():\n    """doc"""\n    return (1,\n            2)\n')
    assert count_code_lines(source) == 4  # x = 1, def f, and the two lines of the return


def test_ruff_clean():
    """Lines of at most 100 columns, sorted imports, no unused names (config in pyproject.toml)."""
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def import_graph() -> dict[str, set[str]]:
    """nanoserve's modules and the nanoserve modules each imports, anywhere in its code (inside
    functions too): `from nanoserve import layers` counts as importing nanoserve.layers."""
    package = ROOT / "nanoserve"
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in package.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package that holds this module
                    parts = name.split(".")[:len(name.split(".")) - node.level + is_package]
                    base = ".".join(parts + ([base] if base else []))
                edges |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                          for a in node.names}
        graph[name] = {e for e in edges if e in modules and e != name}
    return graph


def test_imports_flow_one_way():
    """No circle among nanoserve's modules, imports inside functions included; the core never
    imports an extension or the server (it loads an extension by name, config.extension)."""
    graph = import_graph()
    done, path = set(), []

    def visit(module: str) -> None:
        assert module not in path, "import circle: " + " -> ".join(path + [module])
        if module not in done:
            path.append(module)
            for dependency in sorted(graph[module]):
                visit(dependency)
            path.pop()
            done.add(module)
    for module in graph:
        visit(module)
    core = [m for m in graph if not m.startswith(("nanoserve.extensions", "nanoserve.server"))]
    for module in core:
        reached = {m for m in graph[module] if m.startswith(("nanoserve.extensions",
                                                               "nanoserve.server"))}
        assert not reached, f"the core module {module} imports {reached}"
