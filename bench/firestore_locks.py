"""Acquire+release cycles on the Firestore emulator, next to a bare transaction.

    .venv/bin/python bench/firestore_locks.py [--seconds 6] [--rounds 3]

Starts the Firestore emulator on a free loopback port and measures, side by side:

- ``syncguard``: ``FirestoreBackend.acquire`` + ``release``;
- ``bare transaction``: one transaction that reads two documents (a lock and a
  counter) and writes both, then a plain delete of the lock document: what a lock
  with a fence counter costs at the least, without any lock semantics (no liveness,
  no ownership check, no lock-id resolution). Its failed commits are counted.

for 1 client, 8 threads and 4 processes, distinct keys and one shared key.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import MethodFactory, machine, print_table, run_matrix  # noqa: E402
from tests.support.servers import FirestoreEmulator  # noqa: E402

OPTIONS = {"PROJECT": "bench", "COLLECTION": "locks", "FENCE_COLLECTION": "fences"}


def syncguard(host: str) -> MethodFactory:
    os.environ["FIRESTORE_EMULATOR_HOST"] = host
    from django_syncguard.backends.firestore import FirestoreBackend

    backend = FirestoreBackend("bench", {"OPTIONS": OPTIONS})

    def factory(client: int):
        def acquire(key: str):
            result = backend.acquire(key, 30_000)
            return result.lock_id if result.ok else None

        return acquire, backend.release

    return factory


def bare(host: str) -> MethodFactory:
    os.environ["FIRESTORE_EMULATOR_HOST"] = host
    from google.cloud import firestore

    client = firestore.Client(project="bench")
    locks, counters = client.collection("bare_locks"), client.collection("bare_counters")

    def factory(n: int):
        def acquire(key: str):
            lock_ref, counter_ref = locks.document(key), counters.document(key)

            @firestore.transactional
            def work(tx):
                snaps = list(tx.get_all([lock_ref, counter_ref]))
                value = sum(1 for s in snaps if s.exists)
                tx.set(counter_ref, {"fence": value + 1})
                tx.set(lock_ref, {"lockId": "x" * 22, "expiresAtMs": 0})

            work(client.transaction(max_attempts=1))  # a failed commit counts as an error
            return lock_ref

        return acquire, lambda ref: ref.delete()

    return factory


METHODS = {"syncguard": syncguard, "bare transaction": bare}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="per method and scenario")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per scenario")
    parser.add_argument("--modes", default="1 client,8 threads,4 processes")
    args = parser.parse_args()
    emulator = FirestoreEmulator().start()
    try:
        import google.cloud.firestore as firestore

        print(
            f"# Firestore lock benchmark\n\n{machine()}; Firestore emulator (gcloud) on "
            f"127.0.0.1; google-cloud-firestore {firestore.__version__}; "
            f"{args.seconds:g} s per method and scenario, in {args.rounds} rounds. "
            "attempts/s minus cycles/s are contended or failed attempts."
        )
        rows = run_matrix(METHODS, emulator.host, args.modes, args.rounds, args.seconds)
        print_table("acquire + release cycles", rows, args.seconds, baseline="bare transaction")
    finally:
        emulator.destroy()


if __name__ == "__main__":
    os.environ.pop("DJANGO_SETTINGS_MODULE", None)
    main()
