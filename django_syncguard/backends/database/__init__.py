"""The database backend: locks in your Django database.

PostgreSQL in production (server time, one round trip per operation) and SQLite as
the embedded default for development. Tables come from this app's migrations
(``syncguard_locks``, ``syncguard_fence_counters``, ``syncguard_waiters``); run
``migrate`` on the database named by ``OPTIONS["DATABASE"]`` (a ``DATABASES`` alias,
default ``"default"``).

**Independent of the caller's transaction.** The backend never uses Django's
connection of that alias (the one your views and ``transaction.atomic()`` use). It
opens its own connection per thread, from the same settings, in autocommit: a lock
is visible to every process the moment ``acquire`` returns, survives a rollback of
the caller's transaction, and a fence is never handed out twice. Each operation is
a single autocommit statement (or, on SQLite, one short transaction), so the
backend works behind pgbouncer in transaction pooling mode: it keeps no session
state and uses only transaction-scoped advisory locks (waiters' wake-ups excepted:
``LISTEN`` needs a session, see ``wakeups.py``). Prepared
statements follow the alias's ``OPTIONS["prepare_threshold"]`` (Django's switch,
off by default); turn it on only where the pooler, if any, supports them.

The package, one module per concern:

- ``backend.py``: ``DatabaseBackend``, vendor-neutral (storage keys, results from
  rows, pagination, ``check_settings``);
- ``target.py``: which ``DATABASES`` alias and vendor ``OPTIONS["DATABASE"]`` names,
  judged once for the constructor and the system check;
- ``operations.py``: ``DatabaseOperations``, what the backend asks of a vendor, and
  the SQL every vendor shares; ``postgresql.py`` and ``sqlite.py``: one subclass each;
- ``connections.py``: the private per-thread connections; ``errors.py``: driver
  errors as ``LockError``;
- ``wakeups.py``: fair waiting's wake-ups: one ``LISTEN`` connection per backend and
  process on PostgreSQL (releases ``NOTIFY`` the next waiter), in-process on SQLite
  (whose queue lives in a file beside the database).

See ``specs/backends/database.md`` for the SQL of each operation.
"""

from .backend import DatabaseBackend
from .sqlite import W002, W002_HINT
from .target import E004, E004_HINT, E005, SUPPORTED_VENDORS

__all__ = [
    "E004",
    "E004_HINT",
    "E005",
    "SUPPORTED_VENDORS",
    "W002",
    "W002_HINT",
    "DatabaseBackend",
]
