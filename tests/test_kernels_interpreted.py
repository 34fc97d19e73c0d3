"""test_kernels.py's *_interpreted tests, in a child process started with TRITON_INTERPRET=1 (Triton
reads it once, when it is imported: test_kernels.py says why). Here, not in test_kernels.py, so the
GPU suite's first run (the GPU's tests) leaves this CPU work to its second, parallel run.
"""
import os
import pathlib
import subprocess
import sys

import pytest

from nanoserve import kernels

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(kernels.INTERPRETED, reason="this process is interpreted: test_kernels.py "
                    "runs its interpreted tests here")
def test_kernels_under_triton_interpreter() -> None:
    """Run test_kernels.py's *_interpreted tests in a child process with TRITON_INTERPRET=1 set
    before any import."""
    python_path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    # no GPU visible: the child runs as on a CPU machine, wherever it starts
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=python_path, CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "interpreted",
               str(REPO / "tests" / "test_kernels.py")]
    child = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    report = child.stdout[-6000:] + child.stderr[-2000:]
    passed = " passed" in child.stdout and "skipped" not in child.stdout
    assert child.returncode == 0 and passed, report
