"""System checks of ``SYNCGUARD_BACKENDS`` and of the ``@locked`` functions.

==================  ===========================================================
``syncguard.E001``  ``SYNCGUARD_BACKENDS`` is not a dict of alias -> dict.
``syncguard.E002``  An alias's ``BACKEND`` cannot be imported or loaded (names the pip
                    extra when one is missing).
``syncguard.E003``  An alias's configuration is invalid (the backend says why): an
                    unknown setting or option, a bad value, ``KEY_PREFIX`` on a
                    backend without a shared key namespace.
``syncguard.E004``  A database backend's ``DATABASES`` alias is of a vendor it does not
                    support (supported: postgresql, sqlite).
``syncguard.E005``  A database backend's ``OPTIONS["DATABASE"]`` is not an alias of
                    ``DATABASES``.
``syncguard.E006``  A ``@locked(using=...)`` function names an alias that
                    ``SYNCGUARD_BACKENDS`` does not define.
``syncguard.E007``  ``SYNCGUARD_BACKENDS`` is an empty dict (remove it for the database
                    default, or define an alias).
``syncguard.W001``  The memory backend is configured while ``DEBUG`` is False.
``syncguard.W002``  A database backend keeps its locks in an SQLite database whose
                    ``transaction_mode`` takes the write lock as each transaction
                    starts: no lock can be taken inside ``atomic()``.
``syncguard.W003``  A ``@locked`` function's ``ttl_ms`` cannot outlast one call to its
                    backend (``OPERATION_TIMEOUT_MS``), or, with ``auto_extend``, the
                    lease left at a renewal (two thirds of ``ttl_ms``) cannot.
``syncguard.W004``  A ``@locked`` key template names a parameter of the function as
                    literal text (``"invoice:pk"`` on ``def pay(pk)``): one key for
                    every call.
``syncguard.W005``  A ``@locked`` function that is a Celery or Django task waits for its
                    lock (``on_contended="wait"``) no longer than ``ttl_ms`` plus the
                    takeover tolerance: the lease a killed holder leaves outlasts every
                    run queued behind it, and each fails with ``AcquisitionTimeout``.
``syncguard.W006``  The admin is installed and sessions are signed cookies: the lock
                    inspector keeps the keys of the rows it shows in the session, and
                    a signed cookie is readable by the user who carries it.
``syncguard.W013``  Two aliases share one key namespace with nested prefixes (Redis:
                    ``KEY_PREFIX`` "a" and "a:b" on one server): the outer alias's keys
                    include the inner one's, and its fence compaction deletes the
                    inner alias's counters without raising the inner alias's floor.
``syncguard.W010``  (deploy) A Redis server runs without AOF: a restart frees held locks
                    early; in counter mode fences also go back (clock mode, the
                    default, keeps them above the last one).
``syncguard.W011``  (deploy) A backend's server could not be asked about its setup.
``syncguard.W014``  (deploy) A Redis alias on Sentinel or a Cluster without
                    ``OPTIONS["WAIT_REPLICAS"]``: a failover can free held locks (and,
                    in counter mode, send fences back).
``syncguard.W012``  (deploy) PostgreSQL: a LISTENing connection does not hear the
                    backend's notifications (a transaction pooler): waiters poll.
``syncguard.I020``  (deploy) Firestore: keep the lockId index; an optional TTL policy.
==================  ===========================================================

This module holds the messages about settings as a whole and about ``@locked``
functions; each backend holds its own (E004, E005, W002, W011 and W012 in the database
backend, W001 in the memory backend, W010, W011 and W014 in the Redis backend, I020 in the
Firestore backend) and this module asks it: first the class, ``check_settings(alias, params)``,
for problems that prevent building it; then the built backend, ``backend.check()``
(and ``backend.deploy_check()`` with ``--deploy``).

The checks without ``deploy`` do no I/O: they build each backend in a private
:class:`~django_syncguard.handler.LockHandler` (never the shared ``locks``, which must
not cache a backend built from settings a check found wrong) and close it again.
``E006``, ``W003``, ``W004`` and ``W005`` judge the functions
:mod:`django_syncguard.registry` recorded: those decorated with ``@locked(...)`` in
code imported by the time the checks run (``E006`` and ``W003`` only those given an
alias: a backend object passed as ``using=`` is not checked). ``W005`` learns that a
function is a task from what its module's name for it is bound to now: the task
decorator above ``@locked`` ran after the registry recorded the function.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from django.core import checks

from .constants import TIME_TOLERANCE_MS
from .contract import LockBackend
from .decorators import task_framework
from .errors import LockError
from .handler import InvalidBackendError, LockHandler
from .key_templates import KeyTemplate
from .registry import LockedFunction, locked_functions

E001 = "SYNCGUARD_BACKENDS must be a dict mapping aliases to backend settings."
E002 = "Lock backend {alias!r} cannot be loaded: {error}"
E003 = "Lock backend {alias!r} is misconfigured: {error}"
E006 = (
    "{function} is decorated with @locked(using={using!r}), but SYNCGUARD_BACKENDS has no "
    "alias {using!r} (configured: {configured})."
)
E006_HINT = "Add the alias to SYNCGUARD_BACKENDS, or pass using= one that it defines."
E007 = "SYNCGUARD_BACKENDS is empty: no lock backend is configured."
E007_HINT = (
    "Define at least a 'default' alias, or remove the setting to keep locks in "
    "DATABASES['default']."
)
W013 = (
    "Lock backends {outer!r} and {inner!r} share one store, and every key of {inner!r} is "
    "also a key of {outer!r} (prefix {outer_prefix!r} contains {inner_prefix!r}): the two "
    "can lock the same key under different names, and compacting {outer!r}'s fence "
    "counters deletes {inner!r}'s without raising its floor."
)
W013_HINT = "Give each alias a prefix that does not start with another's prefix followed by ':'."
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
W004 = (
    "{function}: the key template {template!r} has {param!r} as literal text, and "
    "{function} takes a parameter {param!r}: every call locks the same key, whatever "
    "{param} is."
)
W004_HINT = "Write the parameter as a placeholder: @locked({fixed!r})."
W005 = (
    "{function} is a {framework} task whose lock wait ends after at most {wait} ms "
    "({limit}), no later than the lease a killed worker leaves on its key runs out: "
    "ttl_ms ({ttl_ms} ms) plus the {tolerance} ms before an expired lock can be taken "
    "over. When a worker dies holding the key, every run of the task queued behind it "
    "fails with AcquisitionTimeout."
)
W006 = (
    "SESSION_ENGINE is signed cookies and django.contrib.admin is installed: the lock "
    "inspector keeps the raw keys of the rows it shows in the session, and a signed "
    "cookie is signed, not encrypted: a staff user without the view_lock_key "
    "permission can read the keys from it."
)
W006_HINT = (
    "Use database or cache sessions (django.contrib.sessions.backends.db, .cache or "
    ".cached_db), or silence syncguard.W006 if no key may name a person or a secret."
)
SIGNED_COOKIES = "django.contrib.sessions.backends.signed_cookies"
W005_HINT = (
    "Wait longer than ttl_ms + {tolerance} ms ({minimum} ms here) plus the runs queued "
    "ahead (timeout_ms; max_retries too when its delays run out first), and keep the "
    "lease short with auto_extend=True, e.g. ttl_ms=10_000, auto_extend=True, "
    "timeout_ms=30_000; or pass on_contended='raise' and let the task queue retry."
)
W003_RENEWAL_HINT = (
    "Give ttl_ms at least {minimum} ms (1.5 x OPERATION_TIMEOUT_MS), or lower OPERATION_TIMEOUT_MS."
)


def register() -> None:
    checks.register(check_backends, "syncguard")
    checks.register(check_backends_deploy, "syncguard", deploy=True)


def check_backends_deploy(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """Checks that ask each configured server about its setup."""
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

    configured = getattr(settings, "SYNCGUARD_BACKENDS", None)
    if configured is not None and not (
        isinstance(configured, dict) and all(isinstance(v, dict) for v in configured.values())
    ):
        return [checks.Error(E001, id="syncguard.E001")]
    if configured == {}:
        return [checks.Error(E007, hint=E007_HINT, id="syncguard.E007")]
    handler = LockHandler()  # a private one: checks must not cache half-built backends
    messages: list[checks.CheckMessage] = []
    timeouts: dict[str, int] = {}  # alias -> operation timeout, of the aliases that built
    namespaces: dict[str, tuple[str, str]] = {}  # alias -> (store, prefix), where shared
    for alias in handler:
        found, built = check_alias(handler, alias, **kwargs)
        messages.extend(found)
        if built is not None:
            timeouts[alias] = built.operation_timeout_ms
            namespace = getattr(built, "key_namespace", None)
            if namespace is not None:
                namespaces[alias] = namespace
    messages.extend(check_nested_namespaces(namespaces))
    messages.extend(check_locked_functions(list(handler.settings), timeouts))
    messages.extend(check_inspector_sessions())
    return messages


def check_inspector_sessions() -> list[checks.CheckMessage]:
    """W006 when the inspector's session data would travel in a readable cookie."""
    from django.apps import apps
    from django.conf import settings

    if not apps.is_installed("django.contrib.admin"):
        return []
    if getattr(settings, "SESSION_ENGINE", "") != SIGNED_COOKIES:
        return []
    return [checks.Warning(W006, hint=W006_HINT, id="syncguard.W006")]


