"""The admin lock inspector through Django's test client: permissions, what a page
shows and hides, pagination, and the force-release action with its audit entry."""

from __future__ import annotations

import os
import re
import socket
import threading
import uuid

import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.auth.models import Permission, User
from django.test import override_settings

from django_syncguard import hash_key, lock, locks, owners
from django_syncguard.keys import display_hash
from django_syncguard.liveness import FakeClock
from django_syncguard.signals import lock_force_released
from django_syncguard.waiting import WaitTicket
from tests.support.faults import wait_until

INSPECTOR = "/admin/django_syncguard/lock/"
TTL = 60_000
pytestmark = pytest.mark.django_db


@pytest.fixture
def memory_alias():
    """A fresh memory store as the only lock alias."""
    store = f"admin-{uuid.uuid4().hex}"
    config = {
        "BACKEND": "django_syncguard.backends.memory.MemoryBackend",
        "LOCATION": store,
        "OPTIONS": {"CLOCK": FakeClock()},
    }
    with override_settings(SYNCGUARD_BACKENDS={"default": config}):
        yield locks["default"]
        locks["default"].reset()


def staff(*codenames: str) -> User:
    user = User.objects.create_user(f"staff-{uuid.uuid4().hex[:8]}", password="pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(
            content_type__app_label="django_syncguard", codename__in=codenames
        )
    )
    return user


@pytest.fixture
def as_user(client):
    def login(*codenames: str):
        client.force_login(staff(*codenames))
        return client

    return login


def force_release_links(html: str) -> list[str]:
    return re.findall(r'href="(/admin/django_syncguard/lock/force-release/[^"]+/)"', html)


# -------------------------------------------------------------- permissions
def test_anonymous_users_are_sent_to_the_login_page(client, memory_alias):
    response = client.get(INSPECTOR)

    assert response.status_code == 302
    assert response["Location"] == f"/admin/login/?next={INSPECTOR}"


def test_staff_without_view_permission_is_forbidden(as_user, memory_alias):
    assert as_user().get(INSPECTOR).status_code == 403


def test_view_permission_shows_hashes_fences_and_remaining_time_but_no_raw_data(
    as_user, memory_alias
):
    held = memory_alias.acquire("invoice:42", TTL)
    memory_alias.clock.advance(17_700)

    response = as_user("view_lock").get(INSPECTOR)

    html = response.content.decode()
    assert response.status_code == 200
    # The key by its display hash (keyed with SECRET_KEY), not hash_key's, which
    # anyone could match by hashing guesses.
    assert f'<td class="key-hash"><code>{display_hash("invoice:42")}</code></td>' in html
    assert hash_key("invoice:42") not in html
    assert held.fence in html
    assert '<td class="remaining">42.3 s</td>' in html
    assert "invoice:42" not in html
    assert held.lock_id not in html
    assert force_release_links(html) == []
    assert "1 lock on this page." in html


def test_key_permission_shows_raw_keys(as_user, memory_alias):
    memory_alias.acquire("invoice:42", TTL)

    html = as_user("view_lock", "view_lock_key").get(INSPECTOR).content.decode()

    assert '<td class="key">invoice:42</td>' in html


def test_the_inspector_appears_in_the_admin_index_for_viewers_only(as_user, memory_alias):
    assert (
        'href="/admin/django_syncguard/lock/"'
        in as_user("view_lock").get("/admin/").content.decode()
    )


def test_force_release_needs_its_own_permission(as_user, memory_alias):
    memory_alias.acquire("invoice:42", TTL)
    viewer = as_user("view_lock", "force_release_lock")
    link = force_release_links(viewer.get(INSPECTOR).content.decode())[0]

    no_right = as_user("view_lock")  # same browser session, another user
    assert no_right.get(link).status_code == 403
    assert no_right.post(link, {"reason": "x"}).status_code == 403
    assert memory_alias.is_locked("invoice:42") is True


