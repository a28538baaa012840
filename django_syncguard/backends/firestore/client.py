"""The Firestore backend's client layer: clients, error mapping, and the library's internals.

:class:`FirestoreClients` builds the backend's clients (the synchronous one, built
again in a forked child, and one ``AsyncClient`` per event loop) and closes them.
This is the only module that touches private attributes of google-cloud-firestore;
each sits behind one small function named for what it gives, and
``tests/test_firestore_backend.py`` checks that the installed library still has
every one of them (:data:`PRIVATE_ATTRIBUTES`), so an upgrade that removes one fails
loudly. The library is imported lazily: the package imports without the extra.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from collections.abc import Mapping
from functools import partial
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from ...errors import (
    AuthFailed,
    Internal,
    InvalidArgument,
    LockError,
    NetworkTimeout,
    RateLimited,
    ServiceUnavailable,
)
from ..event_loops import close_on_loop

#: The private names of google-cloud-firestore used here, and where each lives.
PRIVATE_ATTRIBUTES = (
    ("Client._firestore_api", "the generated (GAPIC) client of a client"),
    ("transport._wrapped_methods", "the transport's per-method retry and timeout"),
    ("transport.listen", "the bare Listen stub (a public name on a private object)"),
    ("Client._rpc_metadata", "the request metadata a client sends"),
    ("Client._database_string", "the database's resource name"),
    ("DocumentReference._document_path", "a document's resource name"),
    ("firestore_v1._helpers.decode_dict", "decodes a document's fields from protobuf"),
)


def _firestore() -> Any:
    """``google.cloud.firestore``, imported on first use (the ``firestore`` extra)."""
    try:
        import google.cloud.firestore as firestore
    except ImportError as exc:
        raise ImproperlyConfigured(
            "The Firestore lock backend needs google-cloud-firestore: "
            'pip install "django-syncguard[firestore]".'
        ) from exc
    return firestore


# ------------------------------------------------------------------ errors
def map_firestore_error(exc: BaseException, alias: str) -> LockError:
    """The ``LockError`` for a google-api-core / google-auth exception."""
    from google.api_core import exceptions as api

    message = f"Firestore ({alias!r}): {exc}"
    table: tuple[tuple[Any, type[LockError]], ...] = (
        ((api.DeadlineExceeded, api.RetryError), NetworkTimeout),
        ((api.ServiceUnavailable, api.InternalServerError, api.Aborted), ServiceUnavailable),
        ((api.PermissionDenied, api.Unauthenticated), AuthFailed),
        ((api.InvalidArgument, api.FailedPrecondition), InvalidArgument),
        ((api.ResourceExhausted, api.TooManyRequests), RateLimited),
    )
    error_cls = next((cls for types, cls in table if isinstance(exc, types)), Internal)
    try:
        from google.auth.exceptions import DefaultCredentialsError

        if isinstance(exc, DefaultCredentialsError):
            error_cls = AuthFailed
    except ImportError:  # pragma: no cover - google-auth comes with the client
        pass
    return error_cls(message, context={"cause": exc})


def mapped_error(exc: Exception, alias: str) -> Exception:
    """The exception to raise for ``exc``: a ``LockError`` for the library's errors,
    ``exc`` itself for anything else."""
    from google.api_core.exceptions import GoogleAPIError

    if isinstance(exc, LockError):
        return exc
    if isinstance(exc, GoogleAPIError) or type(exc).__module__.startswith(("google.", "grpc")):
        return map_firestore_error(exc, alias)
    return exc


def guard_failed(error: LockError) -> bool:
    """Whether a commit failed only because a precondition did not hold."""
    from google.api_core.exceptions import AlreadyExists, Conflict, FailedPrecondition

    return isinstance(error.context.get("cause"), FailedPrecondition | AlreadyExists | Conflict)


def outcome_unknown(error: LockError) -> bool:
    """Whether a commit failed with ``Cancelled``: we never cancel a commit, but the
    emulator answers so for a write it *applied* when a Listen call watching the
    document went away meanwhile (a watcher's process killed, a channel closed). The
    caller reads again to learn what happened."""
    from google.api_core.exceptions import Cancelled

    return isinstance(error.context.get("cause"), Cancelled)


# ------------------------------------------------- the library's private parts
def _transport(client: Any) -> Any:
    """The gRPC transport under ``client`` (its generated client's own)."""
    return client._firestore_api.transport


def bound_every_call(client: Any, timeout_s: float, *, asynchronous: bool = False) -> None:
    """Give every RPC of ``client`` no retries and ``timeout_s``.

    The generated client retries most calls for up to 60 s by default, and some calls
    take no per-call settings, so the defaults are replaced once, on the transport.
    """
    from google.api_core import gapic_v1

    wrap = gapic_v1.method_async.wrap_method if asynchronous else gapic_v1.method.wrap_method
    wrapped = _transport(client)._wrapped_methods
    for method in list(wrapped):
        wrapped[method] = wrap(method, default_retry=None, default_timeout=timeout_s)


def listen_stub(client: Any) -> Any:
    """The transport's bare Listen stub: the client's wrapped method would put the
    operation timeout on a stream that must stay open."""
    return _transport(client).listen


def rpc_metadata(client: Any) -> Any:
    """The request metadata ``client`` sends with each call (database routing)."""
    return client._rpc_metadata


def database_string(client: Any) -> str:
    """The resource name of ``client``'s database (``projects/p/databases/d``)."""
    name: str = client._database_string
    return name


def document_name(reference: Any) -> str:
    """The full resource name of a document reference."""
    name: str = reference._document_path
    return name


def decode_fields(fields: Any, client: Any) -> Any:
    """A document's protobuf fields as Python values, as the client decodes them."""
    from google.cloud.firestore_v1 import _helpers

    return _helpers.decode_dict(fields, client)


def close_channel(client: Any) -> Any:
    """Close ``client``'s gRPC channel (``Client.close`` leaves it open); for an
    ``AsyncClient``, the coroutine that closes it."""
    return _transport(client).close()


# ------------------------------------------------------------------ clients
class FirestoreClients:
    """The clients of one backend object, built from its alias's settings.

    ``options`` are passed to the client library (``project``, ``database`` and the
    ``CLIENT_KWARGS``); every RPC gets ``operation_timeout_ms`` and no retries.
    """

    def __init__(self, alias: str, options: Mapping[str, Any], operation_timeout_ms: int) -> None:
        self.alias = alias
        self.options = dict(options)
        self.timeout_s = operation_timeout_ms / 1000
        _firestore()  # fail at start-up, not at the first lock, when the extra is missing
        self._sync: Any = None
        self._sync_pid = os.getpid()
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = (
            weakref.WeakKeyDictionary()
        )

    def sync(self) -> Any:
        """The Firestore client, built on first use with bounded calls (again in a
        forked child: the parent's gRPC channel is not usable there)."""
        if self._sync_pid != os.getpid():
            self._sync, self._sync_pid = None, os.getpid()  # the parent's: never closed here
        if self._sync is None:
            try:
                client = _firestore().Client(**self.options)
                bound_every_call(client, self.timeout_s)
            except Exception as exc:
                raise map_firestore_error(exc, self.alias) from exc
            self._sync = client
        return self._sync

    def for_loop(self) -> Any:
        """The ``AsyncClient`` of the running event loop (gRPC channels are per loop)."""
        loop = asyncio.get_running_loop()
        client = self._loops.get(loop)
        if client is None:
            try:
                client = _firestore().AsyncClient(**self.options)
                bound_every_call(client, self.timeout_s, asynchronous=True)
            except Exception as exc:
                raise map_firestore_error(exc, self.alias) from exc
            self._loops[loop] = client
        return client

    def close(self) -> None:
        """Close the synchronous client and every loop's async client, each on its loop."""
        client, self._sync = self._sync, None
        if client is not None and self._sync_pid == os.getpid():  # never the parent's
            client.close()
            close_channel(client)
        loops, self._loops = self._loops, weakref.WeakKeyDictionary()
        for loop, aclient in list(loops.items()):
            close_on_loop(loop, partial(_aclose, aclient), self.timeout_s)

    async def aclose(self) -> None:
        """Close the running loop's async client (the others stay)."""
        client = self._loops.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await _aclose(client)


async def _aclose(client: Any) -> None:
    client.close()
    await close_channel(client)


def commit_may_have_applied(error: LockError) -> bool:
    """Whether the call behind ``error`` may have been applied by the server: its
    deadline passed or the service broke off, rather than a refusal or a conflict
    (``Aborted``: the batch's guard failed, nothing was written). A commit whose
    outcome stayed unknown is marked by the backend itself (``note_maybe_written``)."""
    from google.api_core import exceptions as api

    cause = error.context.get("cause")
    maybe = (
        api.DeadlineExceeded,
        api.RetryError,
        api.ServiceUnavailable,
        api.InternalServerError,
        api.Unknown,  # gRPC UNKNOWN: "Stream removed" on a connection broken mid-call
    )
    return isinstance(cause, maybe)
