"""Line counts of nanoserve/: the README's module tables and the line budgets, from one count.

A code line holds at least one token that is not a comment, a docstring or layout, so explanations
are free and nobody deletes one to fit the budget. Two budgets, both limits: the core (nanoserve/
without extensions/ and server/) and the core with its extensions. Sub-packages count too (rows
such as `kernels/decode.py`); the server (nanoserve/server/), an entry point on top, gets one row
and stays outside both. --check also holds every module to MAX_MODULE_LINES lines and every class
to MAX_CLASS_LINES (all lines, comments included).

    python tools/loc.py                 # print the tables and the totals
    python tools/loc.py --write-readme  # replace the tables between the README's markers
    python tools/loc.py --check         # exit 1 if over a budget or the README tables are stale
"""
import argparse
import ast
import io
import sys
import tokenize
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanoserve"
README = ROOT / "README.md"
CORE_BUDGET = 1500  # code lines of the core: small enough to read in an afternoon
TOTAL_BUDGET = 2161  # code lines of the core and its extensions, but for those of OWN_BUDGETS
# extensions written after the core's split, each to a budget of its own, held to it and left
# out of TOTAL_BUDGET
OWN_BUDGETS = {"extensions/speculative.py": 250, "extensions/guided.py": 150,
               "extensions/prefill_graphs.py": 60, "extensions/batch_invariant.py": 150,
               "extensions/samples.py": 150}
SERVER_BUDGET = 1000  # code lines of the server (nanoserve/server/), counted apart from both
MAX_MODULE_LINES, MAX_CLASS_LINES = 450, 250  # all lines of one module, of one class
EXTENSIONS = "extensions"  # nanoserve/extensions/: one module per idea, on top of the core
EXCLUDE = ["server"]  # the server (nanoserve/server/), an entrypoint on top, is counted apart
BEGIN, END = "<!-- loc-table:begin -->", "<!-- loc-table:end -->"
LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
          tokenize.ENDMARKER, tokenize.ENCODING}
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


class Row(NamedTuple):
    name: str  # path relative to nanoserve/, e.g. "kernels/decode.py"
    code: int  # code lines
    total: int  # all lines
    summary: str  # first line of the module docstring


def docstring_lines(tree: ast.Module) -> set[int]:
    """Line numbers covered by the docstrings of the module, its classes and its functions."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, DOCUMENTED) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def count_code_lines(source: str) -> int:
    docs = docstring_lines(ast.parse(source))
    code: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in LAYOUT:
            code.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docs)
    return len(code)


def module_rows() -> list[Row]:
    """One Row for every module of the package, sub-packages included, sorted by path."""
    rows = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        summary = (ast.get_docstring(ast.parse(source)) or "").partition("\n")[0]
        name = path.relative_to(PACKAGE).as_posix()
        rows.append(Row(name, count_code_lines(source), len(source.splitlines()), summary))
    return rows


def split_rows(exclude: list[str]) -> tuple[list[Row], list[Row]]:
    """(rows inside the budget, excluded rows); NAME matches "server", "server.py", a path, or a
    sub-package's folder ("server" holds "server/app.py")."""
    def excluded(row: Row) -> bool:
        name = row.name.removesuffix(".py")
        return row.name in exclude or any(name == x or name.startswith(f"{x}/") for x in exclude)
    rows = module_rows()
    return [r for r in rows if not excluded(r)], [r for r in rows if excluded(r)]


