"""The lock inspector in a real browser (Debian's Chromium, headless, driven by
Playwright) against the live test server: log in, find a lock that another process
holds (its owner label, and the waiters queued behind it), force-release it; a
screenshot of each step is kept in ``test-artifacts/``."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import override_settings

from django_syncguard import hash_key, owners
from django_syncguard.keys import display_hash
from tests.support.servers import IN_CI

DATABASE_BACKEND = "django_syncguard.backends.database.DatabaseBackend"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
ROOT = Path(__file__).resolve().parent.parent

# The other process: takes the lock through the database backend on the test
# database file, queues two waiters' tickets behind it (patient enough to outlast the
# test: nobody renews them), says so, and holds it until told to let go.
HOLDER = textwrap.dedent(
    """
    import sys
    import django
    from django.conf import settings

    settings.configure(
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": sys.argv[1]}},
        INSTALLED_APPS=["django_syncguard"],
        SYNCGUARD_BACKENDS={"db": {"BACKEND": sys.argv[2]}},
    )
    django.setup()
    from django_syncguard import generate_lock_id, locks
    from django_syncguard.waiting import WaitTicket

    held = locks["db"].acquire("invoice:42", 120_000)
    for _ in range(2):
        ticket = WaitTicket(generate_lock_id(), patience_ms=120_000)
        assert not locks["db"].acquire("invoice:42", 120_000, ticket=ticket).ok
    print(held.fence, flush=True)
    sys.stdin.readline()
    print(locks["db"].release(held.lock_id).ok, flush=True)
    """
)


def browser_available() -> bool:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False
    return os.access(CHROMIUM, os.X_OK)


@pytest.fixture
def chromium(monkeypatch):
    if not browser_available():
        message = "Chromium (apt: chromium) or playwright (pip) is missing"
        if IN_CI:
            pytest.fail(f"CI is set and the browser test cannot run: {message}")
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an event loop in this thread, which makes Django
    # refuse ORM calls here; the test's own ORM calls never overlap the browser's.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "1")
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def holder():
    """Another process holding "invoice:42" on the test database."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(connection.settings_dict["NAME"]), DATABASE_BACKEND],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        fence = process.stdout.readline().strip()
        assert fence == "000000000000001", "the holder process could not take the lock"
        yield process, fence
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_operator_force_releases_a_lock_held_by_another_process(live_server, chromium, holder):
    process, fence = holder
    user = User.objects.create_user("operator", password="secret-pw", is_staff=True)
    user.user_permissions.set(
        Permission.objects.filter(codename__in=["view_lock", "view_lock_key", "force_release_lock"])
    )
    ARTIFACTS.mkdir(exist_ok=True)
    backends = {"db": {"BACKEND": DATABASE_BACKEND}}
    with override_settings(SYNCGUARD_BACKENDS=backends):
        page = chromium.new_page()
        page.goto(f"{live_server.url}/admin/login/?next=/admin/django_syncguard/lock/")
        page.fill("#id_username", "operator")
        page.fill("#id_password", "secret-pw")
        page.click("input[type=submit]")

        row = page.locator("tr.lock-row")
        assert row.count() == 1
        assert row.locator("td.key").inner_text() == "invoice:42"
        # The key's hash keyed with SECRET_KEY (the live server's settings), not hash_key.
        shown = display_hash("invoice:42")
        assert row.locator("td.key-hash").inner_text() == shown
        assert hash_key("invoice:42") not in page.content()
        assert row.locator("td.fence").inner_text() == fence
        # Who holds it: the holder process's label (host, its pid, its thread; no
        # decorated function), and the two waiters queued behind it.
        host = owners.clip(socket.gethostname(), owners.PART_BYTES)
        owner = f"{host}:{process.pid} thread:MainThread -"
        assert row.locator("td.owner").inner_text() == owner
        assert row.locator("td.waiters").inner_text() == "2"
        # Queued by the holder a moment before the page was read (the system clock).
        oldest = row.locator("td.oldest-wait").inner_text()
        assert re.fullmatch(r"\d+\.\d s", oldest) and float(oldest[:-2]) < 60, oldest
        page.screenshot(path=str(ARTIFACTS / "inspector-1-lock-held.png"), full_page=True)

        row.locator("a.force-release").click()
        assert page.locator("h1").inner_text() == "Force-release a lock?"
        assert page.locator("li", has_text="Key hash:").inner_text() == f"Key hash: {shown}"
        page.fill("#id_reason", "holder process is wedged")
        page.screenshot(path=str(ARTIFACTS / "inspector-2-confirm.png"), full_page=True)
        page.click("input[type=submit]")

        success = page.locator("ul.messagelist li.success")
        assert success.inner_text() == f"Lock {shown} force-released."
        # The forced lock is gone. A force-release is a release: the key went to the
        # first of the two waiters (a grant, with the next fence), which nobody claims
        # here (those waiters are only tickets), so it is listed until it lapses a
        # second later: the page may come before or after that.
        fences = page.locator("tr.lock-row td.fence").all_inner_texts()
        assert fences in ([], ["000000000000002"])
        page.screenshot(path=str(ARTIFACTS / "inspector-3-released.png"), full_page=True)

    # The holder learns it lost the lock when it tries to release it.
    out, _ = process.communicate("\n", timeout=30)
    assert out.strip() == "False"