def check_nested_namespaces(namespaces: dict[str, tuple[str, str]]) -> list[checks.CheckMessage]:
    """W013 for each pair of aliases on one store whose prefixes nest."""
    messages: list[checks.CheckMessage] = []
    for outer, (store, outer_prefix) in namespaces.items():
        for inner, (other_store, inner_prefix) in namespaces.items():
            if store == other_store and inner_prefix.startswith(f"{outer_prefix}:"):
                names = {"outer": outer, "inner": inner}
                prefixes = {"outer_prefix": outer_prefix, "inner_prefix": inner_prefix}
                message = W013.format(**names, **prefixes)
                messages.append(checks.Warning(message, hint=W013_HINT, id="syncguard.W013"))
    return messages


def check_alias(
    handler: LockHandler, alias: str, **kwargs: Any
) -> tuple[list[checks.CheckMessage], LockBackend | None]:
    """The messages about one alias, asked of its backend class and then of the built
    backend, and the backend (closed; ``None`` when it could not be built)."""
    try:
        backend_cls = handler.backend_class(alias)
    except InvalidBackendError as exc:
        return [checks.Error(E002.format(alias=alias, error=exc), id="syncguard.E002")], None
    errors = backend_cls.check_settings(alias, handler.settings[alias])
    if errors:
        return list(errors), None
    try:
        backend = handler[alias]
    except (InvalidBackendError, LockError) as exc:
        return [_construction_error(alias, exc)], None
    try:
        return list(backend.check(**kwargs)), backend
    finally:
        backend.close()