def table(exclude: list[str]) -> str:
    counted, apart = split_rows(exclude)
    core, extensions = split_rows(exclude + [EXTENSIONS])[0], [r for r in counted if
                                                               r.name.startswith(EXTENSIONS)]
    head = ["| module | code lines | what it is |", "|---|---:|---|"]
    lines = head + [f"| `{r.name}` | {r.code} | {r.summary} |" for r in core]
    lines.append(f"| **core** | **{sum(r.code for r in core)}** | "
                 f"budget: {CORE_BUDGET} code lines, {sum(r.total for r in core)} lines in all |")
    # what each extension is: the README's table of extensions, just above this one
    lines += ["", "| extension module | code lines | budget |", "|---|---:|---|"]
    lines += [f"| `{r.name}` | {r.code} | "
              + (f"its own: {OWN_BUDGETS[r.name]}" if r.name in OWN_BUDGETS else "shared") + " |"
              for r in extensions if r.code]
    own = [r for r in counted if r.name in OWN_BUDGETS]
    lines.append(f"| **core + extensions** | **{sum(r.code for r in counted)}** | "
                 f"budget: {TOTAL_BUDGET} shared"
                 + "".join(f" + {OWN_BUDGETS[r.name]} ({r.name.rpartition('/')[2]})" for r in own)
                 + f", {sum(r.total for r in counted)} lines in all |")
    for name in dict.fromkeys(r.name.partition("/")[0] for r in apart):  # a package: one row
        rows = [r for r in apart if r.name.partition("/")[0] == name]
        summary = next((r.summary for r in rows if r.name.endswith("__init__.py")), rows[0].summary)
        shown = name + ("/" if len(rows) > 1 else "")
        budget = f"own budget {SERVER_BUDGET}" if name == "server" else "outside the budget"
        lines.append(f"| `{shown}` | {sum(r.code for r in rows)} | {budget}: {summary} |")
    return "\n".join(lines)


def size_problems() -> list[str]:
    """Modules over MAX_MODULE_LINES lines and classes over MAX_CLASS_LINES, all lines counted."""
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        source, name = path.read_text(), path.relative_to(PACKAGE).as_posix()
        if len(source.splitlines()) > MAX_MODULE_LINES:
            problems.append(f"{name} has {len(source.splitlines())} lines, over {MAX_MODULE_LINES}")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef) and \
                    (n := node.end_lineno - node.lineno + 1) > MAX_CLASS_LINES:
                problems.append(f"class {node.name} ({name}) has {n} lines, over {MAX_CLASS_LINES}")
    return problems


def readme_with_table(readme: str, exclude: list[str]) -> str:
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table(exclude)}\n{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-readme", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--exclude", action="append", default=[], metavar="NAME",
                        help=f"count a module outside the budget (repeatable; always: {EXCLUDE})")
    args = parser.parse_args()
    exclude = EXCLUDE + args.exclude
    counted = split_rows(exclude)[0]
    total = sum(row.code for row in counted)
    own = {row.name: row.code for row in counted if row.name in OWN_BUDGETS}
    core = sum(row.code for row in split_rows(exclude + [EXTENSIONS])[0])
    if args.write_readme:
        README.write_text(readme_with_table(README.read_text(), exclude))
    if not args.check:
        print(table(exclude))
        return 0
    problems = size_problems()
    if core > CORE_BUDGET:
        problems.append(f"the core has {core} code lines, over its budget of {CORE_BUDGET}")
    if total - sum(own.values()) > TOTAL_BUDGET:
        problems.append(f"the core and extensions have {total - sum(own.values())} code lines "
                        f"(without {sorted(own)}), over the budget of {TOTAL_BUDGET}")
    problems += [f"{name} has {code} code lines, over its own budget of {OWN_BUDGETS[name]}"
                 for name, code in own.items() if code > OWN_BUDGETS[name]]
    server = sum(row.code for row in module_rows() if row.name.startswith("server/"))
    if server > SERVER_BUDGET:
        problems.append(f"the server has {server} code lines, over its budget of {SERVER_BUDGET}")
    if readme_with_table(README.read_text(), exclude) != README.read_text():
        problems.append("the README's module table is stale: "
                        "run `python tools/loc.py --write-readme`")
    print("\n".join(problems) or f"ok: core {core} code lines of {CORE_BUDGET}, with extensions "
          f"{total - sum(own.values())} of {TOTAL_BUDGET}, "
          + "".join(f"{name} {code} of {OWN_BUDGETS[name]}, " for name, code in own.items())
          + f"server {server} of {SERVER_BUDGET}, "
          + "sizes within limits; README tables current")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
