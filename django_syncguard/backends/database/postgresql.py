"""PostgreSQL: server time, one statement (one round trip) per operation.

Acquire, release and extend call the PL/pgSQL functions of migration 0002; the other
operations are single statements that read the server's clock when they run.
``specs/backends/database.md`` (Operations on PostgreSQL) gives the steps of each and
why they are atomic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

from ...constants import TIME_TOLERANCE_MS
from ...errors import InvalidArgument
from ...fencing import FENCE_MAX
from ...results import TimeAuthority
from .operations import (
    LOCK_COLUMNS,
    AcquireReply,
    DatabaseOperations,
    Row,
    StorageKeys,
    fetch_one,
    fetch_row,
    fetch_value,
    row_count,
)

# Server time in whole Unix milliseconds, read when the statement runs.
NOW_MS = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"

NOW = f"SELECT {NOW_MS}"

# Functions installed by migration 0002. Acquire's status is LOCKED, ACQUIRED or
# FENCE_OVERFLOW; release's and extend's: 1 = done, 2 = expired, 0 = not found.
ACQUIRE = "SELECT * FROM syncguard_acquire(%s, %s, %s, %s, %s, %s, %s)"
RELEASE = "SELECT syncguard_release(%s, %s)"
EXTEND = "SELECT * FROM syncguard_extend(%s, %s, %s)"

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

LOOKUP = (
    f"SELECT {LOCK_COLUMNS} FROM syncguard_locks "
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
    WHERE pg_try_advisory_xact_lock(1937337447, hashtext(c.key))
)
DELETE FROM syncguard_locks l USING t
WHERE l.key IN (SELECT key FROM doomed) AND l.expires_at_ms < t.cutoff
"""


class PostgresOperations(DatabaseOperations):
    """PostgreSQL through psycopg; see the module docstring."""

    vendor: ClassVar[str] = "postgresql"
    backend_name: ClassVar[str] = "postgres"
    time_authority: ClassVar[TimeAuthority] = "server"
    over_network: ClassVar[bool] = True
    direct_cursor: ClassVar[bool] = True

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
        self, keys: StorageKeys, lock_id: str, ttl_ms: int, check_cancel: Callable[[], None]
    ) -> AcquireReply:
        params = [
            keys.storage_key,
            keys.fence_key,
            lock_id,
            ttl_ms,
            keys.user_key,
            FENCE_MAX,
            TIME_TOLERANCE_MS,
        ]
        # One statement: ``cancel`` was checked before dispatch. Checking it after
        # the commit would raise while holding a lock the caller never learns of.
        status, fence, expires = self.run(lambda c: fetch_one(c, ACQUIRE, params))
        return status, fence, expires

    def release(self, lock_id: str) -> tuple[bool, bool]:
        params = [lock_id, TIME_TOLERANCE_MS]
        status = self.run(lambda c: fetch_value(c, RELEASE, params))
        return status == 1, status == 2

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

    def lookup(self, column: str, value: str) -> Row | None:
        sql = LOOKUP.format(column=column)
        return self.run(lambda c: fetch_row(c, sql, [value, TIME_TOLERANCE_MS]))

    def delete_expired_batch(self, batch_size: int, guard_ms: int) -> int:
        params = [guard_ms, batch_size]
        return self.run(lambda c: row_count(c, DELETE_EXPIRED, params))
