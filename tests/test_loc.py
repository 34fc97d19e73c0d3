"""The readability gates: the line budget and README table (checked by the script that writes the
table), a docstring atop every module, and a clean `ruff check` of the whole repository."""
import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

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
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (the test extra installs it)")
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


def core_sources() -> dict[str, ast.Module]:
    """The core's modules (nanoserve/ but extensions/ and server/), parsed, by path."""
    package = ROOT / "nanoserve"
    return {str(p.relative_to(package)): ast.parse(p.read_text()) for p in package.rglob("*.py")
            if p.relative_to(package).parts[0] not in ("extensions", "server")}


def functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef]]:
    """Every function of a module with its qualified name (Class.method)."""
    found = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            found.append((node.name, node))
        elif isinstance(node, ast.ClassDef):
            found += [(f"{node.name}.{f.name}", f) for f in node.body
                      if isinstance(f, ast.FunctionDef)]
    return found


def assigned_attributes(node: ast.AST) -> list[ast.Attribute]:
    """The attributes an assignment statement writes (tuple targets unpacked)."""
    targets = (node.targets if isinstance(node, ast.Assign) else
               [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
    found = []
    while targets:
        target = targets.pop()
        if isinstance(target, (ast.Tuple, ast.List)):
            targets += target.elts
        elif isinstance(target, ast.Attribute):
            found.append(target)
    return found


def rebindings(trees: dict[str, ast.Module]) -> list[str]:
    """Assignments to another object's method (`runner.forward = ...`), to a method of the
    object's own class, or to another module's global (`layers.OPS = ...`), and setattr calls. An
    object made in the same function (a parameter given its loader) is being built: not counted."""
    methods = {node.name: {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
               for tree in trees.values() for node in tree.body if isinstance(node, ast.ClassDef)}
    every_method = set().union(*methods.values())
    problems = []
    for path, tree in trees.items():
        modules = {alias.asname or alias.name.split(".")[0] for node in ast.walk(tree)
                   if isinstance(node, (ast.Import, ast.ImportFrom)) for alias in node.names}
        for name, function in functions(tree):
            own = methods.get(name.partition(".")[0], set()) if "." in name else set()
            local = {t.id for node in ast.walk(function) if isinstance(node, ast.Assign)
                     for t in node.targets if isinstance(t, ast.Name)}  # objects made here
            for node in ast.walk(function):
                if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "setattr":
                    problems.append(f"{path} {name}: setattr")
                for target in assigned_attributes(node):
                    owner = ast.unparse(target.value)
                    rebound = own if owner == "self" else every_method  # the methods it may be
                    if owner in modules:
                        problems.append(f"{path} {name}: assigns {owner}'s global {target.attr}")
                    elif target.attr in rebound and owner not in local:
                        problems.append(f"{path} {name}: assigns the method {owner}."
                                        f"{target.attr}")
    return problems


def test_the_core_rebinds_no_method_or_global_of_another():
    """Extensions attach at the three declared points only (an Extension in the engine's list, a
    StepLoop from LLMEngine._make_loop, backends from model_runner.choose_backends): nothing in
    the core rebinds a method or another module's global. The check itself finds the styles it
    replaced."""
    assert rebindings(core_sources()) == []
    replaced = ast.parse("from nanoserve import layers\n"
                         "class Runner:\n    def forward(self): pass\n"
                         "    def f(self): self.forward = None\n"
                         "def attach(runner, graphs):\n    runner.forward = graphs.forward\n"
                         "    layers.OPS = None\n    setattr(runner, 'x', 1)\n")
    assert len(rebindings({"old.py": replaced})) == 4


# where the core names an extension: where it switches one on (the Extensions, the step loops, the
# backends and the graph runner), and the package's lazy export of GuidedDecodingParams
SWITCH_ON = {("llm_engine.py", "LLMEngine.switch_on"), ("llm_engine.py", "LLMEngine._make_loop"),
             ("model_runner.py", "choose_backends"), ("model_runner.py", "ModelRunner.__init__"),
             ("__init__.py", "__getattr__")}


def lookups(trees: dict[str, ast.Module]) -> list[str]:
    """Calls of config.extension outside SWITCH_ON, a mapping of extensions indexed or .get() by a
    name, and getattr of a named attribute (but a Hugging Face config's optional fields)."""
    problems = []
    for path, tree in trees.items():
        for name, function in functions(tree):
            for node in ast.walk(function):
                if not isinstance(node, ast.Call | ast.Subscript):
                    continue
                text, func = ast.unparse(node), ast.unparse(getattr(node, "func", node))
                if func == "extension" and (path, name) not in SWITCH_ON:
                    problems.append(f"{path} {name}: {text}")
                key = (node.slice if isinstance(node, ast.Subscript) else
                       node.args[0] if node.args and func.endswith(".get") else None)
                if isinstance(key, ast.Constant) and "extension" in text.split("[")[0]:
                    problems.append(f"{path} {name}: {text}")
                if (func == "getattr" and isinstance(node.args[1], ast.Constant)
                        and ast.unparse(node.args[0]) not in ("cfg", "self.hf_config")):
                    problems.append(f"{path} {name}: {text}")
    return problems


def test_the_core_looks_up_no_extension_by_name():
    """An extension is named only where the core switches it on (SWITCH_ON): nowhere else does the
    core import one by name, find one by its name, or read what one publishes through getattr.
    The check itself finds the lookups it replaced."""
    assert lookups(core_sources()) == []
    replaced = ast.parse("class LLMEngine:\n    def f(self, seq):\n"
                         "        self.extensions['stop_strings'].stream(seq)\n"
                         "        self.extensions.get('speculative')\n"
                         "        getattr(self.loop, 'progress', '')\n"
                         "        extension('trace').attach(self)\n")
    assert len(lookups({"llm_engine.py": replaced})) == 4