def _construction_error(alias: str, exc: Exception) -> checks.CheckMessage:
    """E003 when the backend refused its settings (a ``LockError``), E002 when it
    could not be loaded (``InvalidBackendError``, e.g. its pip extra is missing)."""
    if isinstance(exc, LockError):
        return checks.Error(E003.format(alias=alias, error=exc), id="syncguard.E003")
    return checks.Error(E002.format(alias=alias, error=exc), id="syncguard.E002")


def check_locked_functions(
    aliases: Sequence[str], timeouts: Mapping[str, int]
) -> list[checks.CheckMessage]:
    """E006, W003, W004 and W005 for every ``@locked`` function in the registry.

    ``aliases`` are the aliases ``SYNCGUARD_BACKENDS`` defines (``"default"`` alone
    when the setting is absent); ``timeouts`` maps each alias whose backend could be
    built to its ``operation_timeout_ms``.
    """
    configured = ", ".join(repr(a) for a in aliases) or "none"
    messages: list[checks.CheckMessage] = []
    for entry in locked_functions():
        messages.extend(_check_literal_params(entry))
        messages.extend(_check_task_wait(entry))
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
        elif entry.using in timeouts:  # else the alias's own error is reported already
            messages.extend(_check_ttl(entry, timeouts[entry.using]))
    return messages


