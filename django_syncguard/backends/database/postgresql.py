"""PostgreSQL: server time, one statement (one round trip) per operation.

Acquire, release, withdraw, extend, claim and the grant check call the PL/pgSQL
functions of migrations 0002 to 0009; the other operations are single statements that
read the server's clock when they run. Release and withdraw grant the key to its first
waiter (or only wake it) with ``NOTIFY`` on that waiter's process channel (or the
key's), which ``wakeups.PostgresWakeUps`` hears; its process claims a grant through
:meth:`PostgresOperations.claim`, and the releasing process checks it once its window
is over (:meth:`PostgresOperations.check_grant`). ``specs/backends/database.md``
(Operations on PostgreSQL, Queues and wake-ups, Grants) gives the steps of each and why
they are atomic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar

from django.core import checks

from ...constants import TIME_TOLERANCE_MS
from ...errors import InvalidArgument, LockError
from ...fencing import FENCE_MAX
from ...results import TimeAuthority
from ...waiting import WaitTicket
from .errors import map_database_error
from .operations import (
    FENCE_PREFIX,
    IDLE_COUNTER,
    LIST_PAGE,
    LOCK_COLUMNS,
    AcquireReply,
    DatabaseOperations,
    OnGrant,
    Row,
    StorageKeys,
    WakeUpHooks,
    fetch_all,
    fetch_one,
    fetch_row,
    fetch_value,
    row_count,
)
from .sql import FLOOR_KEY, LOCK_CLASS, NOW_MS, PLACEHOLDERS
from .wakeups import DatabaseWakeUps, PostgresTransport, PostgresWakeUps, delivers_notifications

NOW = f"SELECT {NOW_MS}"
#: FLOOR_KEY as an SQL literal, as the functions have it.
FLOOR = PLACEHOLDERS["floor_key"]

# Functions installed by migrations 0002 to 0009 (their SQL: sql/0002/ to sql/0009/).
# Acquire's status is LOCKED, ACQUIRED or FENCE_OVERFLOW (with the ticket's queue
# position, the lock id of a grant the attempt crossed, and the ticket a watched
# attempt granted the key to); release's, extend's and claim's: 1 = done, 2 = expired
# (or a lapsed grant), 0 = not found. The last argument of acquire, release, withdraw
# and the check says whether this process checks a grant the statement makes (it
# then tells nobody but the grantee, and reports the ticket).
ACQUIRE = "SELECT * FROM syncguard_acquire(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
# A release commits without waiting for its WAL flush (local to its own transaction;
# acquires and extends stay durable): lost in a server crash, it leaves the lock to
# its TTL, as a crashed holder does, and the next durable commit flushes it anyway.
# The function sets synchronous_commit off itself, first; a release that grants the
# key writes a fence, which must be durable, and sets it back on for its transaction
# (tests/test_database_wakeups.py checks which setting the commit gets). See
# specs/backends/database.md, Durability of a release.
# Any release may grant: a waiter that takes grants left a record, whatever this
# backend's own WAKE_UPS.
RELEASE = "SELECT * FROM syncguard_release(%s, %s, true, %s)"
EXTEND = "SELECT * FROM syncguard_extend(%s, %s, %s)"
CLAIM = "SELECT syncguard_claim(%s, %s)"
WITHDRAW = "SELECT syncguard_withdraw(%s, %s, %s, %s)"
CHECK_GRANT = "SELECT * FROM syncguard_check_grant(%s, %s, %s, %s)"
NOTIFY = "SELECT pg_notify(%s, %s)"

# Deploy-check messages of this vendor (see checks.py for the table of ids).
W011 = "Lock backend {alias!r}: could not check the server's setup: {error}"
W012 = (
    "Lock backend {alias!r}: a connection that LISTENs on the lock database did not "
    "receive a notification sent through the backend's connections: a transaction "
    "pooler (pgbouncer in transaction mode) is probably in the way. Waiters poll instead "
    "of being woken by releases (fair queues still work)."
)
W012_HINT = (
    "Point OPTIONS['LISTEN_DATABASE'] at a DATABASES alias that reaches the same "
    "database directly or through session pooling, or set OPTIONS['WAKE_UPS'] = False."
)

# The inspector's waiter counts: live tickets per key and the first queueing time, for
# a page of keys at once (the primary key (key, ticket_id) serves the key filter).
QUEUE_STATS = f"""
SELECT key, count(*), min(queued_at_ms) FROM syncguard_waiters
WHERE key = ANY(%s) AND live_until_ms > {NOW_MS}
GROUP BY key
"""

IS_LOCKED = f"""
SELECT EXISTS (
    SELECT 1 FROM syncguard_locks WHERE key = %s AND expires_at_ms > {NOW_MS} - %s
)
"""

# With CLEANUP_IN_IS_LOCKED: the same answer, and the key's record deleted when it
# expired more than the guard ago (the answer comes from the snapshot before it).
IS_LOCKED_CLEANUP = f"""
WITH t AS (SELECT {NOW_MS} AS now_ms),
swept AS (
    DELETE FROM syncguard_locks l USING t
    WHERE l.key = %s AND l.expires_at_ms < t.now_ms - %s
)
SELECT EXISTS (
    SELECT 1 FROM syncguard_locks l, t WHERE l.key = %s AND l.expires_at_ms > t.now_ms - %s
)
"""

# A lock row as LOCK_COLUMNS, with the expiry its holder was told: an unclaimed grant's
# expires_at_ms is its claim deadline less the tolerance (sql/0008/hand_over.sql).
GRANTED_LOCK_COLUMNS = LOCK_COLUMNS.replace(
    "expires_at_ms", "coalesce(grant_expires_at_ms, expires_at_ms)", 1
)

LOOKUP = (
    f"SELECT {GRANTED_LOCK_COLUMNS} FROM syncguard_locks "
    f"WHERE {{column}} = %s AND expires_at_ms > {NOW_MS} - %s"
)

# Deletes one batch of records expired before the cutoff. Each doomed key's advisory
# lock is tried first (the one syncguard_acquire takes): a key being acquired right
# now is skipped, so acquire never sees its expired row vanish between its read and
# its write. The outer condition re-checks expiry at delete time.
DELETE_EXPIRED = f"""
WITH t AS (SELECT {NOW_MS} - %s AS cutoff),
doomed AS (
    SELECT c.key FROM (
        SELECT l.key FROM syncguard_locks l, t WHERE l.expires_at_ms < t.cutoff
        ORDER BY l.expires_at_ms LIMIT %s OFFSET 0
    ) c
    WHERE pg_try_advisory_xact_lock({LOCK_CLASS}, hashtext(c.key))
)
DELETE FROM syncguard_locks l USING t
WHERE l.key IN (SELECT key FROM doomed) AND l.expires_at_ms < t.cutoff
"""

# Fence continuity (specs/backends/database.md, Fence continuity). The floor is raised
# in one upsert: two raises, or a raise and compaction's, serialise on the row.
RAISE_FLOOR = (
    "INSERT INTO syncguard_fence_counters AS c (fence_key, fence) VALUES (%s, %s) "
    "ON CONFLICT (fence_key) DO UPDATE SET fence = greatest(c.fence, excluded.fence) "
    "RETURNING c.fence"
)

# One page of compaction: the counters after the cursor, in key order (keyset
# pagination on the primary key), each with whether it is idle as read; and, with the
# stamp flag, the page's counters without an acquisition time get the server's now
# (a data-modifying CTE: same statement, same snapshot, so the page shows them as they
# were, NULL, not idle). Parameters: cursor, limit + 1, stamp, limit, cut-off,
# tolerance.
# The counter's waiters flag says a waiter *may* queue (it is cleared only when the
# key is next taken): a key whose waiters gave up or died and which is never taken
# again would keep its flag, and its counter, forever. So a flagged counter is idle
# too when its key has no live ticket. (A waiter that comes back sets the flag again
# through its acquire's upsert; a compaction racing it costs fairness, never a fence.)
NO_WAITER = (
    "(NOT {c}.waiters OR NOT EXISTS (SELECT 1 FROM syncguard_waiters w "
    f"WHERE w.key = substr({{c}}.fence_key, {len(FENCE_PREFIX) + 1}) "
    "AND w.live_until_ms > t.now_ms))"
)
# LIKE, not substr(): the planner estimates a LIKE prefix from the column's
# statistics, and took substr()'s default 0.5% for 100% of the table, choosing a plan
# that read every live lock for each counter of a batch (bench/fences.py: 532 ms per
# batch of 2,000 counters; 13 ms with LIKE). No wildcard can occur in the prefix.
MAPPED = "{c}.fence_key LIKE '" + FENCE_PREFIX + "%%'"


def _idle(c: str) -> str:
    return IDLE_COUNTER.format(
        c=c,
        live_after="t.now_ms - %s",
        mapped=MAPPED.format(c=c),
        no_waiter=NO_WAITER.format(c=c),
    )


IDLE_P, IDLE_C = _idle("p"), _idle("c")

IDLE_PAGE = f"""
WITH t AS (SELECT {NOW_MS} AS now_ms),
page AS (
    SELECT c.fence_key, c.fence, c.acquired_at_ms, c.waiters
    FROM syncguard_fence_counters c
    WHERE c.fence_key > %s AND c.fence_key <> {FLOOR}
    ORDER BY c.fence_key LIMIT %s
),
stamped AS (
    UPDATE syncguard_fence_counters c SET acquired_at_ms = t.now_ms FROM t
    WHERE %s AND c.acquired_at_ms IS NULL
      AND c.fence_key IN (SELECT p.fence_key FROM page p ORDER BY p.fence_key LIMIT %s)
)
SELECT p.fence_key, p.fence, p.acquired_at_ms,
       coalesce({IDLE_P}, false)
