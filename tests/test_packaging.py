"""What we publish: the sdist and the wheel, and the README that becomes their page.

The archives are built the way a release builds them (``python -m build``: the sdist
from a copy of the source tree, then the wheel from that sdist), without build
isolation so that no download is needed: the test extra brings ``build``,
``setuptools`` and ``twine`` into the venv.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path

import django
import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "django_syncguard"
REPOSITORY = "https://github.com/django-syncguard/django-syncguard"

#: Never part of a source tree a release is built from: the venv, caches, earlier
#: builds, test servers' data.
NOT_SOURCE = {
    ".git",
    ".venv",
    ".tox",
    ".pytest_cache",
    ".mypy_cache",
    ".ruff_cache",
    ".test-servers",
    "__pycache__",
    "build",
    "dist",
    "test-artifacts",
}
#: Top-level folders of the repository that no archive may contain.
REPOSITORY_ONLY = ("tests", "bench", "example_project", "specs", "docs", "scripts", ".ci")


@dataclass(frozen=True)
class Dists:
    sdist: Path
    wheel: Path


def ignore_non_source(directory: str, names: list[str]) -> set[str]:
    return {
        name
        for name in names
        if name in NOT_SOURCE or name.endswith((".egg-info", ".pyc")) or ".sqlite3" in name
    }


@pytest.fixture(scope="module")
def dists(tmp_path_factory: pytest.TempPathFactory) -> Dists:
    """The sdist and the wheel, built from a copy of the source tree (a build writes
    ``*.egg-info`` into the tree it builds, and must not see an earlier one)."""
    work = tmp_path_factory.mktemp("packaging")
    source = work / "source"
    out = work / "dist"
    shutil.copytree(ROOT, source, ignore=ignore_non_source)
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (sdist,) = out.glob("*.tar.gz")
    (wheel,) = out.glob("*.whl")
    return Dists(sdist=sdist, wheel=wheel)


def package_files() -> set[str]:
    """Every file of the package in the source tree, as ``django_syncguard/...``."""
    return {
        path.relative_to(ROOT).as_posix()
        for path in (ROOT / PACKAGE).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"
    }


def sdist_files(sdist: Path) -> set[str]:
    """The sdist's files, relative to its top folder (``django_syncguard-<version>/``)."""
    with tarfile.open(sdist) as archive:
        names = [member.name for member in archive.getmembers() if member.isfile()]
    return {name.split("/", 1)[1] for name in names}


def wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {name for name in archive.namelist() if not name.endswith("/")}


def wheel_metadata(wheel: Path) -> tuple[str, dict[str, list[str]]]:
    """The wheel's METADATA: its body (the README) and its headers, each a list."""
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        message = HeaderParser().parsestr(archive.read(name).decode())
    headers: dict[str, list[str]] = {}
    for key, value in message.items():
        headers.setdefault(key, []).append(value)
    return str(message.get_payload()), headers


@pytest.mark.slow
def test_the_sdist_holds_the_package_readme_license_and_no_tests(dists: Dists) -> None:
    files = sdist_files(dists.sdist)

    assert {"LICENSE", "README.md", "pyproject.toml", "PKG-INFO"} <= files
    assert package_files() <= files
    assert not [name for name in files if name.split("/", 1)[0] in REPOSITORY_ONLY]
    assert not [name for name in files if "__pycache__" in name or name.endswith(".pyc")]
    with tarfile.open(dists.sdist) as archive:
        member = next(m for m in archive.getmembers() if m.name.endswith("/LICENSE"))
        extracted = archive.extractfile(member)
        assert extracted is not None
        license_text = extracted.read().decode()
    assert license_text.startswith("MIT License")
    assert "Copyright (c) 2026 The django-syncguard authors" in license_text


@pytest.mark.slow
def test_the_wheel_holds_every_package_file_and_nothing_else(dists: Dists) -> None:
    files = wheel_files(dists.wheel)
    dist_info = next(name.split("/", 1)[0] for name in files if ".dist-info/" in name)

    assert {name.split("/", 1)[0] for name in files} == {PACKAGE, dist_info}
    # Every file the app needs at run time: its migrations, the admin templates,
    # py.typed, the management commands (and static files, should it get any).
    assert {name for name in files if name.startswith(f"{PACKAGE}/")} == package_files()
    assert {
        f"{PACKAGE}/migrations/0001_initial.py",
        f"{PACKAGE}/templates/admin/django_syncguard/lock/inspector.html",
        f"{PACKAGE}/py.typed",
        f"{PACKAGE}/management/commands/syncguard_cleanup.py",
        f"{dist_info}/licenses/LICENSE",
    } <= files
    assert not [name for name in files if "__pycache__" in name or name.endswith(".pyc")]


@pytest.mark.slow
def test_the_metadata_names_the_license_and_the_repository(dists: Dists) -> None:
    readme, headers = wheel_metadata(dists.wheel)

    assert headers["License-Expression"] == ["MIT"]
    assert headers["License-File"] == ["LICENSE"]
    assert headers["Description-Content-Type"] == ["text/markdown"]
    urls = dict(value.split(", ", 1) for value in headers["Project-URL"])
    assert urls["Repository"] == REPOSITORY
    assert urls["Homepage"] == REPOSITORY
    assert readme.strip() == (ROOT / "README.md").read_text().strip()


