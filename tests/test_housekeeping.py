"""Operators' operations, on every backend: listing live locks page by page, deleting
expired records (never fences), and force-releasing a lock seen in the inspector."""

from __future__ import annotations

import pytest

from django_syncguard import InvalidArgument, ReleaseResult, hash_key
from django_syncguard.constants import CLEANUP_GUARD_MS, TIME_TOLERANCE_MS

TTL = 10_000
# Real time passes on server-time backends between ageing records and the call under
# test: boundaries are checked with this much room on each side.
MARGIN = 500


def held(harness, *keys):
    return {key: harness.backend.acquire(key, TTL) for key in keys}


def all_pages(backend, *, prefix="", limit):
    pages, cursor = [], None
    while True:
        page = backend.list_locks(prefix=prefix, cursor=cursor, limit=limit)
        pages.append(page)
        cursor = page.next_cursor
        if cursor is None:
            return pages


def listed_keys(pages):
    return [record.key for page in pages for record in page.records]


def guard(harness):
    return CLEANUP_GUARD_MS[harness.capabilities.time_authority]


# ------------------------------------------------------------------ listing
def test_list_locks_shows_each_live_lock_once_with_its_record(backend, harness):
    results = held(harness, *(f"job:{n:02d}" for n in range(7)))
    backend.release(results["job:03"].lock_id)

    pages = all_pages(backend, limit=3)

    keys = listed_keys(pages)
    assert sorted(keys) == ["job:00", "job:01", "job:02", "job:04", "job:05", "job:06"]
    if not harness.name.startswith("redis"):  # SCAN order is the server's; the others page by key
        assert keys == sorted(keys)
        assert [len(page.records) for page in pages] == [3, 3]
    record = next(r for page in pages for r in page.records if r.key == "job:05")
    assert record.lock_id == results["job:05"].lock_id
    assert record.fence == results["job:05"].fence
    assert record.expires_at_ms == results["job:05"].expires_at_ms
    assert record.acquired_at_ms == record.expires_at_ms - TTL
    now = harness.now_ms()
    assert now - 5_000 < pages[0].now_ms <= now


def test_list_locks_filters_by_key_prefix(backend, harness):
    held(harness, "invoice:1", "invoice:2", "invoices", "Invoice:3", "order:1")

    pages = all_pages(backend, prefix="invoice:", limit=10)

    assert sorted(listed_keys(pages)) == ["invoice:1", "invoice:2"]


def test_list_locks_prefix_is_literal_not_a_pattern(backend, harness):
    held(harness, "a*b:1", "axb:1", "a%b:1", "a_b:1", "a[b]:1")

    assert listed_keys(all_pages(backend, prefix="a*", limit=10)) == ["a*b:1"]
    assert listed_keys(all_pages(backend, prefix="a%", limit=10)) == ["a%b:1"]
    assert listed_keys(all_pages(backend, prefix="a_", limit=10)) == ["a_b:1"]
    assert listed_keys(all_pages(backend, prefix="a[", limit=10)) == ["a[b]:1"]


def test_list_locks_leaves_out_expired_locks(backend, harness):
    held(harness, "old")
    harness.advance(TTL + TIME_TOLERANCE_MS + MARGIN)
    held(harness, "new")

    assert listed_keys(all_pages(backend, limit=10)) == ["new"]


def test_list_locks_on_an_empty_store_is_one_empty_page(backend, harness):
    pages = all_pages(backend, limit=10)

    assert [page.records for page in pages] == [()]


@pytest.mark.parametrize(
    "kwargs",
    [{"limit": 0}, {"limit": 1001}, {"limit": "10"}, {"prefix": 5}, {"cursor": 3}],
)
def test_list_locks_refuses_bad_arguments_before_io(no_io, kwargs):
    with pytest.raises(InvalidArgument):
        no_io.list_locks(**kwargs)


# ------------------------------------------------------------------ cleanup
def test_delete_expired_waits_for_the_guard_and_keeps_fences(backend, harness):
    held(harness, "swept:1", "swept:2")
    harness.advance(TTL + guard(harness) - MARGIN)

    assert sum(backend.delete_expired()) == 0

    harness.advance(2 * MARGIN)
    held(harness, "live")
    assert sum(backend.delete_expired()) == 2
    assert listed_keys(all_pages(backend, limit=10)) == ["live"]
    assert backend.acquire("swept:1", TTL).fence == "000000000000002"
    assert backend.acquire("live", TTL).ok is False


def test_delete_expired_dry_run_counts_and_touches_nothing(backend, harness):
    held(harness, "dry:1", "dry:2", "dry:3")
    harness.advance(TTL + guard(harness) + MARGIN)

    assert list(backend.delete_expired(dry_run=True)) == [3]
    assert list(backend.delete_expired(dry_run=True)) == [3]
    assert sum(backend.delete_expired()) == 3
    assert list(backend.delete_expired(dry_run=True)) == [0]


def test_delete_expired_works_in_batches(backend, harness):
    held(harness, *(f"batch:{n}" for n in range(5)))
    harness.advance(TTL + guard(harness) + MARGIN)

    batches = list(backend.delete_expired(batch_size=2))

    assert sum(batches) == 5
    assert max(batches) <= 2
    if not harness.name.startswith("redis"):  # Redis batches are what each SCAN call returns
        assert batches == [2, 2, 1]


@pytest.mark.parametrize("kwargs", [{"batch_size": 0}, {"batch_size": 10_001}, {"dry_run": 1}])
def test_delete_expired_refuses_bad_arguments_when_called_before_io(no_io, kwargs):
    # Raised by the call itself, not at the first next(): a caller that builds the
    # iterator and hands it on learns of the mistake where it made it.
    with pytest.raises(InvalidArgument):
        no_io.delete_expired(**kwargs)


# ------------------------------------------------------------ force release
def test_force_release_needs_the_lock_id_hash_the_operator_saw(backend, harness):
    first = backend.acquire("stuck", TTL)

    assert backend.force_release("stuck", hash_key("someone-else")) == ReleaseResult(
        ok=False, reason="not-found"
    )
    assert backend.is_locked("stuck") is True

    assert backend.force_release("stuck", hash_key(first.lock_id)) == ReleaseResult(ok=True)
    assert backend.is_locked("stuck") is False
    assert backend.release(first.lock_id).ok is False
    assert backend.acquire("stuck", TTL).fence == "000000000000002"


def test_force_release_of_a_key_not_held(backend):
    assert backend.force_release("nothing", hash_key("x")) == ReleaseResult(
        ok=False, reason="not-found"
    )