# ------------------------------------------------------------ force release
def test_force_release_asks_for_confirmation_and_a_reason_then_logs_it(as_user, memory_alias):
    held = memory_alias.acquire("invoice:42", TTL)
    client = as_user("view_lock", "force_release_lock")
    link = force_release_links(client.get(INSPECTOR).content.decode())[0]
    sent = []

    def receiver(sender, **kwargs):
        sent.append(kwargs)

    confirm = client.get(link)
    assert confirm.status_code == 200
    assert "Yes, force-release it" in confirm.content.decode()
    assert memory_alias.is_locked("invoice:42") is True

    missing = client.post(link, {"reason": "  "})
    assert "Say why" in missing.content.decode()
    assert memory_alias.is_locked("invoice:42") is True

    lock_force_released.connect(receiver)
    try:
        done = client.post(link, {"reason": "worker host died"}, follow=True)
    finally:
        lock_force_released.disconnect(receiver)

    assert memory_alias.is_locked("invoice:42") is False
    key_hash = display_hash("invoice:42")
    assert f"Lock {key_hash} force-released." in done.content.decode()
    assert hash_key("invoice:42") not in done.content.decode()
    entry = LogEntry.objects.get()
    assert entry.action_flag == DELETION
    assert entry.object_id == key_hash
    assert entry.object_repr == f"lock {key_hash} on 'default' (fence {held.fence})"
    assert entry.change_message == "Force-released. Reason: worker host died"
    assert entry.user.has_perm("django_syncguard.force_release_lock")
    assert sent == [
        {
            "signal": lock_force_released,
            "alias": "default",
            "key_hash": key_hash,
            "lock_id_hash": display_hash(held.lock_id),
            "fence": held.fence,
            "user": entry.user.get_username(),
            "reason": "worker host died",
        }
    ]


def test_force_release_never_touches_a_newer_holder(as_user, memory_alias):
    first = memory_alias.acquire("invoice:42", TTL)
    client = as_user("view_lock", "force_release_lock")
    link = force_release_links(client.get(INSPECTOR).content.decode())[0]
    memory_alias.release(first.lock_id)
    second = memory_alias.acquire("invoice:42", TTL)

    page = client.post(link, {"reason": "stuck"}, follow=True).content.decode()

    assert "was no longer held by the holder you saw" in page
    assert memory_alias.lookup(key="invoice:42").fence == second.fence
    assert LogEntry.objects.count() == 0


def test_unknown_token_sends_back_to_the_inspector(as_user, memory_alias):
    response = as_user("view_lock", "force_release_lock").post(
        f"{INSPECTOR}force-release/made-up/", {"reason": "x"}
    )

    assert response.status_code == 302
    assert response["Location"] == INSPECTOR


def test_add_change_and_delete_are_not_offered(as_user, memory_alias):
    client = as_user("view_lock", "force_release_lock")

    assert client.get(f"{INSPECTOR}add/").status_code == 404
    assert client.get(f"{INSPECTOR}anything/change/").status_code == 404


# ---------------------------------------------------- pages, aliases, errors
def test_pages_follow_next_links_through_every_lock(as_user, memory_alias):
    for n in range(250):
        memory_alias.acquire(f"job:{n:03d}", TTL)
    client = as_user("view_lock", "view_lock_key")

    seen, url, sizes = [], INSPECTOR, []
    while url:
        html = client.get(url).content.decode()
        keys = re.findall(r'<td class="key">([^<]+)</td>', html)
        seen += keys
        sizes.append(len(keys))
        found = re.search(r'<a class="next-page" href="([^"]+)"', html)
        url = INSPECTOR + found.group(1).replace("&amp;", "&") if found else None

    assert sizes == [100, 100, 50]
    assert seen == [f"job:{n:03d}" for n in range(250)]


def test_prefix_filter(as_user, memory_alias):
    for key in ("invoice:1", "invoice:2", "order:1"):
        memory_alias.acquire(key, TTL)

    html = as_user("view_lock", "view_lock_key").get(INSPECTOR, {"q": "invoice:"}).content.decode()

    assert re.findall(r'<td class="key">([^<]+)</td>', html) == ["invoice:1", "invoice:2"]


@pytest.mark.django_db(transaction=True)
def test_every_alias_can_be_inspected(as_user):
    backends = {
        "default": {"BACKEND": "django_syncguard.backends.memory.MemoryBackend", "LOCATION": "a"},
        "db": {"BACKEND": "django_syncguard.backends.database.DatabaseBackend"},
    }
    with override_settings(SYNCGUARD_BACKENDS=backends):
        locks["default"].acquire("in-memory", TTL)
        locks["db"].acquire("in-database", TTL)
        client = as_user("view_lock", "view_lock_key")

        memory_page = client.get(INSPECTOR).content.decode()
        database_page = client.get(INSPECTOR, {"alias": "db"}).content.decode()
        locks["default"].reset()

    assert re.findall(r'<td class="key">([^<]+)</td>', memory_page) == ["in-memory"]
    assert re.findall(r'<td class="key">([^<]+)</td>', database_page) == ["in-database"]
    assert '<option value="db" selected>db</option>' in database_page
    assert (
        'sqlite backend, client time, <span class="fences">counter fences, floor 0</span>.'
        in database_page
    )