def _check_literal_params(entry: LockedFunction) -> list[checks.CheckMessage]:
    """W004 for each parameter the key template names as literal text."""
    template = KeyTemplate(entry.template) if entry.literal_params else None
    return [
        checks.Warning(
            W004.format(function=entry.name, template=entry.template, param=param),
            hint=W004_HINT.format(fixed=template.with_placeholder(param)),
            id="syncguard.W004",
        )
        for param in entry.literal_params
        if template is not None
    ]


def _check_ttl(entry: LockedFunction, timeout: int) -> list[checks.CheckMessage]:
    """W003 when ``entry``'s lease can expire while one call to its server may wait."""
    values = {"function": entry.name, "ttl_ms": entry.ttl_ms, "using": entry.using}
    values["timeout"] = timeout
    if entry.ttl_ms <= timeout:
        return [checks.Warning(W003_TTL.format(**values), hint=W003_TTL_HINT, id="syncguard.W003")]
    if not entry.auto_extend or 2 * entry.ttl_ms >= 3 * timeout:
        return []
    # A renewal starts a third of the TTL after the last one (leases.py), when two
    # thirds of the lease are left for it to finish.
    interval = round(entry.ttl_ms / 3)
    return [
        checks.Warning(
            W003_RENEWAL.format(**values, interval=interval, remaining=entry.ttl_ms - interval),
            hint=W003_RENEWAL_HINT.format(minimum=(3 * timeout + 1) // 2),
            id="syncguard.W003",
        )
    ]


def _check_task_wait(entry: LockedFunction) -> list[checks.CheckMessage]:
    """W005 when ``entry`` is a task that waits for its lock no longer than a killed
    holder's lease can last: ``ttl_ms`` after its last renewal (or its acquire), plus
    the tolerance during which an expired lock is still live on every backend."""
    if entry.on_contended != "wait":
        return []  # "skip" and "raise" do not wait: the queue's retries are the wait
    wait = entry.policy.longest_wait_ms()
    dead_lease = entry.ttl_ms + TIME_TOLERANCE_MS
    if wait > dead_lease:
        return []
    found = _task_of(entry)
    if found is None:
        return []  # a view or a plain function: its caller sees the AcquisitionTimeout
    policy = entry.policy
    if wait < policy.timeout_ms:
        limit = (
            f"max_retries={policy.max_retries} delays of retry_delay_ms="
            f"{_ms(policy.retry_delay_ms)}, {policy.backoff} backoff, end before "
            f"timeout_ms={_ms(policy.timeout_ms)}"
        )
    else:
        limit = f"timeout_ms={_ms(policy.timeout_ms)}"
    values: dict[str, object] = {"function": entry.name, "framework": found[0]}
    values |= {"wait": _ms(wait)}
    values |= {"limit": limit, "ttl_ms": entry.ttl_ms, "tolerance": TIME_TOLERANCE_MS}
    hint = W005_HINT.format(tolerance=TIME_TOLERANCE_MS, minimum=dead_lease)
    return [checks.Warning(W005.format(**values), hint=hint, id="syncguard.W005")]


def _task_of(entry: LockedFunction) -> tuple[str, str] | None:
    """The task framework of ``entry``'s function, when the name it was defined under
    is now a task object: ``@shared_task`` / ``@task`` above ``@locked`` rebinds it.
    Looked up in ``sys.modules`` only (a check imports nothing); a nested function
    (``<locals>`` in its name) is never found."""
    module_name, _, attribute = entry.name.rpartition(".")
    module = sys.modules.get(module_name)
    if module is None:
        return None
    return task_framework(vars(module).get(attribute))


def _ms(value: float) -> str:
    """A millisecond option as written: ``30000``, ``2.5``."""
    return str(int(value)) if float(value).is_integer() else str(value)