FROM page p, t
ORDER BY p.fence_key
"""

# Deletes one batch of compaction: each counter still at the fence the page read and
# still idle, judged on the row being deleted. An acquire that wrote the counter first
# holds its row lock: the DELETE waits for its commit, then re-checks the new version
# of the row (READ COMMITTED), whose fence and acquisition time moved: kept. An
# acquire that writes after the DELETE waits for it and, the row gone, inserts its
# counter (its upsert, sql/0006/acquire.sql), with a fence above the one the page read
# and so above the floor compaction raised before this statement. Parameters: fence
# keys, fences, cut-off, tolerance.
DELETE_IDLE = f"""
WITH t AS (SELECT {NOW_MS} AS now_ms)
DELETE FROM syncguard_fence_counters c
USING t, unnest(%s::text[], %s::bigint[]) AS b(fence_key, fence)
WHERE c.fence_key = b.fence_key AND c.fence = b.fence AND c.fence_key <> {FLOOR}
  AND {IDLE_C}
"""


# The statement timeout the server runs a new connection with, in ms.
STARTUP_TIMEOUT = "SELECT setting FROM pg_settings WHERE name = 'statement_timeout'"
# The timeouts of connection_options, for the current transaction only (behind a
# pooler that dropped the startup settings). Parameters: statement and lock timeouts,
# idle-in-transaction timeout (ms, as text).
LOCAL_TIMEOUTS = (
    "SELECT set_config('statement_timeout', %s, true), set_config('lock_timeout', %s, true), "
    "set_config('idle_in_transaction_session_timeout', %s, true)"
)


class PostgresOperations(DatabaseOperations):
    """PostgreSQL through psycopg; see the module docstring."""

    vendor: ClassVar[str] = "postgresql"
    backend_name: ClassVar[str] = "postgres"
    time_authority: ClassVar[TimeAuthority] = "server"
    over_network: ClassVar[bool] = True
    direct_cursor: ClassVar[bool] = True
    grants: ClassVar[bool] = True
    list_page_sql: ClassVar[str] = LIST_PAGE.replace(LOCK_COLUMNS, GRANTED_LOCK_COLUMNS, 1)

    @classmethod
    def startup_settings_lost(cls, raw: Any, operation_timeout_ms: int) -> bool:
        # One query on each new connection. A pooler in transaction mode (PgBouncer
        # with ignore_startup_parameters = options) hands the statement to a server
        # connection it opened itself, without our "-c" settings.
        with raw.cursor() as cursor:
            cursor.execute(STARTUP_TIMEOUT)
            [(setting,)] = cursor.fetchall()
        raw.rollback()  # the driver opened a transaction; Django sets autocommit next
        return str(setting) != str(operation_timeout_ms)

    @classmethod
    def set_local_timeouts(cls, cursor: Any, operation_timeout_ms: int) -> None:
        ms = str(operation_timeout_ms)
        cursor.execute(LOCAL_TIMEOUTS, [ms, ms, str(max(operation_timeout_ms, 1000))])

    @classmethod
    def connection_options(
        cls, options: dict[str, Any], *, connect_timeout_ms: int, operation_timeout_ms: int
    ) -> None:
        options["connect_timeout"] = max(2, math.ceil(connect_timeout_ms / 1000))
        # A stalled server or a held row lock must not hang a lock call.
        settings = (
            f"-c statement_timeout={operation_timeout_ms} "
            f"-c lock_timeout={operation_timeout_ms} "
            f"-c idle_in_transaction_session_timeout={max(operation_timeout_ms, 1000)}"
        )
        options["options"] = f"{options.get('options', '')} {settings}".strip()
        options.setdefault("tcp_user_timeout", operation_timeout_ms)
        options.setdefault("keepalives", 1)
        options.setdefault("keepalives_idle", 5)
        options.setdefault("keepalives_interval", 2)
        options.setdefault("keepalives_count", 2)

    def storable(self, key: str) -> str:
        # PostgreSQL's text type cannot hold U+0000 at all (psycopg refuses to send it).
        if "\x00" in key:
            raise InvalidArgument(
                "The database backend on PostgreSQL cannot store keys (or prefixes) that "
                "contain NUL (U+0000): PostgreSQL text has no NUL. Encode such keys first.",
                context={"key": key},
            )
        return key

    def now_ms(self) -> int:
        return int(self.run(lambda c: fetch_value(c, NOW, [])))

    def acquire(
        self,
        keys: StorageKeys,
        lock_id: str,
        ttl_ms: int,
        check_cancel: Callable[[], None],
        ticket: WaitTicket | None = None,
        *,
        clock: bool,
        owner: str | None = None,
        grant_window_ms: int | None = None,
        process_channel: str | None = None,
        on_grant: OnGrant | None = None,
    ) -> AcquireReply:
        params = [
            keys.storage_key,
            keys.fence_key,
            lock_id,
            ttl_ms,
            keys.user_key,
            FENCE_MAX,
            TIME_TOLERANCE_MS,
            None if ticket is None else ticket.id,
            None if ticket is None else ticket.patience_ms,
            clock,
            owner,
            None if ticket is None else grant_window_ms,
            None if ticket is None or grant_window_ms is None else process_channel,
            on_grant is not None,
        ]
        # One statement: ``cancel`` was checked before dispatch. Checking it after
        # the commit would raise while holding a lock the caller never learns of.
        status, fence, expires, position, crossed, handed = self.run(
            lambda c: fetch_one(c, ACQUIRE, params)
        )
        if handed is not None and on_grant is not None:
            on_grant(keys.storage_key, str(handed))
        return status, fence, expires, position, crossed

    def release(self, lock_id: str, *, on_grant: OnGrant | None = None) -> tuple[bool, bool]:
        params = [lock_id, TIME_TOLERANCE_MS, on_grant is not None]
        # The function grants the key to (or NOTIFYs) the next waiter.
        status, granted, storage_key = self.run(lambda c: fetch_one(c, RELEASE, params))
        if granted is not None and on_grant is not None:
            on_grant(str(storage_key), str(granted))
        return status == 1, status == 2

    def check_grant(self, storage_key: str, ticket_id: str, watched: bool) -> tuple[int, Any, Any]:
        """``syncguard_check_grant``: ``(status, ms left, ticket granted now)``."""
        params = [storage_key, ticket_id, TIME_TOLERANCE_MS, watched]
        status, left_ms, granted = self.run(lambda c: fetch_one(c, CHECK_GRANT, params))
        return int(status), left_ms, granted

    def claim(self, lock_id: str) -> int:
        params = [lock_id, TIME_TOLERANCE_MS]
        return int(self.run(lambda c: fetch_value(c, CLAIM, params)))

    def withdraw(
        self, keys: StorageKeys, key: str, ticket_id: str, *, on_grant: OnGrant | None = None
    ) -> None:
        params = [keys.storage_key, ticket_id, TIME_TOLERANCE_MS, on_grant is not None]
        # Grants the key to (or NOTIFYs) the next waiter when it is free.
        granted = self.run(lambda c: fetch_value(c, WITHDRAW, params))
        if granted is not None and on_grant is not None:
            on_grant(keys.storage_key, str(granted))

    def make_wake_ups(self, name: str, hooks: WakeUpHooks) -> DatabaseWakeUps:
        transport = PostgresTransport(
            name, connect=hooks.listen, probe=partial(_probe, hooks), storage_key=hooks.storage_key
        )
        return PostgresWakeUps(
            transport,
            reply_timeout_s=hooks.reply_timeout_s,
            claim=hooks.claim,
            check_grant=hooks.check_grant,
        )

    def deploy_check(self, alias: str, hooks: WakeUpHooks) -> list[Any]:
        """``syncguard.W012`` when a connection that LISTENs does not receive a
        notification sent through the backend's connections (a transaction pooler on
        the way); ``syncguard.W011`` when the server cannot be asked."""
        try:
            if delivers_notifications(hooks.listen, partial(_probe, hooks)):
                return []
        except LockError as exc:
            return [checks.Warning(W011.format(alias=alias, error=exc), id="syncguard.W011")]
        except Exception as exc:  # a driver error while opening the listening connection
            error = map_database_error(exc, self.database)
            return [checks.Warning(W011.format(alias=alias, error=error), id="syncguard.W011")]
        return [checks.Warning(W012.format(alias=alias), hint=W012_HINT, id="syncguard.W012")]

    def extend(self, lock_id: str, ttl_ms: int) -> tuple[int | None, bool]:
        params = [lock_id, ttl_ms, TIME_TOLERANCE_MS]
        status, expires = self.run(lambda c: fetch_one(c, EXTEND, params))
        return expires, status == 2

    def is_locked(self, storage_key: str, sweep_guard_ms: int | None) -> bool:
        if sweep_guard_ms is None:
            sql, params = IS_LOCKED, [storage_key, TIME_TOLERANCE_MS]
        else:
            sql = IS_LOCKED_CLEANUP
            params = [storage_key, sweep_guard_ms, storage_key, TIME_TOLERANCE_MS]
        return bool(self.run(lambda c: fetch_value(c, sql, params)))

    def queue_stats(self, storage_keys: list[str]) -> list[Row]:
        return self.run(lambda c: fetch_all(c, QUEUE_STATS, [list(storage_keys)]))

    def lookup(self, column: str, value: str) -> Row | None:
        sql = LOOKUP.format(column=column)
        return self.run(lambda c: fetch_row(c, sql, [value, TIME_TOLERANCE_MS]))

    def delete_expired_batch(self, batch_size: int, guard_ms: int) -> int:
        params = [guard_ms, batch_size]
        return self.run(lambda c: row_count(c, DELETE_EXPIRED, params))

    def raise_fence_floor(self, fence: int) -> int:
        return int(self.run(lambda c: fetch_value(c, RAISE_FLOOR, [FLOOR_KEY, fence])))

    def idle_page(self, after: str, cutoff_ms: int, limit: int, stamp: bool) -> list[Row]:
        params = [after, limit + 1, stamp, limit, cutoff_ms, TIME_TOLERANCE_MS]
        return self.run(lambda c: fetch_all(c, IDLE_PAGE, params))

    def delete_idle(self, counters: list[tuple[str, int]], cutoff_ms: int) -> int:
        names = [name for name, _ in counters]
        fences = [fence for _, fence in counters]
        params = [names, fences, cutoff_ms, TIME_TOLERANCE_MS]
        return self.run(lambda c: row_count(c, DELETE_IDLE, params))


def _probe(hooks: WakeUpHooks, channel: str, payload: str) -> None:
    """``pg_notify(channel, payload)`` through a normal connection of the backend, which
    is closed afterwards (see ``WakeUpHooks.run_once``)."""
    hooks.run_once(lambda c: fetch_value(c, NOTIFY, [channel, payload]))
