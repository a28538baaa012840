"""The acquisition options, listed once (``LockOptions``), and what
every entry point (``locked``, ``lock()``, ``alock()``) gets from that."""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import fields
from typing import get_type_hints

import pytest

from django_syncguard import AcquisitionTimeout, InvalidArgument, alock, hash_key, lock, locked
from django_syncguard.acquisition import OPTION_NAMES, LockOptions, LockSpec
from django_syncguard.keys import display_hash
from django_syncguard.retry import RetryPolicy


def test_each_option_has_one_home_the_spec_or_its_retry_policy():
    spec_fields = {f.name for f in fields(LockSpec)} - {"policy"}
    retry_fields = {f.name for f in fields(RetryPolicy)}
    assert not spec_fields & retry_fields
    assert set(get_type_hints(LockOptions)) == OPTION_NAMES == spec_fields | retry_fields
    assert {
        "using",
        "ttl_ms",
        "max_retries",
        "retry_delay_ms",
        "timeout_ms",
        "backoff",
        "jitter",
        "cancel",
        "on_release_error",
        "auto_extend",
        "until_commit",
        "on_contended",
    } == OPTION_NAMES


@pytest.mark.parametrize("entry", [locked, lock, alock])
def test_entry_points_take_the_options_as_keywords_not_a_copy_of_them(entry):
    kinds = [p.kind for p in inspect.signature(entry).parameters.values()]
    assert kinds.count(inspect.Parameter.VAR_KEYWORD) == 1
    assert not set(inspect.signature(entry).parameters) & OPTION_NAMES


def test_an_unknown_option_is_named_by_every_entry_point(mem):
    expected = r"\(\) got unknown option\(s\) ttl; the options are auto_extend, backoff"
    with pytest.raises(InvalidArgument, match="^locked" + expected):
        locked("job", ttl=5)
    with pytest.raises(InvalidArgument, match="^lock" + expected):
        lock(lambda: None, key="job", using=mem.backend, ttl=5)
    with pytest.raises(InvalidArgument, match="^alock" + expected):
        asyncio.run(alock(lambda: asyncio.sleep(0), key="job", using=mem.backend, ttl=5))
    assert mem.backend.is_locked("job") is False


def test_defaults_are_the_spec_s_and_the_policy_is_derived_from_them():
    spec = LockSpec.from_options("lock", {"timeout_ms": 250})
    assert (spec.using, spec.ttl_ms, spec.auto_extend) == ("default", 30_000, False)
    assert (spec.policy.timeout_ms, spec.policy.max_retries, spec.policy.backoff) == (
        250,
        10,
        "exponential",
    )


def test_lock_takes_its_key_as_it_is_placeholders_included(mem):
    assert lock(lambda: mem.backend.is_locked("a<b>"), key="a<b>", using=mem.backend) is True


def test_acquisition_timeout_names_the_key_by_its_hash(mem):
    mem.backend.acquire("invoice:42", 10_000)
    with pytest.raises(AcquisitionTimeout) as caught:
        lock(lambda: None, key="invoice:42", using=mem.backend, max_retries=0)
    digest = display_hash("invoice:42")  # keyed with SECRET_KEY: not reversible by guessing
    assert str(caught.value) == f"Lock on key {digest} still held after 1 attempts (max_retries=0)."
    assert caught.value.context == {"key": "invoice:42", "key_hash": digest}
    assert "invoice:42" not in str(caught.value)
    assert hash_key("invoice:42") not in str(caught.value)
