"""The admin lock inspector: live locks of every configured backend alias.

Registered on the ``Lock`` model so it appears under the app in the admin index, but
it lists locks through each backend (database, Redis, Firestore, memory), not through
the ORM. Read-only, except one action: force release, behind its own permission,
with a confirmation page and a reason that is written to the admin log.

Permissions (``django_syncguard.<codename>``):

- ``view_lock``: open the inspector (display hashes of keys, keyed with ``SECRET_KEY``;
  fences, times, remaining TTL);
- ``view_lock_key``: also see raw keys (they may name customers), and filter by key;
- ``force_release_lock``: force-release a lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.contrib.admin.models import DELETION, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse

from . import inspector
from .errors import LockError
from .handler import InvalidBackendError, locks
from .keys import display_hash
from .models import Lock

VIEW_KEYS = "django_syncguard.view_lock_key"
FORCE_RELEASE = "django_syncguard.force_release_lock"


if TYPE_CHECKING:
    _ModelAdmin = admin.ModelAdmin[Lock]
else:
    _ModelAdmin = admin.ModelAdmin


@admin.register(Lock)
class LockInspectorAdmin(_ModelAdmin):
    """Live locks of every alias; see the module docstring."""

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def get_urls(self) -> list[URLPattern]:
        name = f"{self.opts.app_label}_{self.opts.model_name}"
        return [
            path("", self.admin_site.admin_view(self.changelist_view), name=f"{name}_changelist"),
            path(
                "force-release/<str:token>/",
                self.admin_site.admin_view(self.force_release_view),
                name=f"{name}_force_release",
            ),
        ]

    # ---------------------------------------------------------------- listing
    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        aliases = list(locks)
        alias = request.GET.get("alias")
        if alias not in aliases:
            alias = aliases[0]
        show_keys = request.user.has_perm(VIEW_KEYS)
        # The key filter is a view of keys too: without view_lock_key, which rows a
        # prefix leaves would tell the keys a character at a time. It is ignored.
        prefix = request.GET.get("q", "") if show_keys else ""
        tokens = inspector.Tokens(request.session)
        page_token = request.GET.get("page", "")
        cursor = tokens.cursor(page_token, alias) if page_token else None
        rows: list[inspector.Row] = []
        next_url = error = fences = None
        try:
            backend = locks[alias]
            page = backend.list_locks(prefix=prefix, cursor=cursor, limit=inspector.PAGE_SIZE)
        except (LockError, InvalidBackendError) as exc:
            error = f"The {alias!r} backend could not be listed: {exc}"
            backend = None
        else:
            fences = inspector.fences_of(backend) if backend is not None else None
            rows = inspector.rows_of(page, alias, tokens, show_keys=show_keys, backend=backend)
            if page.next_cursor is not None:
                query = {
                    "alias": alias,
                    "q": prefix,
                    "page": tokens.add_cursor(alias, page.next_cursor),
                }
                next_url = "?" + urlencode(query)
        tokens.save()
        context = {
            **self._context(request, "Lock inspector"),
            "aliases": aliases,
            "alias": alias,
            "backend": backend,
            "fences": fences,
            "prefix": prefix,
            "rows": [
                (
                    row,
                    inspector.format_remaining(row.remaining_ms),
                    inspector.format_wait(row.oldest_wait_ms),
                )
                for row in rows
            ],
            "show_keys": show_keys,
            "can_force_release": request.user.has_perm(FORCE_RELEASE),
            "first_url": "?" + urlencode({"alias": alias, "q": prefix}),
            "is_first_page": cursor is None,
            "next_url": next_url,
            "error": error,
            **(extra_context or {}),
        }
        return TemplateResponse(request, "admin/django_syncguard/lock/inspector.html", context)

    # ---------------------------------------------------------- force release
    def force_release_view(self, request: HttpRequest, token: str) -> HttpResponse:
        if not request.user.has_perm(FORCE_RELEASE):
            raise PermissionDenied
        target = inspector.Tokens(request.session).target(token)
        changelist = reverse("admin:django_syncguard_lock_changelist")
        if target is None:
            self.message_user(
                request,
                "That lock is no longer on your inspector pages; reload the inspector.",
                messages.WARNING,
            )
            return HttpResponseRedirect(changelist)
        back = f"{changelist}?{urlencode({'alias': target.alias})}"
        reason = request.POST.get("reason", "").strip() if request.method == "POST" else ""
        if request.method == "POST" and reason:
            return self._force_release(request, target, reason, back)
        context = {
            **self._context(request, "Force-release a lock?"),
            "target": target,
            "key_hash": display_hash(target.key),
            "show_keys": request.user.has_perm(VIEW_KEYS),
            "reason_missing": request.method == "POST",
            "back_url": back,
        }
        return TemplateResponse(request, "admin/django_syncguard/lock/force_release.html", context)

    def _context(self, request: HttpRequest, title: str) -> dict[str, Any]:
        """What every page of the inspector needs from the admin."""
        return {**self.admin_site.each_context(request), "opts": self.opts, "title": title}

    def _force_release(
        self, request: HttpRequest, target: inspector.Target, reason: str, back: str
    ) -> HttpResponse:
        key_hash = display_hash(target.key)
        try:
            result = inspector.force_release(
                locks[target.alias], target, user=request.user, reason=reason
            )
        except (LockError, InvalidBackendError) as exc:
            self.message_user(request, f"Force release failed: {exc}", messages.ERROR)
            return HttpResponseRedirect(back)
        if not result.ok:
            self.message_user(
                request,
                f"Lock {key_hash} was no longer held by the holder you saw (released, "
                "expired or taken again): nothing was released.",
                messages.WARNING,
            )
            return HttpResponseRedirect(back)
        LogEntry.objects.create(
            user_id=cast(int, request.user.pk),
            content_type=ContentType.objects.get_for_model(Lock),
            object_id=key_hash,
            object_repr=f"lock {key_hash} on {target.alias!r} (fence {target.fence})",
            action_flag=DELETION,
            change_message=f"Force-released. Reason: {reason}",
        )
        self.message_user(request, f"Lock {key_hash} force-released.", messages.SUCCESS)
        return HttpResponseRedirect(back)
