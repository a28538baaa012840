"""The system checks (``django_syncguard.checks``): one test per message id.

The deploy checks (W010, W011, I020) need servers; they are tested with their
backends (tests/test_redis_backend.py, tests/test_firestore_backend.py).
"""

from __future__ import annotations

import sys
import textwrap
import types
from collections.abc import Callable, Iterator

import pytest
from django.core import checks
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connections

from django_syncguard import locked, locks, registry
from django_syncguard.backends.database import E004, E004_HINT, E005, W002, W002_HINT
from django_syncguard.backends.memory import W001, MemoryBackend
from django_syncguard.checks import (
    E001,
    E002,
    E003,
    E006,
    E006_HINT,
    W003_RENEWAL,
    W003_RENEWAL_HINT,
    W003_TTL,
    W003_TTL_HINT,
    W006,
    W006_HINT,
    W013,
    W013_HINT,
    check_backends,
)
from django_syncguard.handler import InvalidBackendError

MEMORY = "django_syncguard.backends.memory.MemoryBackend"
DATABASE = "django_syncguard.backends.database.DatabaseBackend"
REDIS = "django_syncguard.backends.redis.RedisBackend"
FIRESTORE = "django_syncguard.backends.firestore.FirestoreBackend"


@pytest.fixture(autouse=True)
def isolated_registry() -> Iterator[None]:
    """Each test starts with no recorded ``@locked`` function and leaves none behind."""
    saved = registry.snapshot()
    registry.clear()
    yield
    registry.restore(saved)


@pytest.fixture
def debug(settings):
    """DEBUG on, so that the memory backend of the test settings raises no W001."""
    settings.DEBUG = True
    return settings


def run() -> list[checks.CheckMessage]:
    return checks.run_checks(tags=["syncguard"])


def only(messages: list[checks.CheckMessage]) -> tuple[str, int, str, str | None]:
    [message] = messages
    return message.id, message.level, message.msg, message.hint


def here(name: str) -> str:
    """The qualified name the registry gives a function defined inside test ``name``."""
    return f"{__name__}.{name}.<locals>"


# ----------------------------------------------------------------- clean
@pytest.mark.usefixtures("debug")
def test_clean_configuration_gives_no_messages():
    @locked("job:<n>", ttl_ms=30_000, auto_extend=True)
    def job(n): ...

    @locked("other", using="default", ttl_ms=5_001)
    def other(): ...

    assert run() == []


def test_the_default_database_backend_checks_clean_without_io(settings):
    del settings.SYNCGUARD_BACKENDS  # the implicit "default": DATABASES["default"]

    @locked("job")
    def job(): ...

    assert run() == []


def test_a_database_backend_over_a_dead_server_checks_clean(debug):
    # No connection is opened: nothing listens on the "dead" alias's port.
    pytest.importorskip("psycopg")
    debug.SYNCGUARD_BACKENDS = {"default": {"BACKEND": DATABASE, "OPTIONS": {"DATABASE": "dead"}}}
    assert run() == []


def test_checks_leave_the_shared_handler_alone(settings):
    settings.DEBUG = True
    before = locks["default"]
    assert run() == []
    assert locks["default"] is before


# ------------------------------------------------------------------- E001
@pytest.fixture
def bad_shape(settings):
    """Settings about to hold a ``SYNCGUARD_BACKENDS`` of the wrong shape.

    ``locks.reset()`` (on ``setting_changed``) reads the settings when the shared
    handler has not loaded them yet, and then fails on a wrong shape: load them first.
    """
    assert locks.settings is not None
    return settings


def test_e001_bad_shape(bad_shape):
    bad_shape.SYNCGUARD_BACKENDS = ["not", "a", "dict"]
    assert only(run()) == ("syncguard.E001", checks.ERROR, E001, None)
    assert E001 == "SYNCGUARD_BACKENDS must be a dict mapping aliases to backend settings."


