"""The Firestore backend: compare-and-swap locks, with Firestore's own clock.

Settings name ``django_syncguard.backends.firestore.FirestoreBackend``. The package,
one module per concern:

- ``backend.py``: ``FirestoreBackend``, the operations (guarded batches) and the
  housekeeping;
- ``documents.py``: the layout of lock documents, their queues and fence counters;
- ``client.py``: ``FirestoreClients``, which builds and closes the clients, the
  mapping of the library's errors to ``LockError``, and the only code that touches
  google-cloud-firestore's private attributes;
- ``wakeups.py``: ``FirestoreWakeUps``, one Listen stream per backend and process.

See ``specs/backends/firestore.md``.
"""

from .backend import I020, FirestoreBackend, validate_collection
from .client import FirestoreClients, map_firestore_error
from .documents import document_id, purge_at, server_ms

__all__ = [
    "I020",
    "FirestoreBackend",
    "FirestoreClients",
    "document_id",
    "map_firestore_error",
    "purge_at",
    "server_ms",
    "validate_collection",
]