def test_the_page_shows_the_aliases_fence_mode_and_floor(as_user):
    backends = {
        "clocked": {
            "BACKEND": "django_syncguard.backends.memory.MemoryBackend",
            "LOCATION": "fences-page",
            "OPTIONS": {"FENCES": "clock"},
        }
    }
    with override_settings(SYNCGUARD_BACKENDS=backends):
        locks["clocked"].raise_fence_floor(1234)
        page = as_user("view_lock").get(INSPECTOR).content.decode()
        locks["clocked"].reset()
    assert '<span class="fences">clock fences, floor 1234</span>' in page


def test_an_unreachable_backend_is_reported_on_the_page(as_user):
    down = {
        "BACKEND": "django_syncguard.backends.redis.RedisBackend",
        "LOCATION": "redis://127.0.0.1:1/0",
        "OPTIONS": {"CONNECT_TIMEOUT_MS": 500},
    }
    with override_settings(SYNCGUARD_BACKENDS={"down": down}):
        response = as_user("view_lock").get(INSPECTOR)

    html = response.content.decode()
    assert response.status_code == 200
    assert "The &#x27;down&#x27; backend could not be listed: Redis (&#x27;down&#x27;):" in html


def test_without_the_key_permission_the_key_filter_tells_nothing(as_user, memory_alias):
    # Keys that name people: the filter must not answer "customer:a..." one character
    # at a time to someone who may not see keys.
    memory_alias.acquire("customer:alice", TTL)
    memory_alias.acquire("customer:bob", TTL)
    client = as_user("view_lock")

    pages = [client.get(INSPECTOR, {"q": q}).content.decode() for q in ("customer:a", "zzz", "")]

    assert 'name="q"' not in pages[2]  # no filter offered
    hashes = [sorted(re.findall(r"[0-9a-f]{24}", page)) for page in pages]
    assert hashes[0] == hashes[1] == hashes[2]  # every query shows every lock
    assert len(set(hashes[0])) >= 2
    assert all("customer:" not in page for page in pages)
    assert all("2 locks on this page." in page for page in pages)


def test_without_the_key_permission_no_page_tells_anything_about_keys(
    as_user, memory_alias, caplog
):
    """The list (with and without a filter), the confirmation pages, the messages of
    both outcomes and the admin index's recent actions: no key, no key's hash_key
    (which hashing guesses would match), no lock id nor its hash_key appears; a key is
    only ever its display hash."""
    alice, bob = "customer:alice@example.com", "customer:bob@example.com"
    holders = [memory_alias.acquire(alice, TTL), memory_alias.acquire(bob, TTL)]
    client = as_user("view_lock", "force_release_lock")
    listing = client.get(INSPECTOR).content.decode()
    filtered = client.get(INSPECTOR, {"q": "customer:alice"}).content.decode()
    links = force_release_links(listing)  # alice's, then bob's (key order)
    confirmations = [client.get(link).content.decode() for link in links]
    released = client.post(links[0], {"reason": "gone"}, follow=True).content.decode()
    memory_alias.release(holders[1].lock_id)
    holders.append(memory_alias.acquire(bob, TTL))  # a newer holder: nothing released
    refused = client.post(links[1], {"reason": "gone"}, follow=True).content.decode()
    index = client.get("/admin/").content.decode()  # recent actions

    shown = {alice: display_hash(alice), bob: display_hash(bob)}
    secrets = {"customer:", "alice@", "bob@"}
    secrets |= {hash_key(alice), hash_key(bob)}
    secrets |= {held.lock_id for held in holders} | {hash_key(held.lock_id) for held in holders}
    pages = [listing, filtered, *confirmations, released, refused, index]
    for page in pages:
        assert [secret for secret in secrets if secret in page] == []
        hashes = set(re.findall(r"(?<![0-9a-f])[0-9a-f]{24}(?![0-9a-f])", page))
        assert hashes <= set(shown.values())
    assert 'name="q"' not in listing
    row_hashes = re.findall(r'<td class="key-hash"><code>([0-9a-f]{24})</code></td>', listing)
    assert sorted(row_hashes) == sorted(shown.values())
    assert re.findall(r'<td class="key-hash"><code>([0-9a-f]{24})</code></td>', filtered) == (
        row_hashes
    )
    for confirmation, key in zip(confirmations, (alice, bob), strict=True):
        assert f"<li>Key hash: <code>{shown[key]}</code></li>" in confirmation
    assert f"Lock {shown[alice]} force-released." in released
    assert f"Lock {shown[bob]} was no longer held by the holder you saw" in refused
    assert f"lock {shown[alice]} on &#x27;default&#x27;" in index
    # The operators' log line too.
    [line] = [r.getMessage() for r in caplog.records if r.name == "django_syncguard.inspector"]
    assert line.startswith(f"Lock {shown[alice]} on 'default' force-released by staff-")