def test_e001_an_alias_that_is_not_a_dict(bad_shape):
    bad_shape.SYNCGUARD_BACKENDS = {"default": MEMORY}
    assert only(run())[0] == "syncguard.E001"


def test_e007_an_empty_dict_is_not_the_database_default(settings):
    settings.SYNCGUARD_BACKENDS = {}
    assert only(run()) == (
        "syncguard.E007",
        checks.ERROR,
        "SYNCGUARD_BACKENDS is empty: no lock backend is configured.",
        "Define at least a 'default' alias, or remove the setting to keep locks in "
        "DATABASES['default'].",
    )
    with pytest.raises(InvalidBackendError, match=r"No lock backend alias 'default'.*none"):
        locks["default"]


# ------------------------------------------------------------------- E002
def test_e002_unimportable_backend(settings):
    settings.SYNCGUARD_BACKENDS = {"default": {"BACKEND": "nowhere.Backend"}}
    assert only(run()) == (
        "syncguard.E002",
        checks.ERROR,
        "Lock backend 'default' cannot be loaded: SYNCGUARD_BACKENDS['default']['BACKEND'] "
        "= 'nowhere.Backend' cannot be imported: No module named 'nowhere'.",
        None,
    )


def test_e002_names_the_missing_pip_extra(settings, monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # as if redis-py were not installed
    settings.DEBUG = True
    settings.SYNCGUARD_BACKENDS = {
        "default": {"BACKEND": MEMORY},
        "redis": {"BACKEND": REDIS, "LOCATION": "redis://127.0.0.1:1/0"},
    }
    assert only(run()) == (
        "syncguard.E002",
        checks.ERROR,
        "Lock backend 'redis' cannot be loaded: SYNCGUARD_BACKENDS['redis']: The Redis lock "
        'backend needs redis-py: pip install "django-syncguard[redis]".',
        None,
    )
    assert E002 == "Lock backend {alias!r} cannot be loaded: {error}"


def test_e002_names_the_extra_when_the_backend_module_cannot_be_imported(settings, monkeypatch):
    monkeypatch.setitem(sys.modules, "django_syncguard.backends.redis", None)
    settings.SYNCGUARD_BACKENDS = {"default": {"BACKEND": REDIS, "LOCATION": "redis://x"}}
    [message] = run()
    assert message.id == "syncguard.E002"
    assert message.msg.endswith(' Install it with: pip install "django-syncguard[redis]".')


@pytest.mark.parametrize(
    ("module", "suggestion"),
    [
        ("django_syncguard.backends.memory", "django_syncguard.backends.memory.MemoryBackend"),
        (
            "django_syncguard.backends.database",
            "django_syncguard.backends.database.DatabaseBackend",
        ),
    ],
)
@pytest.mark.parametrize("imported", [False, True])
def test_e002_a_module_named_instead_of_its_class(
    settings, monkeypatch, module, suggestion, imported
):
    if not imported:  # import_string then fails to find the module as an attribute
        package, name = module.rsplit(".", 1)
        monkeypatch.delitem(sys.modules, module)
        monkeypatch.delattr(sys.modules[package], name)
    settings.SYNCGUARD_BACKENDS = {"default": {"BACKEND": module}}
    [message] = run()
    assert message.id == "syncguard.E002"
    assert message.msg.endswith(
        f" It names a module; BACKEND names a backend class: {suggestion!r}."
    )


# ------------------------------------------------------------------- E003
def test_e003_bad_option(settings):
    settings.SYNCGUARD_BACKENDS = {
        "default": {"BACKEND": MEMORY, "OPTIONS": {"OPERATION_TIMEOUT_MS": -5}}
    }
    assert only(run()) == (
        "syncguard.E003",
        checks.ERROR,
        "Lock backend 'default' is misconfigured: "
        "OPTIONS['OPERATION_TIMEOUT_MS'] must be a positive int (ms), not -5.",
        None,
    )


def test_e003_unknown_option(settings):
    settings.SYNCGUARD_BACKENDS = {"default": {"BACKEND": MEMORY, "OPTIONS": {"TABLE": "x"}}}
    [message] = run()
    assert message.id == "syncguard.E003"
    assert message.msg == E003.format(
        alias="default",
        error="Unknown OPTIONS for MemoryBackend (alias 'default'): TABLE. "
        "Known: CLEANUP_IN_IS_LOCKED, CLOCK, CONNECT_TIMEOUT_MS, FENCES, OPERATION_TIMEOUT_MS, "
        "RECORD_OWNER, WAKE_UPS.",
    )


def test_e003_a_misspelled_setting_of_an_alias(settings):
    settings.SYNCGUARD_BACKENDS = {"default": {"BACKEND": MEMORY, "OPTION": {"CLOCK": "x"}}}
    assert only(run()) == (
        "syncguard.E003",
        checks.ERROR,
        "Lock backend 'default' is misconfigured: Unknown setting 'OPTION' in "
        "SYNCGUARD_BACKENDS['default']; the settings are BACKEND, KEY_PREFIX, LOCATION, "
        "OPTIONS. Did you mean 'OPTIONS'?",
        None,
    )


@pytest.mark.parametrize(
    ("backend", "extra"),
    [
        (MEMORY, {}),
        (DATABASE, {}),
        (FIRESTORE, {"OPTIONS": {"PROJECT": "p"}}),
    ],
)
def test_e003_key_prefix_where_it_has_no_meaning(settings, backend, extra):
    settings.SYNCGUARD_BACKENDS = {"default": {"BACKEND": backend, "KEY_PREFIX": "app1", **extra}}
    name = backend.rsplit(".", 1)[1]
    assert only(run()) == (
        "syncguard.E003",
        checks.ERROR,
        f"Lock backend 'default' is misconfigured: KEY_PREFIX has no meaning for {name}: "
        "its locks live in tables or collections of their own. Remove it (or name other "
        "tables or collections in OPTIONS).",
        None,
    )


@pytest.mark.usefixtures("debug")
def test_key_prefix_is_accepted_where_keys_share_a_namespace(settings):
    settings.SYNCGUARD_BACKENDS = {
        "default": {"BACKEND": MEMORY},
        "redis": {"BACKEND": REDIS, "LOCATION": "redis://127.0.0.1:1/0", "KEY_PREFIX": "app1"},
    }
    assert run() == []


@pytest.mark.usefixtures("debug")
def test_w013_nested_key_prefixes_on_one_redis(settings):
    url = "redis://127.0.0.1:1/0"
    settings.SYNCGUARD_BACKENDS = {
        "default": {"BACKEND": MEMORY},
        "app": {"BACKEND": REDIS, "LOCATION": url, "KEY_PREFIX": "app"},
        "tenant": {"BACKEND": REDIS, "LOCATION": url, "KEY_PREFIX": "app:tenant"},
        "apple": {"BACKEND": REDIS, "LOCATION": url, "KEY_PREFIX": "apple"},  # not nested
        "elsewhere": {"BACKEND": REDIS, "LOCATION": "redis://127.0.0.1:1/1", "KEY_PREFIX": "app:x"},
    }
    assert only(run()) == (
        "syncguard.W013",
        checks.WARNING,
        W013.format(outer="app", inner="tenant", outer_prefix="app", inner_prefix="app:tenant"),
        W013_HINT,
    )


def test_e003_lock_and_fence_storage_named_the_same(settings):
    settings.SYNCGUARD_BACKENDS = {
        "default": {
            "BACKEND": FIRESTORE,
            "OPTIONS": {"COLLECTION": "locks", "FENCE_COLLECTION": "locks"},
        }
    }
    assert only(run()) == (
        "syncguard.E003",
        checks.ERROR,
        "Lock backend 'default' is misconfigured: OPTIONS['COLLECTION'] and "
        "OPTIONS['FENCE_COLLECTION'] must differ: cleanup of lock documents must never "
        "reach fence counters.",
        None,
    )


def test_e003_database_option_that_is_not_a_string(settings):
    settings.SYNCGUARD_BACKENDS = {"default": {"BACKEND": DATABASE, "OPTIONS": {"DATABASE": 1}}}
    assert only(run())[:3] == (
        "syncguard.E003",
        checks.ERROR,
        "Lock backend 'default' is misconfigured: "
        "OPTIONS['DATABASE'] must name an alias of DATABASES.",
    )


# ------------------------------------------------------------------- E004
def test_e004_database_backend_on_an_unsupported_vendor(settings):
    settings.SYNCGUARD_BACKENDS = {
        "default": {"BACKEND": DATABASE, "OPTIONS": {"DATABASE": "unsupported"}}
    }
    assert only(run()) == (
        "syncguard.E004",
        checks.ERROR,
        "Lock backend 'default': DATABASES['unsupported'] is a 'unknown' database, which the "
        "database backend does not support (supported: postgresql, sqlite).",
        "Point OPTIONS['DATABASE'] at a PostgreSQL or SQLite alias of DATABASES, or use the "
        "Redis or Firestore backend.",
    )
    assert only(run())[2:] == (
        E004.format(
            alias="default",
            database="unsupported",
            vendor="unknown",
            supported="postgresql, sqlite",
        ),
        E004_HINT,
    )


# ------------------------------------------------------------------- E005
def test_e005_database_alias_missing_from_databases(settings):
    settings.SYNCGUARD_BACKENDS = {
        "default": {"BACKEND": DATABASE, "OPTIONS": {"DATABASE": "replica"}}
    }
    configured = ", ".join(repr(alias) for alias in connections.settings)
    assert configured.startswith("'default', ")
    assert only(run()) == (
        "syncguard.E005",
        checks.ERROR,
        "Lock backend 'default': OPTIONS['DATABASE'] = 'replica' is not an alias of DATABASES "
        f"(configured: {configured}).",
        None,
    )
    assert E005.startswith("Lock backend {alias!r}: OPTIONS['DATABASE']")


# ------------------------------------------------------------------- E006
@pytest.mark.usefixtures("debug")
def test_e006_locked_function_using_an_unknown_alias():
    @locked("report:<n>", using="reports")
    def build_report(n): ...

    assert only(run()) == (
        "syncguard.E006",
        checks.ERROR,
        f"{here('test_e006_locked_function_using_an_unknown_alias')}.build_report is "
        "decorated with @locked(using='reports'), but SYNCGUARD_BACKENDS has no alias "
        "'reports' (configured: 'default').",
        "Add the alias to SYNCGUARD_BACKENDS, or pass using= one that it defines.",
    )
    assert only(run())[3] == E006_HINT


def test_e006_default_alias_missing_from_an_explicit_setting(settings):
    settings.DEBUG = True
    settings.SYNCGUARD_BACKENDS = {"main": {"BACKEND": MEMORY}}

    @locked("job")
    def job(): ...

    assert only(run())[:3] == (
        "syncguard.E006",
        checks.ERROR,
        E006.format(
            function=f"{here('test_e006_default_alias_missing_from_an_explicit_setting')}.job",
            using="default",
            configured="'main'",
        ),
    )


@pytest.mark.usefixtures("debug")
def test_e006_not_for_a_backend_object_or_a_with_block():
    backend = MemoryBackend("private")

    @locked("job", using=backend)
    def job(): ...

    guard = locked("other", using="nowhere")  # used with `with`, never decorating
    assert guard is not None
    assert run() == []


# ------------------------------------------------------------------- W001
def test_w001_memory_backend_while_debug_is_false(settings):
    settings.DEBUG = False
    assert only(run()) == (
        "syncguard.W001",
        checks.WARNING,
        "Lock backend 'default' is the in-process MemoryBackend while DEBUG is False: "
        "it excludes nothing across processes.",
        None,
    )
    assert W001.format(alias="default") == only(run())[2]


# ------------------------------------------------------------------- W002
@pytest.mark.parametrize("mode", ["IMMEDIATE", "exclusive"])
def test_w002_sqlite_transactions_that_take_the_write_lock_up_front(settings, monkeypatch, mode):
    del settings.SYNCGUARD_BACKENDS  # the database backend over DATABASES["default"]
    options = {**connections.settings["default"]["OPTIONS"], "transaction_mode": mode}
    monkeypatch.setitem(connections.settings["default"], "OPTIONS", options)
    assert only(run()) == (
        "syncguard.W002",
        checks.WARNING,
        "Lock backend 'default' keeps its locks in the SQLite database DATABASES['default'], "
        f"whose OPTIONS['transaction_mode'] is {mode!r}: every atomic() block takes the "
        "database's write lock as it starts, and the lock backend writes through its own "
        "connection, so no lock can be taken or released inside such a block (it fails at "
        "once with ServiceUnavailable).",
        "Leave transaction_mode at Django's default for this database, or keep the locks in "
        "an SQLite database of their own (README: SQLite set-up).",
    )
    assert (W002.format(alias="default", database="default", mode=mode), W002_HINT) == (
        only(run())[2:]
    )


def test_no_w002_for_atomic_requests_on_sqlite(settings, monkeypatch):
    # A lock taken before the request's first write (the decorator on the view) is taken
    # at once and released after the commit; one taken later fails with a clear error.
    del settings.SYNCGUARD_BACKENDS
    monkeypatch.setitem(connections.settings["default"], "ATOMIC_REQUESTS", True)
    assert run() == []


def test_no_w002_on_postgresql_whose_releases_wait_for_the_commit(settings, monkeypatch):
    settings.DEBUG = True
    settings.SYNCGUARD_BACKENDS = {
        "default": {"BACKEND": DATABASE, "OPTIONS": {"DATABASE": "postgres"}}
    }
    monkeypatch.setitem(connections.settings["postgres"], "ATOMIC_REQUESTS", True)
    assert run() == []


def test_w002_not_without_atomic_requests(settings):
    del settings.SYNCGUARD_BACKENDS
    assert connections.settings["default"]["ATOMIC_REQUESTS"] is False
    assert run() == []


# ------------------------------------------------------------------- W003
@pytest.mark.usefixtures("debug")
def test_w003_ttl_not_longer_than_the_operation_timeout():
    @locked("job", ttl_ms=5_000)  # the default OPERATION_TIMEOUT_MS is 5000
    def job(): ...

    assert only(run()) == (
        "syncguard.W003",
        checks.WARNING,
        f"{here('test_w003_ttl_not_longer_than_the_operation_timeout')}.job: "
        "@locked(ttl_ms=5000) is not longer than OPERATION_TIMEOUT_MS of lock backend "
        "'default' (5000 ms): the lease can expire before one call to the server is allowed "
        "to fail.",
        "Give ttl_ms more than OPERATION_TIMEOUT_MS, or lower OPERATION_TIMEOUT_MS.",
    )
    assert only(run())[3] == W003_TTL_HINT


def test_w003_reads_the_alias_operation_timeout(settings):
    settings.DEBUG = True
    settings.SYNCGUARD_BACKENDS = {
        "default": {"BACKEND": MEMORY},
        "slow": {"BACKEND": MEMORY, "OPTIONS": {"OPERATION_TIMEOUT_MS": 60_000}},
    }

    @locked("job", using="slow")  # the default ttl_ms, 30000
    def job(): ...

    @locked("fine", using="default")
    def fine(): ...

    assert only(run())[:3] == (
        "syncguard.W003",
        checks.WARNING,
        W003_TTL.format(
            function=f"{here('test_w003_reads_the_alias_operation_timeout')}.job",
            ttl_ms=30_000,
            using="slow",
            timeout=60_000,
        ),
    )


@pytest.mark.usefixtures("debug")
def test_w003_auto_extend_renewal_leaves_less_than_the_operation_timeout():
    @locked("job", ttl_ms=6_000, auto_extend=True)
    def job(): ...

    assert only(run()) == (
        "syncguard.W003",
        checks.WARNING,
        f"{here('test_w003_auto_extend_renewal_leaves_less_than_the_operation_timeout')}.job: "
        "@locked(ttl_ms=6000, auto_extend=True) renews every 2000 ms (a third of the TTL), "
        "leaving 4000 ms of lease, less than OPERATION_TIMEOUT_MS of lock backend 'default' "
        "(5000 ms): the lease can expire while a renewal is still allowed to wait for the "
        "server.",
        "Give ttl_ms at least 7500 ms (1.5 x OPERATION_TIMEOUT_MS), or lower OPERATION_TIMEOUT_MS.",
    )
    assert W003_RENEWAL_HINT.format(minimum=7500) == only(run())[3]
    assert W003_RENEWAL.startswith("{function}: @locked(ttl_ms={ttl_ms}, auto_extend=True)")


@pytest.mark.usefixtures("debug")
def test_w003_boundaries():
    @locked("a", ttl_ms=5_001)  # longer than the timeout: fine without auto_extend
    def a(): ...

    @locked("b", ttl_ms=7_500, auto_extend=True)  # 2/3 of it is exactly the timeout
    def b(): ...

    assert run() == []

    @locked("c", ttl_ms=7_499, auto_extend=True)
    def c(): ...

    [message] = run()
    assert message.id == "syncguard.W003"
    assert "renews every 2500 ms" in message.msg and "leaving 4999 ms" in message.msg


@pytest.mark.usefixtures("debug")
def test_w003_not_for_an_alias_that_failed_to_build(settings):
    settings.SYNCGUARD_BACKENDS = {
        "default": {"BACKEND": MEMORY, "OPTIONS": {"OPERATION_TIMEOUT_MS": 0}}
    }

    @locked("job", ttl_ms=1)
    def job(): ...

    assert [m.id for m in run()] == ["syncguard.E003"]


# ----------------------------------------------------------------- registry
def test_registry_records_each_decoration_once():
    def work(): ...

    for _ in range(3):
        locked("job", using="x", ttl_ms=1_000)(work)
    locked("job", using="x", ttl_ms=2_000, auto_extend=True)(work)
    name = f"{here('test_registry_records_each_decoration_once')}.work"
    assert registry.locked_functions() == (
        registry.LockedFunction(name, "x", 1_000, False, "job"),
        registry.LockedFunction(name, "x", 2_000, True, "job"),
    )


def test_registry_snapshot_and_restore():
    locked("job")(lambda: None)
    saved = registry.snapshot()
    registry.clear()
    assert registry.locked_functions() == ()
    registry.restore(saved)
    assert registry.locked_functions() == saved
    assert saved[0].name == f"{here('test_registry_snapshot_and_restore')}.<lambda>"


# ------------------------------------------------------------ manage.py check
def test_manage_py_check_fails_on_an_error(settings):
    settings.SYNCGUARD_BACKENDS = {"default": {"BACKEND": "nowhere.Backend"}}
    with pytest.raises(SystemCheckError, match=r"\(syncguard\.E002\)"):
        call_command("check")


def test_manage_py_check_fails_on_an_unknown_alias(settings):
    settings.DEBUG = True

    @locked("job", using="missing")
    def job(): ...

    with pytest.raises(SystemCheckError, match=r"\(syncguard\.E006\) .*\.job is decorated"):
        call_command("check")


def test_check_backends_can_be_called_directly(bad_shape):
    bad_shape.SYNCGUARD_BACKENDS = ["bad"]
    assert [m.id for m in check_backends()] == ["syncguard.E001"]


# ------------------------------------------------------------------- W006
@pytest.mark.usefixtures("debug")
def test_w006_signed_cookie_sessions_would_carry_the_inspector_s_keys(settings):
    settings.SESSION_ENGINE = "django.contrib.sessions.backends.signed_cookies"
    assert only(run()) == ("syncguard.W006", checks.WARNING, W006, W006_HINT)


@pytest.mark.usefixtures("debug")
@pytest.mark.parametrize(
    "engine",
    ["django.contrib.sessions.backends.db", "django.contrib.sessions.backends.cached_db"],
)
def test_w006_is_quiet_with_server_side_sessions(settings, engine):
    settings.SESSION_ENGINE = engine
    assert run() == []


@pytest.mark.usefixtures("debug")
def test_w006_is_quiet_without_the_admin(settings, monkeypatch):
    from django.apps import apps

    settings.SESSION_ENGINE = "django.contrib.sessions.backends.signed_cookies"
    installed = apps.is_installed
    monkeypatch.setattr(
        apps, "is_installed", lambda name: name != "django.contrib.admin" and installed(name)
    )
    assert run() == []


# ------------------------------------------------------------------- W004
@pytest.mark.usefixtures("debug")
def test_w004_a_parameter_written_as_literal_text():
    @locked("invoice:pk")
    def pay(pk): ...

    function = f"{here('test_w004_a_parameter_written_as_literal_text')}.pay"
    assert only(run()) == (
        "syncguard.W004",
        checks.WARNING,
        f"{function}: the key template 'invoice:pk' has 'pk' as literal text, and "
        f"{function} takes a parameter 'pk': every call locks the same key, whatever pk is.",
        "Write the parameter as a placeholder: @locked('invoice:<pk>').",
    )


@pytest.mark.usefixtures("debug")
def test_w004_names_each_literal_parameter_and_keeps_the_placeholders():
    @locked("acct-<account.id>:order:order_id", ttl_ms=60_000)
    def ship(account, order, order_id): ...

    messages = run()
    assert [m.id for m in messages] == ["syncguard.W004", "syncguard.W004"]
    assert ["has 'order' as" in messages[0].msg, "has 'order_id' as" in messages[1].msg] == [
        True,
        True,
    ]
    assert [m.hint for m in messages] == [
        "Write the parameter as a placeholder: @locked('acct-<account.id>:<order>:order_id').",
        "Write the parameter as a placeholder: @locked('acct-<account.id>:order:<order_id>').",
    ]


@pytest.mark.usefixtures("debug")
def test_w004_stays_quiet_for_placeholders_words_inside_others_and_self():
    class Jobs:
        @locked("jobs:self:<pk>")
        def run(self, pk): ...

    @locked("pk:<pk>")  # the literal "pk" is a label: the parameter is used
    def labelled(pk): ...

    @locked("invoice_pk:<n>")  # "pk" only inside a longer word
    def inner(pk, n): ...

    @locked("nightly-report")  # no parameter named like a word of it
    def report(day): ...

    assert run() == []


# ------------------------------------------------------------------- W005
#: The module the task modules below are made as (a task is found by its module name).
TASKS_MODULE = "tests.w005_tasks"

CELERY_TASKS = """
from celery import Celery

from django_syncguard import locked

app = Celery("w005", set_as_current=False)


@app.task(shared=False, acks_late=True, reject_on_worker_lost=True)
@locked("invoice:<invoice_id>", {options})
def pay_invoice(invoice_id): ...


@locked("invoice:<invoice_id>", {options})
def pay_now(invoice_id): ...  # the same options, but not a task
"""

DJANGO_TASKS = """
import django

if django.VERSION >= (6, 0):
    from django.tasks import task
else:
    from django_tasks import task

from django_syncguard import locked


@task()
@locked("invoice:<invoice_id>", {options})
def pay_invoice(invoice_id): ...
"""


@pytest.fixture
def task_module(monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], types.ModuleType]:
    """Runs a module's source as :data:`TASKS_MODULE` (its functions' names are then
    ``tests.w005_tasks.<name>``, as in a project's tasks module), the ``@locked``
    options put in for ``{options}``."""

    def make(source: str, options: str) -> types.ModuleType:
        module = types.ModuleType(TASKS_MODULE)
        monkeypatch.setitem(sys.modules, TASKS_MODULE, module)
        code = textwrap.dedent(source).replace("{options}", options)
        exec(compile(code, f"<{TASKS_MODULE}>", "exec"), vars(module))
        return module

    return make


