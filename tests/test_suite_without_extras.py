"""The suite collects without the backends' pip extras (issue 20, defect 4): the
``firestore`` and ``postgres`` extras, whose libraries nothing else installs (the
``test`` extra's Celery brings redis-py).

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

#: Runs pytest with ``google`` (google-cloud-firestore, the ``firestore`` extra) and
#: ``psycopg`` (the ``postgres`` extra) impossible to import, as on a machine
#: without those extras.
WITHOUT_EXTRAS = """
import importlib.abc
import sys


class WithoutExtras(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("google", "psycopg"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


for name in [m for m in sys.modules if m.split(".")[0] in ("google", "psycopg")]:
    del sys.modules[name]
sys.meta_path.insert(0, WithoutExtras())
import pytest

sys.exit(pytest.main(sys.argv[1:]))
"""


def test_the_suite_collects_without_the_firestore_and_postgres_extras():
    env = {name: value for name, value in os.environ.items() if name != "CI"}
    argv = [sys.executable, "-c", WITHOUT_EXTRAS, "--collect-only", "-q", "-rs"]
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
