"""What a Lua script's calls cost on a Redis server that sat idle (issue 24).

    .venv/bin/python bench/lua_call_costs.py [--rounds 60] [--gaps 0,1,20]

Starts a throw-away ``redis-server`` on a free loopback port and logs every call in
its ``SLOWLOG``; the times below are the server's own, in µs (p50). Two tables:

1. **Small scripts**, each called after a pause of ``gap`` ms (0: back to back): an
   empty script, one ``TIME``, one ``GET``, the same ``GET`` four and ten times, one
   call of each of the eight commands the release script uses, and one
   ``cjson.decode`` of a grant record. A hand-off's release runs on a server that sat
   idle through the hold, so its cost is that of the first row plus, per command
   *kind*, a cold path through that command's code.
2. **The release script with one part taken out** (``bench/grant_scaling.py``'s
   queue of one waiter: the release grants the key each time), after the same pauses:
   as it is; the grant record parsed by a pattern instead of ``cjson``; without the
   ``PUBLISH``; without reading the fence floor. Each variant is a probe, not a
   working script (nothing must run without its floor, or tell nobody); together they
   say whether any one part of the release is worth removing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.grant_scaling import log_every_call, release_durations  # noqa: E402
from tests.support.servers import RedisServer  # noqa: E402

RECORD = (
    '["abcdefghijklmnopqrstuv","P#id:abcdefghijklmnopqrstuv","P#floor","30000","counter",'
    '"999999999999999","","","1000","1000","syncguard_p_0123456789abcdef0123456789abcdef"]'
)
SMALL = {
    "empty": "return 1",
    "TIME": "redis.call('TIME') return 1",
    "GET": "redis.call('GET', KEYS[1]) return 1",
    "GET x4": "for i = 1, 4 do redis.call('GET', KEYS[1]) end return 1",
    "GET x10": "for i = 1, 10 do redis.call('GET', KEYS[1]) end return 1",
    "the release's 8 kinds": """
redis.call('TIME')
redis.call('GET', KEYS[1])
redis.call('HMGET', 'h', 'a', 'b', 'c')
redis.call('DEL', 'none')
redis.call('HDEL', 'h', 'none', 'none2')
redis.call('HSET', 'h', 'a', 1, 'b', 2, 'c', 3)
redis.call('SET', 'index', 'h', 'PX', 10000)
redis.pcall('PUBLISH', 'channel', 'g 1 2 3')
return 1
""",
    "cjson.decode": f"local r = cjson.decode('{RECORD}') return 1",
}


def release_variants() -> dict[str, str]:
    from django_syncguard.backends.redis.scripts import RELEASE

    variants = {
        "as it is": RELEASE,
        "record by pattern": RELEASE.replace(
            "local r = cjson.decode(record)",
            'local r = {} for s in string.gmatch(record, \'"([^"]*)"\') do r[#r + 1] = s end',
        ),
        "no PUBLISH": RELEASE.replace(
            "redis.pcall('PUBLISH', r[11], 'g ' .. message .. ' ' .. h)", "local _ = message"
        ),
        "no floor read": RELEASE.replace("tonumber(redis.call('GET', r[3])) or 0", "0"),
    }
    for name, text in variants.items():
        if name != "as it is" and text == RELEASE:
            raise SystemExit(f"the release script changed: the variant {name!r} is stale")
    return variants


def timed(
    client: Any, calls: dict[str, tuple[Callable[[], Any], str]], gaps: list[float], rounds: int
) -> dict[tuple[str, float], float]:
    """The server's p50 time in the script of each of ``calls`` (name: (the call, the
    script's text)), each call made after a pause of each of ``gaps`` ms."""
    found: dict[tuple[str, float], list[int]] = {}
    for gap in gaps:
        for _ in range(rounds):
            for name, (call, script) in calls.items():
                client.slowlog_reset()
                if gap:
                    time.sleep(gap / 1000)
                call()
                found.setdefault((name, gap), []).extend(
                    duration for _, duration in release_durations(client, script)
                )
    return {cell: statistics.median(values) for cell, values in found.items()}


def small_scripts(client: Any, gaps: list[float], rounds: int) -> dict[tuple[str, float], float]:
    client.set("x", "y")
    client.hset("h", mapping={"a": 1, "b": 2, "c": 3, "w:1": "5 99", "t:1": RECORD})
    calls = {
        name: (partial(client.evalsha, client.script_load(text), 1, "x"), text)
        for name, text in SMALL.items()
    }
    return timed(client, calls, gaps, rounds)


def releases(url: str, gaps: list[float], rounds: int) -> dict[tuple[str, float], float]:
    from bench.grant_scaling import Queue
    from django_syncguard.backends.redis import RedisBackend, scripts

    calls: dict[str, tuple[Callable[[], Any], str]] = {}
    queues = []
    original = scripts.SCRIPTS["release"]
    try:
        for i, (name, text) in enumerate(release_variants().items()):
            scripts.SCRIPTS["release"] = text  # read when the backend registers its scripts
            backend = RedisBackend(f"v{i}", {"LOCATION": url, "KEY_PREFIX": f"v{i}"})
            queue = Queue(backend, "hot", 1)
            queue.cycle(full_read=False)  # untimed: the scripts get loaded
            queues.append(queue)
            calls[name] = (partial(queue.cycle, full_read=False), text)
    finally:
        scripts.SCRIPTS["release"] = original
    try:
        return timed(queues[0].backend.client, calls, gaps, rounds)
    finally:
        for queue in queues:
            queue.backend.close()


def table(title: str, cells: dict[tuple[str, float], float], gaps: list[float]) -> None:
    print(f"\n## {title}\n")
    print("| script | " + " | ".join(f"after {g:g} ms" for g in gaps) + " |")
    print("|---|" + "--:|" * len(gaps))
    for name in dict.fromkeys(name for name, _ in cells):
        print(f"| {name} | " + " | ".join(f"{cells[(name, g)]:,.0f}" for g in gaps) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--gaps", default="0,1,20", help="pauses before each call, in ms")
    args = parser.parse_args()
    gaps = [float(part) for part in args.gaps.split(",")]
    from bench.common import configure_django

    configure_django({})
    import redis

    server = RedisServer().start()
    try:
        url = f"redis://127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(url)
        log_every_call(client, 100_000)
        small = small_scripts(client, gaps, args.rounds)
        release = releases(url, gaps, args.rounds)
        client.close()
    finally:
        server.stop()
    print(
        f"# Lua calls on an idle Redis: server time per script call (SLOWLOG), p50 in µs, "
        f"{args.rounds} calls per cell"
    )
    table("Small scripts", small, gaps)
    table("The release script (a grant to the one waiter), one part taken out", release, gaps)


if __name__ == "__main__":
    main()
