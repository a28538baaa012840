"""Django signals for the lifecycle of a lock held through the helpers.

``lock()`` / ``alock()``, ``@locked``, ``with locked(...)`` and a :class:`Lease`'s
own ``extend()`` / ``release()`` (and its auto-extend renewal) send these signals.
Calling a backend directly (``locks["default"].acquire(...)``) sends none.

``sender`` is the class of the backend object the helper used (``MemoryBackend``,
``RedisBackend``..., or ``TelemetryBackend`` when wrapped by ``with_telemetry``).
Every signal carries these keyword arguments:

- ``alias``: the backend's alias (``str``);
- ``key_hash``: ``display_hash`` of the normalised key (``str``): the key's hash
  keyed with ``SECRET_KEY``, as the admin, messages and logs show it (see
  :mod:`django_syncguard.keys`), not ``hash_key``'s.

Where a lock exists, also:

- ``lock_id_hash``: ``display_hash`` of the lock id (``str``);
- ``fence``: the lock's fence (``str``, or ``None`` on a backend without fencing).

No signal ever carries a raw key or a raw lock id: the lock id is the holder's
proof of ownership and keys may name customers.

``lock_acquired``
    A helper got the lock: once per hold, before the protected code runs and
    before auto-extend starts. Adds ``expires_at_ms`` (``int``) and ``attempts``
    (``int`` >= 1, the acquire attempts the helper made, this one included).
``lock_contended``
    An acquire attempt of a helper found the key locked: once per such attempt,
    before the backoff sleep or the ``AcquisitionTimeout``. Adds ``attempt``
    (``int``, 1-based). No lock of ours exists, so no ``lock_id_hash`` / ``fence``.
``lock_extended``
    An extend succeeded: ``lease.extend()`` / ``aextend()`` or an auto-extend
    renewal. Adds ``expires_at_ms`` (``int``, the new expiry).
``lock_lost``
    The lease became lost (``lease.lost`` turned true), at most once per lease: an
    auto-extend renewal or an extend found the lock gone, renewal errors lasted
    until the lease's expiry, or the release found the lock already gone. Adds
    ``reason`` (``str``).
``lock_released``
    A release reached the backend and answered: once per lease (a second
    ``release()`` does no I/O and sends nothing). Adds ``ok`` (``bool``: the lock
    was still ours).
``lock_force_released``
    Someone's lock was force-released through the admin. Sent by the admin's
    code, not by the helpers. Adds ``user`` (the username, ``str`` or ``None``)
    and ``reason`` (``str``).

``lock_lost``'s ``reason`` is ``"expired"`` when an extend, renewal or release found
the lock no longer ours (it expired, or was removed, e.g. force-released) and
``"error"`` when renewals kept raising until the lease's own expiry estimate
passed. When a release finds the lock gone, ``lock_lost`` comes first, then
``lock_released`` with ``ok=False``. An acquire or release that raises sends
nothing (the error propagates, or goes to ``on_release_error``).

Receivers run where the event happens: in the caller's thread, in the renewal
thread (sync auto-extend), or, on the async paths (``alock``, ``async with``,
``aextend``, ``arelease``, the renewal task), through ``asend_robust`` so that
async receivers are awaited and sync ones run via ``sync_to_async``.

A receiver that raises never changes a lock operation and never leaks a held lock:
signals go out through ``send_robust`` / ``asend_robust`` and each receiver's
exception is logged as a warning, with its traceback, on the
``django_syncguard.signals`` logger (Django also logs it at ERROR on
``django.dispatch``). Nothing is hashed when a signal has no receiver.

::

    from django.dispatch import receiver
    from django_syncguard.signals import lock_lost


    @receiver(lock_lost)
    def page_on_lost_lock(sender, alias, key_hash, lock_id_hash, fence, reason, **kwargs):
        alert(f"lock {key_hash} on {alias} lost ({reason}), fence {fence}")
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.dispatch import Signal

from .keys import display_hash, display_hash_of

if TYPE_CHECKING:
    from .contract import LockBackend

logger = logging.getLogger("django_syncguard.signals")

lock_acquired = Signal()
lock_released = Signal()
lock_extended = Signal()
lock_lost = Signal()
lock_force_released = Signal()
lock_contended = Signal()

# Django signals have no name of their own; the log lines need one.
_NAMES: dict[Signal, str] = {
    lock_acquired: "lock_acquired",
    lock_released: "lock_released",
    lock_extended: "lock_extended",
    lock_lost: "lock_lost",
    lock_force_released: "lock_force_released",
    lock_contended: "lock_contended",
}


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One signal ready to go out.

    Lease state changes are synchronous code shared by the sync and async paths;
    they return ``Outgoing`` values and the caller sends them with :func:`send` or
    :func:`asend`, whichever suits the path it is on.
    """

    signal: Signal
    sender: type[Any]
    kwargs: dict[str, Any]