def w005(framework: str, wait: str, limit: str, ttl_ms: int) -> tuple[str, int, str, str]:
    return (
        "syncguard.W005",
        checks.WARNING,
        f"{TASKS_MODULE}.pay_invoice is a {framework} task whose lock wait ends after at "
        f"most {wait} ms ({limit}), no later than the lease a killed worker leaves on its "
        f"key runs out: ttl_ms ({ttl_ms} ms) plus the 1000 ms before an expired lock can "
        "be taken over. When a worker dies holding the key, every run of the task queued "
        "behind it fails with AcquisitionTimeout.",
        f"Wait longer than ttl_ms + 1000 ms ({ttl_ms + 1000} ms here) plus the runs queued "
        "ahead (timeout_ms; max_retries too when its delays run out first), and keep the "
        "lease short with auto_extend=True, e.g. ttl_ms=10_000, auto_extend=True, "
        "timeout_ms=30_000; or pass on_contended='raise' and let the task queue retry.",
    )


@pytest.mark.usefixtures("debug")
def test_w005_the_old_readme_celery_task_waits_less_than_a_dead_holders_lease(task_module):
    """The README's first task example before issue 23: a killed worker's key stayed
    locked 31 s, and the tasks queued behind it gave up after 5 s."""
    pytest.importorskip("celery")
    task_module(CELERY_TASKS, "ttl_ms=30_000, auto_extend=True")

    assert only(run()) == w005("Celery", "5000", "timeout_ms=5000", 30_000)


