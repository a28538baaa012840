"""Count the package's function calls from an uncontended ``@locked`` call to its
acquire statement.

    .venv/bin/python scripts/call_path.py [--backend postgres|redis|memory]
        [--source PATH] [--dsn postgresql://...] [--redis-url redis://...] [-v]

One function decorated with ``@locked("callpath:<name>")`` (the alias ``default`` of
``SYNCGUARD_BACKENDS``: the database backend on PostgreSQL, Redis or memory, with
their default options) is called once to warm up (imports, connections, Lua scripts,
caches), then once more on a fresh key, measured. From entering the decorated
function until the acquire goes to the server, ``sys.setprofile`` sees every call
made in the calling thread; counted are those whose code lives in the
``django_syncguard`` package being measured (``"call"`` events, so a generator's
resumption counts as a call: a ``@contextmanager`` is entered by resuming it).
Where it stops:

- ``postgres``: psycopg's ``Cursor.execute`` (the acquire statement);
- ``redis``: redis-py's ``send_packed_command`` (the ``EVALSHA``);
- ``memory``: the backend's clock (``OPTIONS["CLOCK"]``), which it reads inside the
  store's critical section: the memory backend's "statement".

It prints the number of calls and of distinct modules; ``-v`` adds the calls in order
(``module:function``, indented by depth) and what was sent. ``--source PATH`` measures
another tree's package (only its ``django_syncguard`` directory is put first on
``sys.path``; this script need not exist there). Without ``--dsn`` / ``--redis-url`` it
starts a throw-away server of the test harness (``tests/support/servers.py``) on a free
loopback port.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import configure_django, imported_from, shadow_package  # noqa: E402

BACKENDS = {
    "postgres": "django_syncguard.backends.database.DatabaseBackend",
    "redis": "django_syncguard.backends.redis.RedisBackend",
    "memory": "django_syncguard.backends.memory.MemoryBackend",
}


def clock_ms() -> int:
    """The memory backend's clock here: where its count stops (see the docstring)."""
    import time

    return time.time_ns() // 1_000_000


@dataclass
class Trace:
    """The package's calls seen until the statement, in order, with their depth."""

    package: str
    stop: Any  # (frame) -> the statement's description, or None to go on
    calls: list[tuple[int, str, str]] = field(default_factory=list)
    depth: int = 0
    statement: str = ""
    done: bool = False

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if self.done:
            return
        if event == "call":
            self.depth += 1
            sent = self.stop(frame)
            if sent is not None:
                self.statement, self.done = sent, True
                return
            path = frame.f_code.co_filename
            if path.startswith(self.package):
                module = Path(path).relative_to(self.package).with_suffix("")
                name = ".".join(("django_syncguard", *module.parts)).removesuffix(".__init__")
                self.calls.append((self.depth, name, frame.f_code.co_qualname))
        elif event == "return":
            self.depth -= 1

    @property
    def modules(self) -> list[str]:
        return sorted({module for _, module, _ in self.calls})


def stop_at(backend: str) -> Any:
    """The test that ends the count: the frame that sends the acquire."""
    if backend == "postgres":
        import psycopg

        driver = str(Path(psycopg.__file__).resolve().parent)

        def postgres(frame: FrameType) -> str | None:
            code = frame.f_code
            if code.co_name == "execute" and code.co_filename.startswith(driver):
                query = frame.f_locals.get("query")
                return " ".join(str(getattr(query, "obj", query)).split())[:160]
            return None

        return postgres
    if backend == "redis":
        import redis

        driver = str(Path(redis.__file__).resolve().parent)

        def redis_send(frame: FrameType) -> str | None:
            code = frame.f_code
            if code.co_name == "send_packed_command" and code.co_filename.startswith(driver):
                return packed_words(frame.f_locals.get("command"))
            return None

        return redis_send

    def memory(frame: FrameType) -> str | None:
        return "the store's clock read" if frame.f_code is clock_ms.__code__ else None

    return memory


def packed_words(command: Any) -> str:
    """``EVALSHA <sha> 2 ...`` from the RESP chunks redis-py sends."""
    chunks = command if isinstance(command, list | tuple) else [command]
    raw = b"".join(c if isinstance(c, bytes) else bytes(c) for c in chunks)
    words = [w for w in raw.split(b"\r\n") if w and w[:1] not in (b"*", b"$")]
    return b" ".join(words).decode(errors="replace")[:160]


