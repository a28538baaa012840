"""``locks``: one backend per alias of ``SYNCGUARD_BACKENDS``, like ``caches``.

Unlike Django's cache handler, backends are shared by every thread of the process
(a lock backend owns a thread-safe pool or store; one per thread would defeat it).
Settings are read on first use, never at import, and re-read when a test overrides
``SYNCGUARD_BACKENDS`` (``prepare_process`` also reads them when the app is ready,
without keeping them).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.connection import BaseConnectionHandler
from django.utils.module_loading import import_string

from .contract import LockBackend, missing_operations

logger = logging.getLogger("django_syncguard.handler")

DEFAULT_ALIAS = "default"
SETTINGS_NAME = "SYNCGUARD_BACKENDS"

#: What an absent ``SYNCGUARD_BACKENDS`` means: locks in ``DATABASES["default"]``.
DEFAULT_BACKENDS: dict[str, dict[str, Any]] = {
    DEFAULT_ALIAS: {
        "BACKEND": "django_syncguard.backends.database.DatabaseBackend",
        "OPTIONS": {"DATABASE": "default"},
    }
}

#: The pip extra each bundled backend needs, for error messages.
BACKEND_EXTRAS = {
    "django_syncguard.backends.redis.RedisBackend": "redis",
    "django_syncguard.backends.firestore.FirestoreBackend": "firestore",
}


if TYPE_CHECKING:
    _HandlerBase = BaseConnectionHandler[LockBackend]
else:  # Django's handler is generic only in django-stubs
    _HandlerBase = BaseConnectionHandler


class InvalidBackendError(ImproperlyConfigured):
    """An alias is unknown, or its ``BACKEND`` cannot be imported or built."""


class _Shared:
    """Attribute storage shared by all threads (the base handler keeps one per thread)."""


class LockHandler(_HandlerBase):
    """Builds and caches one backend per alias; ``locks["redis"]``."""

    settings_name = SETTINGS_NAME
    exception_class = InvalidBackendError

    def __init__(self, settings: dict[str, Any] | None = None) -> None:
        super().__init__(settings)
        self._connections = _Shared()
        self._mutex = threading.RLock()

    def configure_settings(self, settings: dict[str, Any] | None) -> dict[str, Any]:
        if settings is None:
            from django.conf import settings as django_settings

            settings = getattr(django_settings, SETTINGS_NAME, None)
            if settings is None:  # absent; an empty dict is refused by syncguard.E007
                settings = DEFAULT_BACKENDS
        if not isinstance(settings, dict):
            raise InvalidBackendError(f"{SETTINGS_NAME} must be a dict of alias -> config.")
        return settings

    def __getitem__(self, alias: str) -> LockBackend:
        backend: LockBackend | None = getattr(self._connections, alias, None)
        if backend is not None:
            return backend
        with self._mutex:
            backend = getattr(self._connections, alias, None)
            if backend is None:
                if alias not in self.settings:
                    known = ", ".join(repr(a) for a in self.settings) or "none"
                    raise InvalidBackendError(
                        f"No lock backend alias {alias!r} in {SETTINGS_NAME} (configured: {known})."
                    )
                backend = self.create_connection(alias)
                setattr(self._connections, alias, backend)
        return backend

    def backend_class(self, alias: str) -> type[LockBackend]:
        """The class ``SYNCGUARD_BACKENDS[alias]["BACKEND"]`` names, imported."""
        path = self.settings[alias].get("BACKEND")
        if not path or not isinstance(path, str):
            raise InvalidBackendError(f"{SETTINGS_NAME}[{alias!r}] has no 'BACKEND'.")
        try:
            backend_cls = import_string(path)
        except ImportError as exc:
            raise InvalidBackendError(backend_import_message(alias, path, exc)) from exc
        missing = missing_operations(backend_cls) if isinstance(backend_cls, type) else ["all"]
        if missing:
            raise InvalidBackendError(
                f"{SETTINGS_NAME}[{alias!r}]['BACKEND'] = {path!r} is not a lock backend "
                "(a class with the operations of django_syncguard.contract.LockBackend, "
                "such as a subclass of django_syncguard.backends.base.BaseLockBackend)."
                + _module_hint(path)
            )
        return backend_cls  # type: ignore[no-any-return]

    def prepare_process(self) -> None:
        """Ask each configured backend class to set up what must be in place from the
        process's start (``prepare_process(alias, params)``; run when the app is ready
        and when a test changes the setting). No backend is built. The settings are
        read afresh and not kept, so that a change made after set-up is still what
        the first use reads; whatever is wrong with them is the system checks' to
        report, so it is skipped here."""
        try:
            configured = self.configure_settings(self._settings)
        except InvalidBackendError:
            return
        for alias, params in configured.items():
            try:
                prepare = getattr(import_string(params["BACKEND"]), "prepare_process", None)
                if prepare is not None:
                    prepare(alias, params)
            except Exception as exc:
                logger.debug("Lock backend %r not prepared: %r", alias, exc)

    def create_connection(self, alias: str) -> LockBackend:
        backend_cls = self.backend_class(alias)
        try:
            return backend_cls(alias, dict(self.settings[alias]))  # type: ignore[call-arg]
        except ImproperlyConfigured as exc:  # e.g. the backend's pip extra is missing
            raise InvalidBackendError(f"{SETTINGS_NAME}[{alias!r}]: {exc}") from exc

    def all(self, initialized_only: bool = False) -> list[LockBackend]:
        return [
            self[alias]
            for alias in self
            if not initialized_only or hasattr(self._connections, alias)
        ]

    def close_all(self) -> None:
        # The backends built so far, without reading settings: on setting_changed the
        # settings may already be the new (possibly invalid) value.
        for backend in list(vars(self._connections).values()):
            backend.close()

    def reset(self) -> None:
        """Close every backend and forget the settings (used on ``setting_changed``)."""
        with self._mutex:
            self.close_all()
            self._connections = _Shared()
            self.__dict__.pop("settings", None)
            self._settings = None


def backend_import_message(alias: str, path: str, exc: ImportError) -> str:
    extra = BACKEND_EXTRAS.get(path)
    hint = f' Install it with: pip install "django-syncguard[{extra}]".' if extra else ""
    hint = hint or _module_hint(path)
    return f"{SETTINGS_NAME}[{alias!r}]['BACKEND'] = {path!r} cannot be imported: {exc}.{hint}"


def _module_hint(path: str) -> str:
    """When ``path`` names a module rather than a class, say so and name its backends."""
    try:
        module = importlib.import_module(path)
    except Exception:  # not a module (or a broken one): nothing to add
        return ""
    # The module's own classes, and those its package re-exports (a backend package
    # such as backends.database defines its class in a submodule).
    exported = set(getattr(module, "__all__", ()))
    classes = [
        f"{path}.{name}"
        for name, value in vars(module).items()
        if inspect.isclass(value)
        and (value.__module__ == module.__name__ or name in exported)
        and not inspect.isabstract(value)
        and not missing_operations(value)
    ]
    suggestion = f": {' or '.join(repr(c) for c in classes)}" if classes else ""
    return f" It names a module; BACKEND names a backend class{suggestion}."


def resolve_backend(using: str | LockBackend) -> LockBackend:
    """An alias of ``SYNCGUARD_BACKENDS`` (looked up in :data:`locks`), or a backend
    object used as it is."""
    if isinstance(using, str):
        return locks[using]
    return using


locks = LockHandler()


@receiver(setting_changed)
def _reset_on_setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting == SETTINGS_NAME:
        locks.reset()
        locks.prepare_process()
