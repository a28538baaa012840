"""Which database the locks live in: ``OPTIONS["DATABASE"]``, judged without I/O.

The option names an alias of ``DATABASES`` (default ``"default"``) whose vendor has
an operations class. :func:`resolve` is the one judgement of that; the backend's
constructor raises its problem as ``InvalidArgument``, and
``DatabaseBackend.check_settings`` reports it as the system check ``syncguard.E004``
or ``syncguard.E005`` before anything is built (see ``checks.py`` for the table of
check ids).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.utils import load_backend

from .operations import DatabaseOperations
from .postgresql import PostgresOperations
from .sqlite import SqliteOperations

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

#: The operations class of each supported vendor, by ``connection.vendor``.
OPERATIONS: dict[str, type[DatabaseOperations]] = {
    ops.vendor: ops for ops in (PostgresOperations, SqliteOperations)
}
SUPPORTED_VENDORS = tuple(OPERATIONS)


@dataclass(frozen=True, slots=True)
class Target:
    """The ``DATABASES`` alias the locks live in, and its vendor's operations class."""

    database: str
    operations: type[DatabaseOperations]


@dataclass(frozen=True, slots=True)
class Problem:
    """What is wrong with ``OPTIONS["DATABASE"]``, said once: the constructor raises
    ``message`` as ``InvalidArgument``; the system check reports it as ``check_id``
    with ``hint``. Without a ``check_id`` the check leaves it to construction, which
    it reports as ``syncguard.E003``."""

    message: str
    check_id: str | None = None
    hint: str | None = None


def resolve(alias: str, options: Mapping[str, Any]) -> Target | Problem:
    """Where the lock backend ``alias`` with these ``OPTIONS`` keeps its locks, or why
    it cannot. Reads the settings only: no connection object, no I/O. Raises
    ``ImproperlyConfigured`` when the alias's database ``ENGINE`` cannot be loaded."""
    database = options.get("DATABASE", DEFAULT_DB_ALIAS)
    if not isinstance(database, str) or not database:
        return Problem("OPTIONS['DATABASE'] must name an alias of DATABASES.")
    if database not in connections.settings:
        return _not_an_alias(alias, database)
    vendor = load_backend(connections.settings[database]["ENGINE"]).DatabaseWrapper.vendor
    if vendor not in OPERATIONS:
        return _unsupported(alias, database, vendor)
    return Target(database, OPERATIONS[vendor])


def resolve_listen(options: Mapping[str, Any], target: Target) -> str | Problem:
    """The ``DATABASES`` alias the PostgreSQL wake-ups LISTEN through:
    ``OPTIONS["LISTEN_DATABASE"]``, by default the locks' own alias. Another alias must
    reach the same PostgreSQL database (directly, where the locks' alias goes through a
    transaction pooler); that cannot be told without I/O, only its vendor can."""
    if "LISTEN_DATABASE" not in options:
        return target.database
    listen = options["LISTEN_DATABASE"]
    if target.operations.vendor != "postgresql":
        return Problem(
            "OPTIONS['LISTEN_DATABASE'] applies to PostgreSQL only (SQLite has no LISTEN); "
            "remove it."
        )
    if not isinstance(listen, str) or listen not in connections.settings:
        configured = ", ".join(repr(a) for a in connections.settings) or "none"
        return Problem(
            f"OPTIONS['LISTEN_DATABASE'] = {listen!r} is not an alias of DATABASES "
            f"(configured: {configured})."
        )
    vendor = load_backend(connections.settings[listen]["ENGINE"]).DatabaseWrapper.vendor
    if vendor != "postgresql":
        return Problem(
            f"OPTIONS['LISTEN_DATABASE'] = {listen!r} is a {vendor!r} database; it must "
            "reach the locks' PostgreSQL database."
        )
    return listen


def check_errors(alias: str, params: Mapping[str, Any]) -> list[checks.CheckMessage]:
    """The system-check errors :func:`resolve` finds in the ``SYNCGUARD_BACKENDS``
    entry ``params``. A malformed entry or an unloadable ``ENGINE`` is left to
    construction, whose error says more."""
    options = params.get("OPTIONS") or {}
    if not isinstance(options, Mapping):
        return []
    try:
        target = resolve(alias, options)
    except ImproperlyConfigured:
        return []
    if isinstance(target, Target) or target.check_id is None:
        return []
    return [checks.Error(target.message, hint=target.hint, id=target.check_id)]


def _not_an_alias(alias: str, database: str) -> Problem:
    configured = ", ".join(repr(a) for a in connections.settings) or "none"
    return Problem(
        E005.format(alias=alias, database=database, configured=configured),
        check_id="syncguard.E005",
    )


def _unsupported(alias: str, database: str, vendor: str) -> Problem:
    supported = ", ".join(SUPPORTED_VENDORS)
    return Problem(
        E004.format(alias=alias, database=database, vendor=vendor, supported=supported),
        check_id="syncguard.E004",
        hint=E004_HINT,
    )