@pytest.mark.slow
def test_twine_check_passes_strictly(dists: Dists) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", str(dists.sdist), str(dists.wheel)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_COLOR": "1"},
    )

    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("PASSED") == 2, done.stdout


@pytest.mark.slow
def test_the_demo_runs_from_the_wheel_alone(dists: Dists, tmp_path: Path) -> None:
    """The README's demo, in a copy of ``example_project/`` with the package installed
    from the wheel only: ``-S`` keeps this venv's editable install (a finder loaded by
    a ``.pth`` file) out, so the source tree is nowhere on ``sys.path``."""
    site = tmp_path / "site"
    installed = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"),
            *("--target", str(site), str(dists.wheel)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert installed.returncode == 0, installed.stderr
    example = tmp_path / "example_project"
    shutil.copytree(ROOT / "example_project", example, ignore=ignore_non_source)
    # Django's own site-packages folder holds the other dependencies too.
    dependencies = Path(django.__file__).resolve().parent.parent
    env = {
        **{k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"},
        "PYTHONPATH": os.pathsep.join([str(site), str(dependencies)]),
        "EXAMPLE_DB_PATH": str(tmp_path / "example.sqlite3"),
    }

    def run(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-S", *args],
            cwd=example,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    where = run("-c", "import django_syncguard; print(django_syncguard.__file__)").strip()
    assert Path(where).is_relative_to(site), where
    run("manage.py", "migrate", "--noinput", "--verbosity", "0")
    lines = run("manage.py", "syncguard_demo").splitlines()

    assert lines[-3:] == [
        "Result",
        "  Invoice INV-0042 paid=True by worker-2 (fence 000000000000002)",
        "  Payments recorded: 1 (worker-2, fence 000000000000002)",
    ]


# ---------------------------------------------------------------- the README page

FENCED_BLOCK = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.DOTALL)
INLINE_LINK = re.compile(r"(!?)\[[^\]]*\]\(\s*<?([^)\s>]*)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?([^\s>]+)", re.MULTILINE)
HTML_TARGET = re.compile(r"<(img|a)\b[^>]*?\b(?:src|href)\s*=\s*[\"']([^\"']*)", re.IGNORECASE)


def readme_targets() -> list[tuple[str, str]]:
    """Every link and image of README.md outside code: ``(kind, target)``."""
    text = CODE_SPAN.sub("", FENCED_BLOCK.sub("", (ROOT / "README.md").read_text()))
    targets = [("image" if bang else "link", url) for bang, url in INLINE_LINK.findall(text)]
    targets += [("link", url) for url in REFERENCE.findall(text)]
    targets += [
        ("image" if tag.lower() == "img" else "link", url) for tag, url in HTML_TARGET.findall(text)
    ]
    return targets


def github_anchor(heading: str) -> str:
    """The ``id`` GitHub gives a heading: lower case, punctuation but ``-`` and ``_``
    dropped, spaces made ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readme_links_only_to_absolute_urls_or_its_own_headings() -> None:
    """On a package index the README is shown without the repository around it:
    a relative link or image would be broken there."""
    targets = readme_targets()
    readme = (ROOT / "README.md").read_text()
    headings = {
        github_anchor(line.lstrip("#"))
        for line in FENCED_BLOCK.sub("", readme).splitlines()
        if re.match(r"^#{1,6} ", line)
    }

    assert len(targets) >= 10  # the parser found the README's links
    relative = [t for t in targets if not t[1].startswith(("https://", "#"))]
    assert relative == [], "relative links or images break on a package index page"
    missing = [url for _, url in targets if url.startswith("#") and url[1:] not in headings]
    assert missing == []
    # An image is its file itself (raw/), not GitHub's page about the file (blob/).
    assert [url for kind, url in targets if kind == "image" and "/blob/" in url] == []


def test_the_readme_link_checker_sees_relative_links() -> None:
    """The checker above would pass on a README it cannot parse; here it finds the
    relative links of a sample, and skips code."""
    sample = (
        "See [the spec](specs/contract.md), ![shot](docs/a.png) and <img src='b.png'>.\n"
        "[ref]: bench/README.md\n"
        "```python\nx = '[not a link](nowhere)'\n```\n"
        "`[nor this](nowhere)` but [this](https://example.org) and [that](#usage).\n"
    )
    text = CODE_SPAN.sub("", FENCED_BLOCK.sub("", sample))

    assert INLINE_LINK.findall(text) == [
        ("", "specs/contract.md"),
        ("!", "docs/a.png"),
        ("", "https://example.org"),
        ("", "#usage"),
    ]
    assert REFERENCE.findall(text) == ["bench/README.md"]
    assert HTML_TARGET.findall(text) == [("img", "b.png")]
    assert github_anchor(" Use it in your project") == "use-it-in-your-project"
    assert github_anchor(" `manage.py syncguard_cleanup`") == "managepy-syncguard_cleanup"
