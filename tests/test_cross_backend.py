"""One scripted scenario, the same sequence of outcomes on every backend."""

from __future__ import annotations

import hashlib
import unicodedata

from django_syncguard import generate_lock_id

F = {n: f"{n:015d}" for n in range(1, 8)}  # F[1] == "000000000000001"
COMPOSED, DECOMPOSED = "caf\u00e9", "cafe\u0301"  # one lock: keys are NFC normalised


def sha24(text: str) -> str:
    """The contract's key and lock-id hash: SHA-256 of the NFC UTF-8, 24 hex chars."""
    return hashlib.sha256(unicodedata.normalize("NFC", text).encode()).hexdigest()[:24]


H = {key: sha24(key) for key in ("a", "b", "c", COMPOSED)}

# (step, outcome): outcome is what every backend must answer, normalized to plain
# values (ok flags, fences, reasons, booleans) so that the sequences compare exactly.
# A lookup is shown as (fence, key hash, which acquisition its lock id hash names,
# expires_at_ms - acquired_at_ms, i.e. the TTL); lock ids are random, so "a#1" stands
# for the lock id of the acquisition of "a" that got fence 1. Locks that must outlive
# several steps take 10 s: real time passes on the server backends.
EXPECTED = [
    ("acquire a", (True, F[1])),
    ("acquire a again", (False, "locked")),
    ("is_locked a", True),
    ("lookup a by key", (F[1], H["a"], "a#1", 1_000)),
    ("extend a to 5 s", True),
    ("lookup a by id: expiry is extend's, acquisition kept", (F[1], H["a"], "a#1", True, True)),
    ("lookup_raw a by key: key, lock id", ("a", "a#1")),
    ("acquire b for 1 s", (True, F[1])),
    ("2.5 s later: is_locked a", True),
    ("is_locked b", False),
    ("lookup b by old id", None),
    ("lookup b by key", None),
    ("acquire b", (True, F[2])),
    ("lookup b by key", (F[2], H["b"], "b#2", 10_000)),
    ("lookup b by old id", None),
    ("release old b", (False, "not-found")),
    ("extend old b", False),
    ("release a", (True, None)),
    ("is_locked a after release", False),
    ("release a again", (False, "not-found")),
    ("lookup a by key", None),
    ("lookup a by id", None),
    ("release unknown id", (False, "not-found")),
    ("acquire a", (True, F[2])),
    ("lookup a by id", (F[2], H["a"], "a#2", 10_000)),
    ("acquire composed café", (True, F[1])),
    ("acquire decomposed café", (False, "locked")),
    ("is_locked decomposed café", True),
    ("lookup_raw decomposed café: key, lock id", (COMPOSED, "café#1")),
    ("lookup decomposed café", (F[1], H[COMPOSED], "café#1", 10_000)),
    ("release café", (True, None)),
    # Five holders of c in turn, each contended once while it holds the key.
    (
        "c: fences, contended attempts, releases",
        ([F[n] for n in range(1, 6)], [(False, "locked")] * 5, [True] * 5),
    ),
    ("is_locked c after the releases", False),
    ("acquire c", (True, F[6])),
    ("lookup c by key", (F[6], H["c"], "c#6", 10_000)),
    ("release b, a, c", [True, True, True]),
    ("is_locked a, b, c", [False, False, False]),
]