def prepare(
    signal: Signal,
    backend: LockBackend,
    *,
    key: str,
    lock_id: str | None = None,
    lock_id_hash: str | None = None,
    fence: str | None = None,
    **extra: Any,
) -> list[Outgoing]:
    """``signal`` with the common keyword arguments plus ``extra``, as a list.

    The list is empty when nobody listens, so an unobserved lock hashes nothing.
    ``lock_id_hash`` and ``fence`` are included when ``lock_id`` is given (or only
    its ``hash_key``, where the raw lock id is not known, as in the inspector). Both
    go out as display hashes: receivers log and alert with them.
    """
    sender = type(backend)
    # Nothing connected at all: the common case, told without has_listeners(), which
    # takes the signal's lock and scans its receivers (every hold asks twice, on the
    # hand-off's path: the grantee before its body, the releaser before its release).
    if not signal.receivers or not signal.has_listeners(sender):
        return []
    kwargs: dict[str, Any] = {"alias": backend.alias, "key_hash": display_hash(key)}
    shown = None
    if lock_id is not None:
        shown = display_hash(lock_id)
    elif lock_id_hash is not None:
        shown = display_hash_of(lock_id_hash)
    if shown is not None:
        kwargs["lock_id_hash"] = shown
        kwargs["fence"] = fence
    kwargs.update(extra)
    return [Outgoing(signal, sender, kwargs)]


def send(outgoing: Iterable[Outgoing]) -> None:
    """Send each signal to its receivers now, in this thread; never raises."""
    for item in outgoing:
        try:
            responses = item.signal.send_robust(item.sender, **item.kwargs)
        except Exception:
            # send_robust itself fails when async receivers meet a running event loop
            # (sync helpers used inside async code): the lock must not pay for it.
            _log_send_failure(item)
        else:
            _log_receiver_errors(item, responses)


async def asend(outgoing: Iterable[Outgoing]) -> None:
    """Async twin of :func:`send`: awaits async receivers, runs sync ones in a thread."""
    for item in outgoing:
        try:
            responses = await item.signal.asend_robust(item.sender, **item.kwargs)
        except Exception:
            _log_send_failure(item)
        else:
            _log_receiver_errors(item, responses)


def _log_receiver_errors(item: Outgoing, responses: list[tuple[Callable[..., Any], Any]]) -> None:
    for receiver, response in responses:
        if isinstance(response, Exception):
            logger.warning(
                "Receiver %s of django_syncguard signal %s raised; the lock operation went on.",
                getattr(receiver, "__qualname__", type(receiver).__name__),
                _NAMES.get(item.signal, "?"),
                exc_info=response,
            )


def _log_send_failure(item: Outgoing) -> None:
    logger.warning(
        "Sending django_syncguard signal %s failed; the lock operation went on.",
        _NAMES.get(item.signal, "?"),
        exc_info=True,
    )