@contextlib.contextmanager
def server(args: argparse.Namespace) -> Iterator[dict[str, Any]]:
    """The settings of ``--backend``'s alias ``default`` and ``DATABASES``, with a
    throw-away server unless ``--dsn`` / ``--redis-url`` names one."""
    if args.backend == "memory":
        yield {"backend": {"OPTIONS": {"CLOCK": clock_ms}}, "databases": {}}
    elif args.backend == "redis":
        if args.redis_url:
            yield {"backend": {"LOCATION": args.redis_url}, "databases": {}}
            return
        from tests.support.servers import RedisServer

        redis_server = RedisServer().start()
        try:
            yield {"backend": {"LOCATION": redis_server.url}, "databases": {}}
        finally:
            redis_server.destroy()
    else:
        backend = {"OPTIONS": {"DATABASE": "default"}}
        if args.dsn:
            yield {"backend": backend, "databases": {"default": dsn_database(args.dsn)}}
            return
        from bench.common import create_bench_database, postgres_database
        from tests.support.servers import PostgresServer

        pg = PostgresServer().start()
        try:
            create_bench_database(pg.port, "callpath")
            database = postgres_database(pg.port, name="callpath")
            yield {"backend": backend, "databases": {"default": database}}
        finally:
            pg.destroy()


def dsn_database(dsn: str) -> dict[str, Any]:
    """A ``DATABASES`` entry from ``postgresql://user:password@host:port/name``."""
    url = urlsplit(dsn)
    return {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": url.path.lstrip("/"),
        "USER": unquote(url.username or ""),
        "PASSWORD": unquote(url.password or ""),
        "HOST": url.hostname or "",
        "PORT": str(url.port or ""),
    }


def measure(args: argparse.Namespace, package: Path) -> Trace:
    with server(args) as found:
        backend = {"BACKEND": BACKENDS[args.backend], **found["backend"]}
        configure_django(found["databases"], {"default": backend})
        if args.backend == "postgres":
            from django.core.management import call_command

            call_command("migrate", "django_syncguard", verbosity=0)

        from django_syncguard import locked, locks

        @locked("callpath:<name>")
        def job(name: str) -> None:
            return None

        job("warm-up")  # imports, connections, scripts, prepared caches
        trace = Trace(str(package) + os.sep, stop_at(args.backend))
        key = f"fresh-{uuid.uuid4().hex[:12]}"
        sys.setprofile(trace)
        try:
            job(key)
        finally:
            sys.setprofile(None)
        locks.close_all()
    return trace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=BACKENDS, default="postgres")
    parser.add_argument("--source", type=Path, help="a tree whose django_syncguard to measure")
    parser.add_argument("--dsn", help="an existing PostgreSQL: postgresql://user@host:port/db")
    parser.add_argument("--redis-url", help="an existing Redis: redis://127.0.0.1:6379/0")
    parser.add_argument("-v", "--verbose", action="store_true", help="list the calls in order")
    args = parser.parse_args()
    os.environ.pop("DJANGO_SETTINGS_MODULE", None)
    tree = (args.source or ROOT).resolve()
    with tempfile.TemporaryDirectory(prefix="syncguard-callpath-") as scratch:
        if args.source:
            sys.path.insert(0, str(shadow_package(tree, Path(scratch))))
        import django_syncguard

        if not imported_from(django_syncguard, tree):
            raise SystemExit(f"django_syncguard came from {django_syncguard.__file__}")
        # Unresolved: code objects carry the path the module was imported by (under
        # --source, through the symlink).
        package = Path(django_syncguard.__file__).parent
        real = package.resolve()
        trace = measure(args, package)
    if not trace.done:
        raise SystemExit("the acquire was never sent: nothing to count up to")
    print(f"package: {real}")
    print(f"backend: {args.backend}; stopped at: {trace.statement}")
    if args.verbose:
        base = min((depth for depth, _, _ in trace.calls), default=0)
        for number, (depth, module, function) in enumerate(trace.calls, 1):
            print(f"{number:4} {'  ' * (depth - base)}{module}:{function}")
        print("modules: " + ", ".join(trace.modules))
    print(f"calls: {len(trace.calls)}")
    print(f"modules: {len(trace.modules)}")


if __name__ == "__main__":
    main()