@pytest.mark.usefixtures("debug")
def test_w005_a_django_task_and_the_boundary(task_module):
    task_module(DJANGO_TASKS, "ttl_ms=10_000, auto_extend=True, timeout_ms=11_000")
    assert only(run()) == w005("Django", "11000", "timeout_ms=11000", 10_000)

    registry.clear()
    task_module(DJANGO_TASKS, "ttl_ms=10_000, auto_extend=True, timeout_ms=11_001")
    assert run() == []


@pytest.mark.usefixtures("debug")
def test_w005_names_max_retries_when_its_delays_end_the_wait_first(task_module):
    pytest.importorskip("celery")
    # Ten fixed delays of 500 ms: the loop gives up after 5 s of its 60 s.
    task_module(
        CELERY_TASKS, 'ttl_ms=10_000, timeout_ms=60_000, backoff="fixed", retry_delay_ms=500'
    )

    assert only(run()) == w005(
        "Celery",
        "5000",
        "max_retries=10 delays of retry_delay_ms=500, fixed backoff, end before timeout_ms=60000",
        10_000,
    )


@pytest.mark.usefixtures("debug")
@pytest.mark.parametrize(
    "options",
    [
        # The README's first task example now.
        "ttl_ms=10_000, auto_extend=True, timeout_ms=30_000",
        # The queue's retries are the wait.
        'on_contended="raise"',
        'on_contended="skip"',
        # Exponential delays from 100 ms: ten of them add up to 102.3 s.
        "ttl_ms=10_000, timeout_ms=600_000",
    ],
)
def test_no_w005_for_a_wait_that_outlasts_the_lease_or_no_wait(task_module, options):
    pytest.importorskip("celery")
    task_module(CELERY_TASKS, options)
    assert run() == []


@pytest.mark.usefixtures("debug")
def test_no_w005_for_functions_that_are_not_tasks():
    """A view or a plain function gets its AcquisitionTimeout back; a nested function
    is not found under its module's name (the task decorator rebinds that name)."""
    pytest.importorskip("celery")
    from celery import Celery

    @locked("invoice:<invoice_id>")  # the default 5 s wait, 30 s lease
    def pay_invoice(invoice_id): ...

    Celery("w005-nested", set_as_current=False).task(shared=False)(pay_invoice)
    assert run() == []
