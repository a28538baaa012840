"""The suite collects without the backends' pip extras (issue 20, defect 4).

A test module that imports an extra's library at import time used to fail the whole
run's collection where that extra is not installed; such a module is skipped now
(outside CI, ``tests/support/servers.py``, ``import_extra``), and so are the tests
that need the extra's server.
"""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.servers import REPO_ROOT

#: Runs pytest with ``google`` (google-cloud-firestore, the ``firestore`` extra)
#: impossible to import, as on a machine without the extra.
WITHOUT_FIRESTORE = """
import importlib.abc
import sys


class WithoutGoogle(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "google" or name.startswith("google."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


for name in [m for m in sys.modules if m == "google" or m.startswith("google.")]:
    del sys.modules[name]
sys.meta_path.insert(0, WithoutGoogle())
import pytest

sys.exit(pytest.main(sys.argv[1:]))
"""


def test_the_suite_collects_without_the_firestore_extra():
    env = {name: value for name, value in os.environ.items() if name != "CI"}
    argv = [sys.executable, "-c", WITHOUT_FIRESTORE, "--collect-only", "-q", "-rs"]
    argv += ["-p", "no:cacheprovider", "tests"]
    done = subprocess.run(
        argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    output = done.stdout + done.stderr
    lines = output.strip().splitlines()
    assert done.returncode == 0, output
    assert lines[-1].split(" in ")[0].endswith(" tests collected"), output  # no "errors"
    reason = 'needs the firestore extra: pip install "django-syncguard[firestore]"'
    skipped = [line for line in lines if line.startswith("SKIPPED ")]
    assert len(skipped) == 1 and skipped[0].endswith(f": {reason}"), output
    collected = [line for line in lines if "::" in line]
    assert [line for line in collected if line.startswith("tests/test_firestore_backend.py")] == []
    assert any(line.startswith("tests/test_firestore_wakeups.py::") for line in collected)