# ------------------------------------------------------------ owners, waiters
def cells(html: str, name: str) -> list[str]:
    """The text of every ``<td class="name">`` cell, in row order."""
    return re.findall(rf'<td class="{name}">(.*?)</td>', html)


def owner_of_this_thread() -> str:
    host = owners.clip(socket.gethostname(), owners.PART_BYTES)
    return f"{host}:{os.getpid()} thread:{threading.current_thread().name} -"


def test_the_page_shows_owners_waiters_and_the_oldest_wait(as_user, memory_alias):
    held = memory_alias.acquire("invoice:7", TTL)
    memory_alias.acquire("invoice:8", TTL)
    # A real waiter: lock() in a thread, queued behind the holder of invoice:7.
    done = threading.Event()
    waiter = threading.Thread(
        target=lambda: lock(done.set, key="invoice:7", using=memory_alias, timeout_ms=60_000),
        daemon=True,
    )
    waiter.start()
    try:
        wait_until(lambda: memory_alias.queue_stats(["invoice:7"]) != {}, 30, "the waiter queues")
        memory_alias.clock.advance(1_500)

        html = as_user("view_lock").get(INSPECTOR).content.decode()
    finally:
        memory_alias.release(held.lock_id)
        waiter.join(30)
    assert done.is_set()
    assert cells(html, "owner") == [f"<code>{owner_of_this_thread()}</code>"] * 2
    assert cells(html, "waiters") == ["1", "0"]  # invoice:7, invoice:8
    assert cells(html, "oldest-wait") == ["1.5 s", "\u2014"]


def test_without_recorded_owners_or_queues_the_cells_say_so(as_user):
    backends = {
        "default": {
            "BACKEND": "django_syncguard.backends.memory.MemoryBackend",
            "LOCATION": f"admin-{uuid.uuid4().hex}",
            "OPTIONS": {"RECORD_OWNER": False, "WAKE_UPS": False},
        }
    }
    with override_settings(SYNCGUARD_BACKENDS=backends):
        locks["default"].acquire("invoice:9", TTL)
        html = as_user("view_lock").get(INSPECTOR).content.decode()
        locks["default"].reset()
    assert cells(html, "owner") == ["\u2014"]
    assert cells(html, "waiters") == ["\u2014"]  # no queues: nothing to count
    assert cells(html, "oldest-wait") == ["\u2014"]


@pytest.mark.django_db(transaction=True)  # the release below must not wait for the test's
def test_the_database_alias_shows_owners_and_waiter_counts(as_user):
    backends = {"db": {"BACKEND": "django_syncguard.backends.database.DatabaseBackend"}}
    key = f"owned:{uuid.uuid4().hex}"
    with override_settings(SYNCGUARD_BACKENDS=backends):
        backend = locks["db"]
        held = backend.acquire(key, TTL)
        try:
            backend.acquire(key, TTL, ticket=WaitTicket.new())  # a queued waiter
            client = as_user("view_lock", "view_lock_key")
            html = client.get(INSPECTOR, {"alias": "db", "q": key}).content.decode()
        finally:
            backend.release(held.lock_id)
    assert cells(html, "owner") == [f"<code>{owner_of_this_thread()}</code>"]
    assert cells(html, "waiters") == ["1"]
    # By the system clock (SQLite's time authority): queued an instant ago.
    [oldest] = cells(html, "oldest-wait")
    assert re.fullmatch(r"\d+\.\d s", oldest) and float(oldest[:-2]) < 30, oldest
