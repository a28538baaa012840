"""The public surface: exports, and importing without settings."""

from __future__ import annotations

import subprocess
import sys
import types

import django_syncguard

API_NAMES = {
    "locks",
    "lock",
    "alock",
    "locked",
    "current_lock",
    "get_by_key",
    "get_by_id",
    "get_by_key_raw",
    "get_by_id_raw",
    "owns",
    "has_fence",
    "with_telemetry",
    "normalize_and_validate_key",
    "validate_lock_id",
    "generate_lock_id",
    "make_storage_key",
    "hash_key",
    "format_fence",
    "afenced_update",
    "is_live",
    "MAX_KEY_LENGTH_BYTES",
    "TIME_TOLERANCE_MS",
    "BACKEND_DEFAULTS",
    "LOCK_DEFAULTS",
    "FENCE_THRESHOLDS",
    "BACKEND_LIMITS",
    "RESERVE_BYTES",
    "LockError",
    "StaleFenceError",
    "AcquireResult",
    "ReleaseResult",
    "ExtendResult",
    "LockInfo",
    "Capabilities",
}


def test_exports_match_all():
    exported = {
        name
        for name, value in vars(django_syncguard).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    exported.discard("annotations")  # from __future__
    assert exported == set(django_syncguard.__all__)


def test_every_api_name_is_exported():
    assert set(django_syncguard.__all__) >= API_NAMES


def test_fenced_update_lives_in_fencing():
    from django_syncguard.fencing import fenced_update

    assert django_syncguard.fenced_update is fenced_update


def test_import_needs_no_settings():
    code = (
        "import os; os.environ.pop('DJANGO_SETTINGS_MODULE', None);"
        "import django_syncguard as s;"
        "from django_syncguard.backends.memory import MemoryBackend;"
        "b = MemoryBackend('x', {});"
        "r = b.acquire('k', 1000);"
        "print(r.fence, s.locked('k'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "000000000000001 locked('k')"


def test_importing_the_core_loads_no_backend_module():
    # The core modules depend on the contract (django_syncguard.contract), never on
    # backends/: a backend module is loaded only when an alias names it.
    code = (
        "import sys, django_syncguard, django_syncguard.checks, django_syncguard.acquisition;"
        "print(sorted(m for m in sys.modules if m.startswith('django_syncguard.backends')))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_no_backend_imports_the_checks_module():
    import ast
    from pathlib import Path

    package = Path(django_syncguard.__file__).parent
    importers = []
    for path in sorted((package / "backends").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            ours = isinstance(node, ast.ImportFrom) and (
                (node.level and node.module == "checks") or node.module == "django_syncguard.checks"
            )
            if ours:
                importers.append(path.name)
    assert importers == []
