"""The owner label's ``WHO`` part inside tasks (``django_syncguard/owners.py``): a
Celery task (run by Celery's own tracer, ``apply()``) and a Django task that takes its
context (run by the immediate backend) name their task id; and the label's pieces
as the module builds them. The label on every backend: ``tests/test_contract.py``."""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import django
import pytest
from celery import Celery
from django.test import override_settings

from django_syncguard import InvalidArgument, locked, locks, owners
from django_syncguard.backends.memory import MemoryBackend

if django.VERSION >= (6, 0):
    from django.tasks import task
else:  # the backport, same API
    from django_tasks import task

MEMORY = "django_syncguard.backends.memory.MemoryBackend"
HOST = owners.clip(socket.gethostname(), owners.PART_BYTES)

celery_app = Celery("owners-test", set_as_current=False)


@pytest.fixture
def memory_locks() -> Iterator[MemoryBackend]:
    config = {"BACKEND": MEMORY, "LOCATION": f"owners:{uuid.uuid4().hex}"}
    with override_settings(SYNCGUARD_BACKENDS={"default": config}):
        backend = locks["default"]
        yield backend
        backend.reset()


def label_under_the_lock(key: str) -> str | None:
    info = locks["default"].lookup(key=key)
    return None if info is None else info.owner


@celery_app.task(name="owners.charge")
@locked("celery:<n>")
def charge(n: int) -> str | None:
    return label_under_the_lock(f"celery:{n}")


@task(takes_context=True)
@locked("django-task:<n>")
def refund(context: Any, n: int) -> str | None:
    return label_under_the_lock(f"django-task:{n}")


def test_a_celery_task_is_named_by_its_task_id(memory_locks):
    result = charge.apply(args=(1,), task_id="c0ffee00-0000-4000-8000-000000000001")
    assert result.get() == (
        f"{HOST}:{os.getpid()} task:c0ffee00-0000-4000-8000-000000000001 {__name__}.charge"
    )


def test_a_django_task_that_takes_its_context_is_named_by_its_result_id(memory_locks):
    result = refund.enqueue(2)  # the immediate backend runs it here, now
    assert result.return_value == f"{HOST}:{os.getpid()} task:{result.id} {__name__}.refund"


def test_outside_a_task_the_thread_names_the_holder(memory_locks):
    @locked("plain:<n>")
    def pay(n: int) -> str | None:
        return label_under_the_lock(f"plain:{n}")

    thread = threading.current_thread().name
    qualname = "test_outside_a_task_the_thread_names_the_holder.<locals>.pay"
    assert pay(3) == f"{HOST}:{os.getpid()} thread:{thread} {__name__}.{qualname}"
    # The function is named only while it runs.
    assert owners.owner_label() == f"{HOST}:{os.getpid()} thread:{thread} -"


def test_clip_cuts_on_a_character_boundary_and_replaces_control_characters():
    assert owners.clip("a\tb\x7fc", 10) == "a?b?c"
    assert owners.clip("€€€", 7) == "€€"  # 6 bytes: a third € would need 9
    assert owners.clip("\ud800x", 10) == "?x"  # a lone surrogate
    assert owners.clip("é" * 100, owners.MAX_OWNER_BYTES) == "é" * 64


def test_the_option_is_checked_when_the_backend_is_built():
    with pytest.raises(InvalidArgument, match=r"RECORD_OWNER'\] must be True or False, not 1"):
        MemoryBackend("bad", {"OPTIONS": {"RECORD_OWNER": 1}})
    assert MemoryBackend("ok", {"LOCATION": "owners-option"}).record_owner is True
