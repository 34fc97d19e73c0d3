"""The README as a front page that stays true: its size, its API snippets, its commands' --help.

The ```python blocks of the README's API section are run in order, as one program, in a fresh
process on the CPU with the packaged default model, so a snippet that a change to the API breaks
(or one that uses an engine after shutting it down) fails here. The OpenAI client block of the
Serving section needs a server and is left to tests/test_server.py.
"""
import importlib.util
import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
MAX_README_BYTES = 16 * 1024  # the front page stays short; the chapters live in docs/


def section(name: str) -> str:
    """The README's text from the heading `## name` to the next `## ` heading."""
    text = README.read_text()
    start = text.index(f"\n## {name}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def api_snippets() -> list[str]:
    """The ```python blocks of the API section, in order."""
    return re.findall(r"```python\n(.*?)```", section("API"), flags=re.S)


def test_readme_is_under_16_kb() -> None:
    size = len(README.read_bytes())
    assert size < MAX_README_BYTES, f"README.md is {size} bytes: move detail into docs/"


def test_readme_names_the_budgets_tools_loc_enforces() -> None:
    """The Modules section's budget sentence quotes tools/loc.py's limits, so raising one shows."""
    spec = importlib.util.spec_from_file_location("loc", ROOT / "tools" / "loc.py")
    loc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loc)
    modules = section("Modules")
    assert f"{loc.CORE_BUDGET:,} code lines for the core" in modules
    assert f"{loc.TOTAL_BUDGET:,} for core and extensions" in modules


def test_api_section_has_the_engine_snippets() -> None:
    snippets = api_snippets()
    assert len(snippets) >= 2, "the API section lost its generate or streaming snippet"
    assert "LLM(" in snippets[0] and "generate(" in snippets[0]
    assert any("stream_step()" in s for s in snippets)


def test_api_snippets_run_in_order(tmp_path: Path) -> None:
    """Every snippet of the API section, as written, one after the other in one process."""
    program = "\n".join(api_snippets())
    script = tmp_path / "readme_api.py"
    script.write_text(program)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300, env=_cpu_env())
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr[-4000:]}"
    lines = [line for line in result.stdout.splitlines() if line.strip()]
    assert len(lines) >= 3, result.stdout  # generate's text, its ids, the cached count, a stream
    assert "length" in result.stdout or "stop" in result.stdout  # outs[0]["finish_reason"]


README_COMMANDS = ["example.py", "bench.py", "tools/timeline_demo.py"]


def test_readme_commands_start_and_write_nothing(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    """The README's commands parse their arguments (--help, each run in this process as
    `python COMMAND --help` runs it) and leave the working tree as it was."""
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    before = _porcelain(git)
    for command in README_COMMANDS:
        monkeypatch.setattr(sys, "argv", [command, "--help"])
        monkeypatch.syspath_prepend(str((ROOT / command).parent))  # the script's own folder
        with pytest.raises(SystemExit) as exited:
            runpy.run_path(str(ROOT / command), run_name="__main__")
        out, err = capsys.readouterr()
        assert exited.value.code == 0 and "usage:" in out, f"{command}: {err[-2000:]}"
    assert _porcelain(git) == before


@pytest.mark.parametrize("flags, message", [
    (["--max-tokens", "0"], "max_tokens must be an integer >= 1, got 0"),
    (["--temperature", "-1"], "temperature must be a real number >= 0"),
    (["--model", "/no/such/model"], "is no model directory")])
def test_example_refuses_bad_values_in_one_line(flags: list[str], message: str,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture) -> None:
    """A bad value ends example.py with argparse's one-line error (exit 2), not a traceback.
    Run in this process, as `python example.py` runs it (test_example_chats starts one)."""
    monkeypatch.setattr(sys, "argv", ["example.py", *flags])
    with pytest.raises(SystemExit) as exited:  # any other exception would be the traceback
        runpy.run_path(str(ROOT / "example.py"), run_name="__main__")
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    assert "example.py: error: " in err and message in err


def _porcelain(git: str) -> str:
    return subprocess.run([git, "status", "--porcelain"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout


def _cpu_env() -> dict[str, str]:
    """The environment with the GPU hidden, so the snippets take the CPU path the README's Quick
    start describes."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
