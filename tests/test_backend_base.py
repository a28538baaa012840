"""The base backend class: its required hooks, and the settings every backend shares."""

from __future__ import annotations

import pytest

from django_syncguard import InvalidArgument
from django_syncguard.backends.base import BaseLockBackend
from django_syncguard.backends.memory import MemoryBackend

HOOKS = {
    "_acquire",
    "_release",
    "_extend",
    "_is_locked",
    "_lookup_by_key",
    "_lookup_by_id",
    "_list_locks",
    "_count_expired",
    "_delete_expired",
}


def test_the_storage_hooks_are_abstract():
    assert BaseLockBackend.__abstractmethods__ == HOOKS

    class Partial(BaseLockBackend):
        def _acquire(self, key, ttl_ms, cancel): ...

    with pytest.raises(TypeError, match="abstract"):
        Partial("p", {})


def test_a_misspelled_setting_is_refused_with_a_suggestion():
    with pytest.raises(
        InvalidArgument, match=r"Unknown setting 'LOCATON'.*Did you mean 'LOCATION'"
    ):
        MemoryBackend("m", {"LOCATON": "x"})


def test_key_prefix_is_refused_where_it_means_nothing():
    with pytest.raises(InvalidArgument, match="KEY_PREFIX has no meaning for MemoryBackend"):
        MemoryBackend("m", {"KEY_PREFIX": "syncguard"})
    assert MemoryBackend("m", {}).key_prefix == ""
