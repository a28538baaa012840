"""One scripted scenario, the same sequence of outcomes on every backend."""

from __future__ import annotations

from django_syncguard import generate_lock_id

# (step, outcome): outcome is what every backend must answer, normalized to plain
# values (ok flags, fences, reasons, booleans) so that the sequences compare exactly.
EXPECTED = [
    ("acquire a", (True, "000000000000001")),
    ("acquire a again", (False, "locked")),
    ("is_locked a", True),
    ("lookup a by key", "000000000000001"),
    ("extend a to 5 s", True),
    ("acquire b for 1 s", (True, "000000000000001")),
    ("2.5 s later: is_locked a", True),
    ("is_locked b", False),
    ("lookup b by old id", None),
    ("acquire b", (True, "000000000000002")),
    ("release old b", (False, "not-found")),
    ("extend old b", False),
    ("release a", (True, None)),
    ("release a again", (False, "not-found")),
    ("lookup a by key", None),
    ("release unknown id", (False, "not-found")),
    ("acquire a", (True, "000000000000002")),
]


def run_scenario(backend, harness) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []

    def acquired(step, result):
        out.append((step, (result.ok, result.fence if result.ok else result.reason)))
        return result

    def released(step, result):
        out.append((step, (result.ok, result.reason)))

    a = acquired("acquire a", backend.acquire("a", 1_000))
    acquired("acquire a again", backend.acquire("a", 1_000))
    out.append(("is_locked a", backend.is_locked("a")))
    out.append(("lookup a by key", backend.lookup(key="a").fence))
    out.append(("extend a to 5 s", backend.extend(a.lock_id, 5_000).ok))
    old_b = acquired("acquire b for 1 s", backend.acquire("b", 1_000))
    harness.advance(2_500)
    out.append(("2.5 s later: is_locked a", backend.is_locked("a")))
    out.append(("is_locked b", backend.is_locked("b")))
    out.append(("lookup b by old id", backend.lookup(lock_id=old_b.lock_id)))
    acquired("acquire b", backend.acquire("b", 1_000))
    # Whether an expired lock's id is still on record ("expired") or already gone
    # ("not-found") differs by backend; here b was replaced, so every backend says gone.
    released("release old b", backend.release(old_b.lock_id))
    out.append(("extend old b", backend.extend(old_b.lock_id, 1_000).ok))
    released("release a", backend.release(a.lock_id))
    released("release a again", backend.release(a.lock_id))
    out.append(("lookup a by key", backend.lookup(key="a")))
    released("release unknown id", backend.release(generate_lock_id()))
    acquired("acquire a", backend.acquire("a", 1_000))
    return out


def test_every_backend_gives_the_same_outcomes(backend, harness):
    assert run_scenario(backend, harness) == EXPECTED