def run_scenario(backend, harness) -> list[tuple[str, object]]:
    out: list[tuple[str, object]] = []
    ids: dict[str, str] = {}  # lock id hash -> "key#fence"

    def acquired(step, result, key):
        out.append((step, (result.ok, result.fence if result.ok else result.reason)))
        if result.ok:
            ids[sha24(result.lock_id)] = f"{unicodedata.normalize('NFC', key)}#{int(result.fence)}"
        return result

    def released(step, result):
        out.append((step, (result.ok, result.reason)))

    def looked_up(step, info):
        if info is None:
            out.append((step, None))
            return
        lock = ids.get(info.lock_id_hash, "unknown")
        out.append(
            (step, (info.fence, info.key_hash, lock, info.expires_at_ms - info.acquired_at_ms))
        )

    a = acquired("acquire a", backend.acquire("a", 1_000), "a")
    acquired("acquire a again", backend.acquire("a", 1_000), "a")
    out.append(("is_locked a", backend.is_locked("a")))
    before = backend.lookup(key="a")
    looked_up("lookup a by key", before)
    # a's 1 s lease (2 s with the tolerance) runs in real time on the server backends:
    # extend it before any further step.
    extended = backend.extend(a.lock_id, 5_000)
    out.append(("extend a to 5 s", extended.ok))
    after = backend.lookup(lock_id=a.lock_id)
    out.append(
        (
            "lookup a by id: expiry is extend's, acquisition kept",
            (
                after.fence,
                after.key_hash,
                ids.get(after.lock_id_hash, "unknown"),
                after.expires_at_ms == extended.expires_at_ms,
                after.acquired_at_ms == before.acquired_at_ms,
            ),
        )
    )
    raw = backend.lookup_raw(key="a")
    out.append(("lookup_raw a by key: key, lock id", (raw.key, ids[sha24(raw.lock_id)])))
    old_b = acquired("acquire b for 1 s", backend.acquire("b", 1_000), "b")
    harness.advance(2_500)
    out.append(("2.5 s later: is_locked a", backend.is_locked("a")))
    out.append(("is_locked b", backend.is_locked("b")))
    looked_up("lookup b by old id", backend.lookup(lock_id=old_b.lock_id))
    looked_up("lookup b by key", backend.lookup(key="b"))
    b = acquired("acquire b", backend.acquire("b", 10_000), "b")
    looked_up("lookup b by key", backend.lookup(key="b"))
    looked_up("lookup b by old id", backend.lookup(lock_id=old_b.lock_id))
    # Whether an expired lock's id is still on record ("expired") or already gone
    # ("not-found") differs by backend; here b was replaced, so every backend says gone.
    released("release old b", backend.release(old_b.lock_id))
    out.append(("extend old b", backend.extend(old_b.lock_id, 1_000).ok))
    released("release a", backend.release(a.lock_id))
    out.append(("is_locked a after release", backend.is_locked("a")))
    released("release a again", backend.release(a.lock_id))
    looked_up("lookup a by key", backend.lookup(key="a"))
    looked_up("lookup a by id", backend.lookup(lock_id=a.lock_id))
    released("release unknown id", backend.release(generate_lock_id()))
    a = acquired("acquire a", backend.acquire("a", 10_000), "a")
    looked_up("lookup a by id", backend.lookup(lock_id=a.lock_id))

    cafe = acquired("acquire composed café", backend.acquire(COMPOSED, 10_000), COMPOSED)
    acquired("acquire decomposed café", backend.acquire(DECOMPOSED, 1_000), DECOMPOSED)
    out.append(("is_locked decomposed café", backend.is_locked(DECOMPOSED)))
    raw = backend.lookup_raw(key=DECOMPOSED)
    out.append(("lookup_raw decomposed café: key, lock id", (raw.key, ids[sha24(raw.lock_id)])))
    looked_up("lookup decomposed café", backend.lookup(key=DECOMPOSED))
    released("release café", backend.release(cafe.lock_id))

    fences, contended, releases = [], [], []
    for _ in range(5):
        held = backend.acquire("c", 1_000)
        fences.append(held.fence)
        again = backend.acquire("c", 1_000)
        contended.append((again.ok, again.reason))
        releases.append(backend.release(held.lock_id).ok)
    out.append(("c: fences, contended attempts, releases", (fences, contended, releases)))
    out.append(("is_locked c after the releases", backend.is_locked("c")))
    c = acquired("acquire c", backend.acquire("c", 10_000), "c")
    looked_up("lookup c by key", backend.lookup(key="c"))
    out.append(("release b, a, c", [backend.release(r.lock_id).ok for r in (b, a, c)]))
    out.append(("is_locked a, b, c", [backend.is_locked(k) for k in ("a", "b", "c")]))
    return out


def test_every_backend_gives_the_same_outcomes(backend, harness):
    assert run_scenario(backend, harness) == EXPECTED
