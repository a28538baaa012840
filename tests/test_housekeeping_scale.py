"""The inspector's pages stay fast with 100,000 locks, shown without timing.

What the servers are asked to do does not depend on the machine, so that is what these
tests check. On PostgreSQL and SQLite the page query walks the primary key index from
the cursor: no sort and no scan of the table, and EXPLAIN ANALYZE reads about one page
of rows even deep into the table. Every page also takes the same number of statements.
On Redis a page makes at most ``MAX_SCANS_PER_PAGE`` SCAN calls, and walking every page
lists every live lock.

The rows are written straight into the backends' storage layout (one SQL statement, a
Redis pipeline), 100,000 live locks plus 10,000 expired records among them, and are
removed afterwards. ``bench/inspector_pages.py`` times the same pages.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from django_syncguard import InvalidArgument
from django_syncguard.backends.redis import MAX_SCANS_PER_PAGE
from tests.support.harness import PostgresHarness, RedisHarness, SqliteHarness

LIVE = 100_000
EXPIRED_EVERY = 11  # rows 11, 22, ... are expired records: 10,000 among the live ones
ROWS = LIVE * EXPIRED_EVERY // (EXPIRED_EVERY - 1)
HOUR_MS = 3_600_000
PAGE = 100

on_postgres = pytest.mark.django_db(transaction=True, databases=["postgres"])
on_sqlite = pytest.mark.django_db(transaction=True, databases=["default"])


def key_of(n: int) -> str:
    return f"scale:{n:06d}"


#: The keys of the live locks, in key order (zero-padded: every collation agrees).
LIVE_KEYS = [key_of(n) for n in range(1, ROWS + 1) if n % EXPIRED_EVERY]
assert len(LIVE_KEYS) == LIVE


def walk(backend, *, limit: int, cursor: str | None = None, prefix: str = "") -> Iterator[Any]:
    """Every page from ``cursor`` to the end."""
    while True:
        page = backend.list_locks(prefix=prefix, cursor=cursor, limit=limit)
        yield page
        cursor = page.next_cursor
        if cursor is None:
            return


def keys(page) -> list[str]:
    return [record.key for record in page.records]


# ------------------------------------------------------------- SQL databases
# Rows 1..ROWS in the layout of django_syncguard/models.py: live for an hour, except
# every EXPIRED_EVERY-th, which expired an hour ago. Lock ids are 22 characters and
# fences 15 digits, like the backend's.
INSERT_ROWS = """
INSERT INTO syncguard_locks (key, lock_id, expires_at_ms, acquired_at_ms, fence, user_key)
SELECT 'scale:' || {pad6},
       'L' || {pad21},
       CASE WHEN mod(g, {every}) = 0 THEN %s - {hour} ELSE %s + {hour} END,
       %s - 1000,
       {pad15},
       NULL
FROM {series}
"""
PG_INSERT = INSERT_ROWS.format(
    pad6="lpad(g::text, 6, '0')",
    pad21="lpad(g::text, 21, '0')",
    pad15="lpad(g::text, 15, '0')",
    every=EXPIRED_EVERY,
    hour=HOUR_MS,
    series=f"generate_series(1, {ROWS}) AS s(g)",
)
LITE_INSERT = (
    f"WITH RECURSIVE s(g) AS (SELECT 1 UNION ALL SELECT g + 1 FROM s WHERE g < {ROWS}) "
    + INSERT_ROWS.format(
        pad6="printf('%%06d', g)",
        pad21="printf('%%021d', g)",
        pad15="printf('%%015d', g)",
        every=EXPIRED_EVERY,
        hour=HOUR_MS,
        series="s",
    )
)


def filled(harness, sql: str, *, analyze: bool) -> Iterator[Any]:
    try:
        harness.execute("DELETE FROM syncguard_locks", [])  # flushed already; be sure
        now = harness.now_ms()
        harness.execute(sql, [now, now, now])
        if analyze:
            harness.execute("ANALYZE syncguard_locks", [])
        yield harness
    finally:
        harness.execute("DELETE FROM syncguard_locks", [])
        harness.close()


@pytest.fixture
def pg_scale():
    # PostgreSQL's planner needs the table's statistics, which autovacuum keeps. Right
    # after a bulk load, before any ANALYZE, it uses default estimates and
    # pages through the expiry index plus a sort of every live row: 100,000 rows read
    # and sorted for each page, 25 to 75 ms here. With statistics it walks the key index.
    yield from filled(PostgresHarness(), PG_INSERT, analyze=True)


@pytest.fixture
def lite_scale():
    # SQLite walks the key index with or without statistics: none are gathered here.
    yield from filled(SqliteHarness(), LITE_INSERT, analyze=False)


class Statements:
    """An execute wrapper that records each statement run, as (sql, params)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, Any]] = []

    def __call__(self, execute, sql, params, many, context):
        self.seen.append((sql, params))
        return execute(sql, params, many, context)


def page_and_statements(backend, cursor: str | None, limit: int = PAGE):
    """One page and the statements it ran on the backend's private connection. (With
    an execute wrapper installed the backend goes through Django's cursor on PostgreSQL
    too, see ``PrivateConnections.direct``; the statements are the same.)"""
    statements = Statements()
    with backend.connection().execute_wrapper(statements):
        page = backend.list_locks(cursor=cursor, limit=limit)
    return page, statements.seen


