"""The README's main command: the example project's demo, run as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "example_project"


@pytest.mark.slow
def test_demo_pays_the_invoice_exactly_once(tmp_path):
    env = {**os.environ, "EXAMPLE_DB_PATH": str(tmp_path / "demo.sqlite3")}
    env.pop("DJANGO_SETTINGS_MODULE", None)

    def manage(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=EXAMPLE,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    manage("migrate", "--noinput", "--verbosity", "0")
    lines = manage("syncguard_demo").splitlines()
    assert lines == [
        "Paying Invoice INV-0042 with two workers",
        "  worker-A holds invoice:1 with fence 000000000000001",
        "  worker-B finds invoice:1 locked and waits",
        "  worker-A (fence 000000000000001) paid the invoice",
        "  worker-B (fence 000000000000002) found it already paid",
        "Invoice INV-0042 paid=True by worker-A (fence 000000000000001)",
    ]
