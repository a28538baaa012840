"""The ``locks`` handler over SYNCGUARD_BACKENDS (its system checks: test_checks.py)."""

from __future__ import annotations

import threading

import pytest
from django.test import override_settings

from django_syncguard import locks
from django_syncguard.backends.memory import MemoryBackend
from django_syncguard.handler import DEFAULT_BACKENDS, InvalidBackendError, LockHandler

MEMORY = "django_syncguard.backends.memory.MemoryBackend"


def test_alias_returns_one_shared_backend_across_threads():
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(locks["default"])) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(b is locks["default"] for b in seen)


def test_unknown_alias_has_a_clear_error():
    with pytest.raises(InvalidBackendError, match=r"No lock backend alias 'redis'.*'default'"):
        locks["redis"]


def test_override_settings_resets_the_handler():
    before = locks["default"]
    with override_settings(SYNCGUARD_BACKENDS={"default": {"BACKEND": MEMORY, "LOCATION": "b"}}):
        inside = locks["default"]
        assert inside is not before
        assert inside.location == "b"
    assert locks["default"] is not inside


def test_absent_setting_means_the_database_backend(settings):
    del settings.SYNCGUARD_BACKENDS
    handler = LockHandler()
    assert handler.settings == DEFAULT_BACKENDS
    assert DEFAULT_BACKENDS["default"]["BACKEND"] == (
        "django_syncguard.backends.database.DatabaseBackend"
    )


def test_unimportable_backend_names_the_extra():
    handler = LockHandler({"r": {"BACKEND": "django_syncguard.backends.redis.RedisBackend"}})
    import importlib.util

    if importlib.util.find_spec("django_syncguard.backends.redis") is None:
        with pytest.raises(InvalidBackendError, match=r'pip install "django-syncguard\[redis\]"'):
            handler["r"]


def test_backend_must_be_a_lock_backend():
    handler = LockHandler({"x": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}})
    with pytest.raises(InvalidBackendError, match="is not a lock backend"):
        handler["x"]


def test_missing_backend_key():
    with pytest.raises(InvalidBackendError, match="has no 'BACKEND'"):
        LockHandler({"x": {}})["x"]


def test_memory_backends_with_the_same_location_share_a_store():
    a = LockHandler({"x": {"BACKEND": MEMORY, "LOCATION": "shared-store"}})["x"]
    b = LockHandler({"y": {"BACKEND": MEMORY, "LOCATION": "shared-store"}})["y"]
    assert a is not b
    result = a.acquire("k", 1_000)
    assert b.is_locked("k") is True
    a.reset()
    assert result.ok


def test_memory_backend_built_from_dotted_clock_path():
    backend = MemoryBackend("clocked", {"OPTIONS": {"CLOCK": "tests.test_handler.frozen_clock"}})
    assert backend.acquire("k", 1_000).expires_at_ms == 1_001_000
    backend.reset()


def frozen_clock() -> int:
    return 1_000_000


def test_migrations_match_the_models():
    # What `makemigrations --check` does, without probing every DATABASES alias.
    from django.apps import apps
    from django.db.migrations.autodetector import MigrationAutodetector
    from django.db.migrations.loader import MigrationLoader
    from django.db.migrations.state import ProjectState

    loader = MigrationLoader(None, ignore_no_migrations=True)
    detector = MigrationAutodetector(loader.project_state(), ProjectState.from_apps(apps))
    assert detector.changes(graph=loader.graph) == {}


def test_overriding_the_setting_with_a_bad_shape_fails_only_on_use():
    locks.reset()  # settings not read yet: the reset on setting_changed must not read them
    with (
        override_settings(SYNCGUARD_BACKENDS=["not", "a", "dict"]),
        pytest.raises(InvalidBackendError),
    ):
        locks["default"]
