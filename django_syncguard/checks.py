"""System checks of ``SYNCGUARD_BACKENDS`` and of the ``@locked`` functions.

==================  ===========================================================
``syncguard.E001``  ``SYNCGUARD_BACKENDS`` is not a dict of alias -> dict.
``syncguard.E002``  An alias's ``BACKEND`` cannot be imported or loaded (names the pip
                    extra when one is missing).
``syncguard.E003``  An alias's configuration is invalid (the backend says why).
``syncguard.E004``  A database backend's ``DATABASES`` alias is of a vendor it does not
                    support (supported: postgresql, sqlite).
``syncguard.E005``  A database backend's ``OPTIONS["DATABASE"]`` is not an alias of
                    ``DATABASES``.
``syncguard.E006``  A ``@locked(using=...)`` function names an alias that
                    ``SYNCGUARD_BACKENDS`` does not define.
``syncguard.W001``  The memory backend is configured while ``DEBUG`` is False.
``syncguard.W002``  A database backend's ``DATABASES`` alias has ``ATOMIC_REQUESTS``:
                    a view's writes commit after its lock is released.
``syncguard.W003``  A ``@locked`` function's ``ttl_ms`` cannot outlast one call to its
                    backend (``OPERATION_TIMEOUT_MS``), or, with ``auto_extend``, the
                    lease left at a renewal (two thirds of ``ttl_ms``) cannot.
``syncguard.W010``  (deploy) A Redis server runs without AOF: fences can go backwards.
``syncguard.W011``  (deploy) A backend's server could not be asked about its setup.
``syncguard.I020``  (deploy) Firestore: keep the lockId index; an optional TTL policy.
==================  ===========================================================

Each backend may add its own messages through ``backend.check()``.

The checks without ``deploy`` do no I/O: they build each backend in a private
:class:`~django_syncguard.handler.LockHandler` (never the shared ``locks``, which must
not cache a backend built from settings a check found wrong) and close it again.
``E006`` and ``W003`` judge the functions :mod:`django_syncguard.registry` recorded:
those decorated with ``@locked(...)`` in code imported by the time the checks run,
and given an alias (a backend object passed as ``using=`` is not checked).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from django.core import checks

from .errors import LockError

E001 = "SYNCGUARD_BACKENDS must be a dict mapping aliases to backend settings."
E002 = "Lock backend {alias!r} cannot be loaded: {error}"
E003 = "Lock backend {alias!r} is misconfigured: {error}"
E004 = (
    "Lock backend {alias!r}: DATABASES[{database!r}] is a {vendor!r} database, which the "
    "database backend does not support (supported: {supported})."
)
E004_HINT = (
    "Point OPTIONS['DATABASE'] at a PostgreSQL or SQLite alias of DATABASES, or use the "
    "Redis or Firestore backend."
)
E005 = (
    "Lock backend {alias!r}: OPTIONS['DATABASE'] = {database!r} is not an alias of "
    "DATABASES (configured: {configured})."
)
E006 = (
    "{function} is decorated with @locked(using={using!r}), but SYNCGUARD_BACKENDS has no "
    "alias {using!r} (configured: {configured})."
)
E006_HINT = "Add the alias to SYNCGUARD_BACKENDS, or pass using= one that it defines."
W001 = (
    "Lock backend {alias!r} is the in-process MemoryBackend while DEBUG is False: "
    "it excludes nothing across processes."
)
W002 = (
    "Lock backend {alias!r} keeps its locks in DATABASES[{database!r}], which has "
    "ATOMIC_REQUESTS=True. The lock backend uses its own autocommit connection, so a lock "
    "is visible at once, but a view decorated with @locked commits its writes only after "
    "the decorator released the lock: the next holder can read data from before the write."
)
W002_HINT = (
    "Decorate such views with @transaction.non_atomic_requests and open "
    "transaction.atomic() inside the locked function, or write with fenced_update()."
)
W003_TTL = (
    "{function}: @locked(ttl_ms={ttl_ms}) is not longer than OPERATION_TIMEOUT_MS of lock "
    "backend {using!r} ({timeout} ms): the lease can expire before one call to the server "
    "is allowed to fail."
)
W003_TTL_HINT = "Give ttl_ms more than OPERATION_TIMEOUT_MS, or lower OPERATION_TIMEOUT_MS."
W003_RENEWAL = (
    "{function}: @locked(ttl_ms={ttl_ms}, auto_extend=True) renews every {interval} ms "
    "(a third of the TTL), leaving {remaining} ms of lease, less than OPERATION_TIMEOUT_MS "
    "of lock backend {using!r} ({timeout} ms): the lease can expire while a renewal is "
    "still allowed to wait for the server."
)
W003_RENEWAL_HINT = (
    "Give ttl_ms at least {minimum} ms (1.5 x OPERATION_TIMEOUT_MS), or lower OPERATION_TIMEOUT_MS."
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
    """Check every alias of ``SYNCGUARD_BACKENDS``, then every ``@locked`` function."""
    from django.conf import settings
    from django.db import connections

    from .backends.database import DatabaseBackend
    from .backends.memory import MemoryBackend
    from .handler import InvalidBackendError, LockHandler

    configured = getattr(settings, "SYNCGUARD_BACKENDS", None)
    if configured is not None and not (
        isinstance(configured, dict) and all(isinstance(v, dict) for v in configured.values())
    ):
        return [checks.Error(E001, id="syncguard.E001")]
    handler = LockHandler()  # a private one: checks must not cache half-built backends
    messages: list[checks.CheckMessage] = []
    timeouts: dict[str, int] = {}  # alias -> operation timeout, of the aliases that built
    for alias in handler:
        database_errors = _check_database_alias(alias, handler.settings[alias])
        if database_errors:
            messages.extend(database_errors)
            continue
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
        if isinstance(backend, DatabaseBackend) and connections.settings[backend.database].get(
            "ATOMIC_REQUESTS"
        ):
            messages.append(
                checks.Warning(
                    W002.format(alias=alias, database=backend.database),
                    hint=W002_HINT,
                    id="syncguard.W002",
                )
            )
        messages.extend(backend.check(**kwargs))
        timeouts[alias] = backend.operation_timeout_ms
        backend.close()
    messages.extend(check_locked_functions(list(handler.settings), timeouts))
    return messages


def _check_database_alias(alias: str, params: Mapping[str, Any]) -> list[checks.CheckMessage]:
    """E004 / E005 for an alias of the database backend, without building it.

    Anything else wrong with the alias (an unimportable ``BACKEND``, bad options, a
    database driver that cannot be loaded) is left to the backend's construction.
    """
    from django.core.exceptions import ImproperlyConfigured
    from django.db import DEFAULT_DB_ALIAS, connections
    from django.db.utils import load_backend
    from django.utils.module_loading import import_string

    from .backends.database import SUPPORTED_VENDORS, DatabaseBackend

    path = params.get("BACKEND")
    if not isinstance(path, str) or not path:
        return []
    try:
        backend_cls = import_string(path)
    except ImportError:
        return []
    if not (isinstance(backend_cls, type) and issubclass(backend_cls, DatabaseBackend)):
        return []
    options = params.get("OPTIONS") or {}
    if not isinstance(options, Mapping):
        return []
    database = options.get("DATABASE", DEFAULT_DB_ALIAS)
    if not isinstance(database, str) or not database:
        return []
    if database not in connections.settings:
        known = ", ".join(repr(a) for a in connections.settings) or "none"
        return [
            checks.Error(
                E005.format(alias=alias, database=database, configured=known),
                id="syncguard.E005",
            )
        ]
    try:  # the wrapper class only: no connection object, no I/O
        vendor = load_backend(connections.settings[database]["ENGINE"]).DatabaseWrapper.vendor
    except ImproperlyConfigured:
        return []
    if vendor in SUPPORTED_VENDORS:
        return []
    return [
        checks.Error(
            E004.format(
                alias=alias,
                database=database,
                vendor=vendor,
                supported=", ".join(SUPPORTED_VENDORS),
            ),
            hint=E004_HINT,
            id="syncguard.E004",
        )
    ]


def check_locked_functions(
    aliases: Sequence[str], timeouts: Mapping[str, int]
) -> list[checks.CheckMessage]:
    """E006 and W003 for every ``@locked`` function in the registry.

    ``aliases`` are the aliases ``SYNCGUARD_BACKENDS`` defines (``"default"`` alone
    when the setting is absent); ``timeouts`` maps each alias whose backend could be
    built to its ``operation_timeout_ms``.
    """
    from .registry import locked_functions

    configured = ", ".join(repr(a) for a in aliases) or "none"
    messages: list[checks.CheckMessage] = []
    for entry in locked_functions():
        if entry.using is None:
            continue
        if entry.using not in aliases:
            messages.append(
                checks.Error(
                    E006.format(function=entry.name, using=entry.using, configured=configured),
                    hint=E006_HINT,
                    id="syncguard.E006",
                )
            )
            continue
        timeout = timeouts.get(entry.using)
        if timeout is None:  # the alias's own error is reported already
            continue
        values = {
            "function": entry.name,
            "ttl_ms": entry.ttl_ms,
            "using": entry.using,
            "timeout": timeout,
        }
        if entry.ttl_ms <= timeout:
            messages.append(
                checks.Warning(W003_TTL.format(**values), hint=W003_TTL_HINT, id="syncguard.W003")
            )
        elif entry.auto_extend and 2 * entry.ttl_ms < 3 * timeout:
            # A renewal starts a third of the TTL after the last one (leases.py), when
            # two thirds of the lease are left for it to finish.
            interval = round(entry.ttl_ms / 3)
            messages.append(
                checks.Warning(
                    W003_RENEWAL.format(
                        **values, interval=interval, remaining=entry.ttl_ms - interval
                    ),
                    hint=W003_RENEWAL_HINT.format(minimum=(3 * timeout + 1) // 2),
                    id="syncguard.W003",
                )
            )
    return messages