def pages_at_depths(backend) -> tuple[list[Any], list[tuple[str, str | None, list[str], bool]]]:
    """The whole table in pages of 1,000, and (depth, cursor, expected keys, more pages
    follow) of the pages of ``PAGE`` looked at below; every cursor is one the backend
    returned while walking, as an operator clicking "next" would get it."""
    deep = None
    for _ in range(3):
        deep = backend.list_locks(cursor=deep, limit=PAGE).next_cursor
    whole = list(walk(backend, limit=1_000))
    near_end = whole[-2].next_cursor  # after 99,000 live locks
    last = backend.list_locks(cursor=near_end, limit=900).next_cursor  # after 99,900
    return whole, [
        ("first", None, LIVE_KEYS[:PAGE], True),
        ("3 pages deep", deep, LIVE_KEYS[3 * PAGE : 4 * PAGE], True),
        ("near the end", near_end, LIVE_KEYS[99_000 : 99_000 + PAGE], True),
        ("last", last, LIVE_KEYS[-PAGE:], False),
    ]


def check_pages(backend) -> dict[str, int]:
    """Exact keys at every depth; returns the statements each page took."""
    whole, depths = pages_at_depths(backend)
    assert [key for page in whole for key in keys(page)] == LIVE_KEYS  # once each, in order
    assert [len(page.records) for page in whole] == [1_000] * (LIVE // 1_000)
    counts = {}
    for depth, cursor, expected, more in depths:
        page, statements = page_and_statements(backend, cursor)
        assert keys(page) == expected, depth
        assert (page.next_cursor is not None) is more, depth
        assert [r.fence for r in page.records] == [f"{int(k[6:]):015d}" for k in expected]
        counts[depth] = len(statements)
    assert len(set(counts.values())) == 1, counts  # the same at every depth
    return counts


def list_page_statement(backend, cursor: str | None) -> tuple[str, Any]:
    _, statements = page_and_statements(backend, cursor)
    (statement,) = [s for s in statements if s[0] == backend.ops.list_page_sql]
    return statement


def plan_nodes(node: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield node
    for child in node.get("Plans", ()):
        yield from plan_nodes(child)


@on_postgres
def test_postgres_pages_are_exact_and_take_two_statements_at_any_depth(pg_scale):
    # The server's clock (SELECT now) and the page query.
    assert set(check_pages(pg_scale.backend).values()) == {2}


@on_postgres
def test_postgres_page_query_reads_one_page_of_the_key_index_at_any_depth(pg_scale):
    backend = pg_scale.backend
    _, depths = pages_at_depths(backend)
    for depth, cursor, _, _ in depths:
        sql, params = list_page_statement(backend, cursor)  # exactly what the backend ran
        with backend.connection().cursor() as c:
            c.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {sql}", params)
            (plan,) = c.fetchone()[0]
        nodes = list(plan_nodes(plan["Plan"]))
        assert [node["Node Type"] for node in nodes] == ["Limit", "Index Scan"], depth
        scan = nodes[1]
        assert scan["Index Name"] == "syncguard_locks_pkey", depth
        assert scan["Scan Direction"] == "Forward", depth
        assert scan["Index Cond"].startswith("(key > "), depth  # starts at the cursor
        # Rows read: the page and its look-ahead row, plus the expired records among
        # them (one in 11), however deep the page is.
        assert scan["Actual Rows"] <= PAGE + 1, depth
        assert scan["Rows Removed by Filter"] <= PAGE // (EXPIRED_EVERY - 1) + 1, depth


@on_sqlite
def test_sqlite_pages_are_exact_and_take_one_statement_at_any_depth(lite_scale):
    # SQLite's time is the client's: the page query is the only statement.
    assert set(check_pages(lite_scale.backend).values()) == {1}


@on_sqlite
def test_sqlite_page_query_searches_the_key_index_without_sorting(lite_scale):
    backend = lite_scale.backend
    _, depths = pages_at_depths(backend)
    for depth, cursor, _, _ in depths:
        sql, params = list_page_statement(backend, cursor)
        with backend.connection().cursor() as c:
            c.execute(f"EXPLAIN QUERY PLAN {sql}", params)
            plan = [row[-1] for row in c.fetchall()]
        # One search of the primary key's index from the cursor; no "USE TEMP B-TREE
        # FOR ORDER BY" (a sort) and no "SCAN syncguard_locks" (the whole table).
        assert plan == [
            "SEARCH syncguard_locks USING INDEX sqlite_autoindex_syncguard_locks_1 (key>?)"
        ], depth


# --------------------------------------------------------------------- Redis
# Writes rows ARGV[1]..ARGV[2] server-side (far faster than a pipeline from Python):
# a live lock is its hash (f, i, e, a) and its lock-id index key, which expires with
# it; every EXPIRED_EVERY-th row is an expired record, and beside it a released key,
# a hash holding only its fence. ARGV[3] prefix, ARGV[4] now ms, ARGV[5] an hour in ms.
FILL_REDIS = f"""
local prefix, now, hour = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
for n = tonumber(ARGV[1]), tonumber(ARGV[2]) do
  local name = prefix .. ':scale:' .. string.format('%06d', n)
  local lock_id = 'L' .. string.format('%021d', n)
  if n % {EXPIRED_EVERY} == 0 then
    redis.call('HSET', name, 'f', n, 'i', lock_id, 'e', now - hour, 'a', now - hour)
    redis.call('HSET', prefix .. ':released:' .. string.format('%06d', n), 'f', n)
  else
    redis.call('HSET', name, 'f', n, 'i', lock_id, 'e', now + hour, 'a', now)
    redis.call('SET', prefix .. '#id:' .. lock_id, name, 'PX', hour)
  end
end
return 0
"""

# Deletes up to 10,000 keys matching ARGV[1] from SCAN cursor ARGV[2]; returns the
# next cursor.
UNLINK_REDIS = """
local page = redis.call('SCAN', ARGV[2], 'MATCH', ARGV[1], 'COUNT', 10000)
local names = page[2]
for i = 1, #names, 1000 do
  redis.call('UNLINK', unpack(names, i, math.min(i + 999, #names)))
end
return page[1]
"""


@pytest.fixture(scope="module")
def redis_scale(redis_server):
    """100,000 live locks, 10,000 expired records and 10,000 released keys, with the
    live locks' index keys: 220,000 keys under a prefix of their own, shared by the
    Redis tests below, which only read them."""
    harness = RedisHarness()
    client = harness.redis.client
    try:
        now = harness.now_ms()
        for first in range(1, ROWS + 1, 10_000):
            last = min(first + 9_999, ROWS)
            client.eval(FILL_REDIS, 0, first, last, harness.prefix, now, HOUR_MS)
        yield harness
    finally:
        cursor = b"0"
        while True:
            cursor = client.eval(UNLINK_REDIS, 0, f"{harness.prefix}[:#]*", cursor)
            if cursor in (b"0", 0, "0"):
                break
        harness.backend.close()


@pytest.fixture
def scans(redis_scale, monkeypatch):
    """The number of SCAN calls of each ``list_locks`` call, in order."""
    backend = redis_scale.redis
    per_page: list[int] = []
    original_scan, original_list = backend._scan, backend._list_locks

    def counted_scan(*args):
        per_page[-1] += 1
        return original_scan(*args)

    def counted_list(*args):
        per_page.append(0)
        return original_list(*args)

    monkeypatch.setattr(backend, "_scan", counted_scan)
    monkeypatch.setattr(backend, "_list_locks", counted_list)
    return per_page


@pytest.mark.parametrize("limit", [PAGE, 1_000])
def test_redis_walk_lists_every_live_lock_with_bounded_scans_per_page(redis_scale, scans, limit):
    backend = redis_scale.redis
    pages = list(walk(backend, limit=limit))

    listed = [key for page in pages for key in keys(page)]
    # Coverage: every live lock is listed, nothing else is (no expired record, no
    # released key, no index key). Exactly once is not asserted: SCAN may return a key
    # twice when Redis shrinks its table during the walk, and the backend keeps such
    # repeats (its cursor is SCAN's, with no memory of what was listed). Nothing is
    # deleted during this walk, so none are expected here, but none are promised.
    assert set(listed) == set(LIVE_KEYS)
    # Bounded work per page, however deep: at most MAX_SCANS_PER_PAGE SCAN calls.
    assert len(scans) == len(pages)
    assert max(scans) <= MAX_SCANS_PER_PAGE
    record = next(r for page in pages for r in page.records if r.key == key_of(7))
    assert (record.lock_id, record.fence) == (f"L{7:021d}", "000000000000007")


def test_redis_page_of_a_rare_prefix_stops_after_max_scans(redis_scale, scans):
    backend = redis_scale.redis

    page = backend.list_locks(prefix="nothing-has-this-prefix:", limit=10)

    # 220,000 keys and nothing matches: the page gives up after MAX_SCANS_PER_PAGE
    # SCAN calls with what it found (nothing) and a cursor to go on from.
    assert scans == [MAX_SCANS_PER_PAGE]
    assert page.records == ()
    assert page.next_cursor is not None


def test_redis_prefix_walk_lists_exactly_the_matching_live_locks(redis_scale, scans):
    backend = redis_scale.redis

    pages = list(walk(backend, prefix="scale:0999", limit=PAGE))

    expected = [k for k in LIVE_KEYS if k.startswith("scale:0999")]
    assert sorted(Counter(k for page in pages for k in keys(page))) == expected
    assert max(scans) <= MAX_SCANS_PER_PAGE


@pytest.mark.parametrize("cursor", ["²", "١٢", "12a", " 12"])
def test_redis_refuses_a_cursor_it_did_not_return(redis_server, cursor):
    # Unicode digits pass str.isdigit() but not int(): InvalidArgument, not ValueError.
    harness = RedisHarness()
    try:
        with pytest.raises(InvalidArgument):
            harness.backend.list_locks(cursor=cursor)
    finally:
        harness.close()
