"""Line counts of nanoserve/: the README's module table and the line budget, from one count.

A code line holds at least one token that is not a comment, a docstring or layout, so explanations
are free and nobody deletes one to fit the budget.

    python tools/loc.py                 # print the table and the total
    python tools/loc.py --write-readme  # replace the table between the README's markers
    python tools/loc.py --check         # exit 1 if over the budget or the README table is stale (the tests run this)
"""
import argparse
import ast
import io
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanoserve"
README = ROOT / "README.md"
BUDGET = 1750  # code lines in nanoserve/, the course-material promise (1,600 until the sampler kernels,
# 1,700 until the fused gate/up + SiLU decode kernel)
BEGIN, END = "<!-- loc-table:begin -->", "<!-- loc-table:end -->"
LAYOUT = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
          tokenize.ENDMARKER, tokenize.ENCODING}


def docstring_lines(tree: ast.Module) -> set[int]:
    """Line numbers covered by the docstrings of the module, its classes and its functions."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
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


def module_rows() -> list[tuple[str, int, int, str]]:
    """(file, code lines, all lines, first line of its docstring) for every module of the package."""
    rows = []
    for path in sorted(PACKAGE.glob("*.py")):
        source = path.read_text()
        summary = (ast.get_docstring(ast.parse(source)) or "").splitlines()[0]
        rows.append((path.name, count_code_lines(source), len(source.splitlines()), summary))
    return rows


def table() -> str:
    rows = module_rows()
    lines = ["| module | code lines | all lines | what it is |", "|---|---:|---:|---|"]
    lines += [f"| `{name}` | {code} | {total} | {summary} |" for name, code, total, summary in rows]
    lines.append(f"| **total** | **{sum(r[1] for r in rows)}** | **{sum(r[2] for r in rows)}** | "
                 f"budget: {BUDGET} code lines |")
    return "\n".join(lines)


def readme_with_table(readme: str) -> str:
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table()}\n{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write-readme", action="store_true")
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    total = sum(row[1] for row in module_rows())
    if args.write_readme:
        README.write_text(readme_with_table(README.read_text()))
    if not args.check:
        print(table())
        return 0
    problems = []
    if total > BUDGET:
        problems.append(f"nanoserve/ has {total} code lines, over the budget of {BUDGET}")
    if readme_with_table(README.read_text()) != README.read_text():
        problems.append("the README's module table is stale: run `python tools/loc.py --write-readme`")
    print("\n".join(problems) or f"ok: {total} code lines of {BUDGET}, README table current")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
