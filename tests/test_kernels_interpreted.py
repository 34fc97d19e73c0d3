"""test_kernels.py's *_interpreted tests, in a child process started with TRITON_INTERPRET=1 (Triton
reads it once, when it is imported: test_kernels.py says why). Here, not in test_kernels.py, so the
GPU suite's first run (the GPU's tests) leaves this CPU work to its second, parallel run.
"""
import os
import pathlib
import sys

import pytest
from conftest import Child, children

from nanoserve import kernels

REPO = pathlib.Path(__file__).resolve().parents[1]


def start() -> Child | None:
    """test_kernels.py's *_interpreted tests in a child process with TRITON_INTERPRET=1 set
    before any import; None in a process that is interpreted itself."""
    if kernels.INTERPRETED:
        return None
    python_path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    # no GPU visible: the child runs as on a CPU machine, wherever it starts
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=python_path, CUDA_VISIBLE_DEVICES="")
    return Child([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                  "interpreted", str(REPO / "tests" / "test_kernels.py")], env=env, cwd=REPO)


@pytest.mark.skipif(kernels.INTERPRETED, reason="this process is interpreted: test_kernels.py "
                    "runs its interpreted tests here")
def test_kernels_under_triton_interpreter(request: pytest.FixtureRequest) -> None:
    """Run test_kernels.py's *_interpreted tests in a child process (started with the session:
    conftest.children)."""
    returncode, stdout, stderr = children(request, start).wait(timeout=900)
    report = stdout[-6000:] + stderr[-2000:]
    assert returncode == 0 and " passed" in stdout and "skipped" not in stdout, report


test_kernels_under_triton_interpreter.start_children = start
