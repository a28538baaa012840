"""System checks of ``SYNCGUARD_BACKENDS``.

=================  =========================================================
``syncguard.E001``  ``SYNCGUARD_BACKENDS`` is not a dict of alias -> dict.
``syncguard.E002``  An alias's ``BACKEND`` cannot be imported (names the pip extra).
``syncguard.E003``  An alias's configuration is invalid (the backend says why).
``syncguard.W001``  The memory backend is configured while ``DEBUG`` is False.
``syncguard.W010``  (deploy) A Redis server runs without AOF: fences can go backwards.
``syncguard.W011``  (deploy) A backend's server could not be asked about its setup.
``syncguard.I020``  (deploy) Firestore: keep the lockId index; an optional TTL policy.
=================  =========================================================

Each backend may add its own messages through ``backend.check()``.
"""

from __future__ import annotations

from typing import Any

from django.core import checks

from .errors import LockError

E001 = "SYNCGUARD_BACKENDS must be a dict mapping aliases to backend settings."
E002 = "Lock backend {alias!r} cannot be loaded: {error}"
E003 = "Lock backend {alias!r} is misconfigured: {error}"
W001 = (
    "Lock backend {alias!r} is the in-process MemoryBackend while DEBUG is False: "
    "it excludes nothing across processes."
)
W010 = (
    "Lock backend {alias!r}: the Redis server runs without AOF persistence "
    "(appendonly no). After a restart its fence counters can go back to older values "
    "and hand out fences already used. Enable appendonly (appendfsync everysec or always)."
)
W011 = "Lock backend {alias!r}: could not check the server's setup: {error}"
I020 = (
    "Lock backend {alias!r} (Firestore): release, extend and lookup by lock id query "
    "collection {collection!r} on the field lockId; keep its single-field index (Firestore "
    "creates it unless an exemption removes it). A TTL policy on the field purgeAt may "
    "delete long-expired lock documents; it only saves storage, liveness is always "
    "checked on every operation, and fence counters live in another collection."
)


def register() -> None:
    checks.register(check_backends, "syncguard")
    checks.register(check_backends_deploy, "syncguard", deploy=True)


def check_backends_deploy(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Checks that ask each configured server about its setup."""
    from .handler import LockHandler

    handler = LockHandler()
    messages: list[checks.CheckMessage] = []
    for alias in handler:
        try:
            backend = handler[alias]
        except Exception:  # configuration errors are reported by check_backends
            continue
        messages.extend(backend.deploy_check())
        backend.close()
    return messages


def check_backends(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    from django.conf import settings

    from .backends.memory import MemoryBackend
    from .handler import InvalidBackendError, LockHandler

    configured = getattr(settings, "SYNCGUARD_BACKENDS", None)
    if configured is not None and not (
        isinstance(configured, dict) and all(isinstance(v, dict) for v in configured.values())
    ):
        return [checks.Error(E001, id="syncguard.E001")]
    handler = LockHandler()  # a private one: checks must not cache half-built backends
    messages: list[checks.CheckMessage] = []
    for alias in handler:
        try:
            backend = handler[alias]
        except InvalidBackendError as exc:
            cause = exc.__cause__
            if isinstance(cause, LockError):
                messages.append(
                    checks.Error(E003.format(alias=alias, error=cause), id="syncguard.E003")
                )
            else:
                messages.append(
                    checks.Error(E002.format(alias=alias, error=exc), id="syncguard.E002")
                )
            continue
        except LockError as exc:
            messages.append(checks.Error(E003.format(alias=alias, error=exc), id="syncguard.E003"))
            continue
        if isinstance(backend, MemoryBackend) and not settings.DEBUG:
            messages.append(checks.Warning(W001.format(alias=alias), id="syncguard.W001"))
        messages.extend(backend.check(**kwargs))
        backend.close()
    return messages
