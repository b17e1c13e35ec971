"""requirements/lock.txt agrees with pyproject.toml: scripts/setup.sh installs the lock with
--no-deps, so a requirement the lock misses or pins outside its range would only show up as a
broken environment. Regenerate the lock with scripts/lock.sh."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

# Python 3.11 on: the lock pins cp311 wheels anyway.
tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "lock.txt"
# Pinned even if nothing requires them: setup.sh installs this pip first and builds rayckpt
# with this setuptools (--no-build-isolation).
UNREQUIRED_OK = {"pip", "setuptools"}


def parse_lock(text: str) -> dict[str, Version]:
    """Canonical name -> pinned version; every line that is not a comment must be `name==version`."""
    pins: dict[str, Version] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        if (
            req.url
            or req.marker
            or req.extras
            or len(specs) != 1
            or specs[0].operator != "=="
            or "*" in specs[0].version
        ):
            raise ValueError(f"lock line {n}: {line!r} is not a plain name==version pin")
        name = canonicalize_name(req.name)
        if name in pins:
            raise ValueError(f"lock line {n}: {req.name} is pinned twice")
        pins[name] = Version(specs[0].version)
    return pins


def root_requirements(pyproject: dict) -> list[Requirement]:
    """The package's dependencies and its `test` extra: what setup.sh installs."""
    project = pyproject["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]


def lock_problems(
    roots: list[Requirement], pins: dict[str, Version], requires: Callable[[str, Version], list[str]]
) -> tuple[list[str], set[str]]:
    """Walk the requirements from `roots` through each pinned package's own requirements
    (`requires(name, version)`, which raises LookupError when it cannot tell), with the extras
    asked for. Returns one message per problem (a requirement the lock misses or pins outside
    its range, a package whose requirements are unknown), and the names reached."""
    problems: list[str] = []
    extras_done: dict[str, set[str]] = {}
    todo = [(r, "pyproject.toml") for r in roots]
    while todo:
        req, by = todo.pop()
        name = canonicalize_name(req.name)
        pin = pins.get(name)
        if pin is None:
            problems.append(f"{req} (required by {by}): not in the lock")
            continue
        if not req.specifier.contains(pin, prereleases=True):
            problems.append(f"{req} (required by {by}): the lock pins {req.name}=={pin}")
        want = {""} | set(req.extras)
        if name in extras_done and want <= extras_done[name]:
            continue
        extras_done[name] = extras_done.get(name, set()) | want
        try:
            lines = requires(name, pin)
        except LookupError as e:
            problems.append(str(e))
            continue
        for line in lines:
            sub = Requirement(line)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in want):
                todo.append((sub, f"{name}=={pin}" + (f"[{','.join(sorted(req.extras))}]" if req.extras else "")))
    return problems, set(extras_done)


def installed_requires(name: str, pin: Version) -> list[str]:
    """The requirements of the installed `name`, which must be the locked version."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        raise LookupError(f"{name}=={pin} is in the lock but not installed: run scripts/setup.sh") from None
    if Version(dist.version).public != pin.public:
        raise LookupError(f"{name} {dist.version} is installed but the lock pins {pin}: run scripts/setup.sh")
    return dist.requires or []


@pytest.fixture(scope="module")
def pins() -> dict[str, Version]:
    return parse_lock(LOCK.read_text())


def test_lock_holds_every_requirement_of_pyproject_at_a_version_in_range(pins):
    roots = root_requirements(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    problems, _ = lock_problems(roots, pins, installed_requires)
    assert not problems, "requirements/lock.txt disagrees (regenerate it: scripts/lock.sh):\n" + "\n".join(problems)


def test_lock_pins_nothing_that_pyproject_does_not_need(pins):
    roots = root_requirements(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    _, reached = lock_problems(roots, pins, installed_requires)
    stale = sorted(set(pins) - reached - UNREQUIRED_OK)
    assert not stale, f"requirements/lock.txt pins packages nothing requires: {', '.join(stale)}"


def test_lock_pins_the_cpu_torch_setup_installs_first(pins):
    assert "torch" in pins, "requirements/lock.txt does not pin torch"
    assert str(pins["torch"]) == "2.13.0", (
        f"requirements/lock.txt pins torch=={pins['torch']}, setup.sh installs 2.13.0"
    )


# The checks above on small made-up inputs, so that each is seen to fail.

FAKE_REQUIRES = {
    "a": ["b>=2", "c; extra == 'x'", "d; extra == 'other'"],
    "b": [],
    "c": ["b<3"],
    "d": [],
}


def fake_requires(name: str, pin: Version) -> list[str]:
    if pin == Version("9"):
        raise LookupError(f"{name} 1 is installed but the lock pins 9")
    return FAKE_REQUIRES[name]


@pytest.mark.parametrize(
    "lock, problem",
    [
        ("b==2.0\nc==1\n", "a[x]>=1 (required by pyproject.toml): not in the lock"),
        ("a==0.5\nb==2.0\nc==1\n", "a[x]>=1 (required by pyproject.toml): the lock pins a==0.5"),
        ("a==1\nb==1.5\nc==1\n", "b>=2 (required by a==1[x]): the lock pins b==1.5"),
        ("a==1\nb==3\nc==1\n", "b<3 (required by c==1): the lock pins b==3"),
        ("a==1\nb==2\nc==9\n", "c 1 is installed but the lock pins 9"),
        ("a==1\nb==2\n", 'c; extra == "x" (required by a==1[x]): not in the lock'),
    ],
)
def test_lock_problems_names_the_package(lock, problem):
    problems, _ = lock_problems([Requirement("a[x]>=1")], parse_lock(lock), fake_requires)
    assert problems == [problem]


def test_lock_problems_follows_only_the_extras_asked_for():
    problems, reached = lock_problems([Requirement("a[x]>=1")], parse_lock("a==1\nb==2\nc==1\nd==1\n"), fake_requires)
    assert problems == []
    assert reached == {"a", "b", "c"}  # d, behind extra "other", is what the stale check reports


@pytest.mark.parametrize(
    "lock, message",
    [
        ("a>=1\n", "lock line 1: 'a>=1' is not a plain name==version pin"),
        ("a==1.*\n", "lock line 1: 'a==1.*' is not a plain name==version pin"),
        ("a[x]==1\n", "lock line 1: 'a[x]==1' is not a plain name==version pin"),
        ("a==1; python_version < '3'\n", "is not a plain name==version pin"),
        ("# c\nFoo_Bar==1\nfoo-bar==2\n", "lock line 3: foo-bar is pinned twice"),
    ],
)
def test_parse_lock_rejects_what_is_not_one_pin_per_package(lock, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_lock(lock)


# The Pythons the package declares: the lock installs on each, and scripts/setup.sh refuses the others.


def declared_pythons() -> SpecifierSet:
    return SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])


def lowest_declared(spec: SpecifierSet) -> Version:
    (lowest,) = [Version(s.version) for s in spec if s.operator == ">="]
    return lowest


def test_every_pin_installs_on_the_oldest_python_the_package_declares(pins):
    spec = declared_pythons()
    oldest = lowest_declared(spec)
    assert oldest in spec and f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}" in spec
    refused = []
    for name, pin in sorted(pins.items()):
        needs = importlib.metadata.distribution(name).metadata.get("Requires-Python")
        if needs and oldest not in SpecifierSet(needs):
            refused.append(f"{name}=={pin} requires Python {needs}")
    assert not refused, f"requirements/lock.txt pins what Python {oldest} cannot install: {refused}"


@pytest.mark.parametrize("version", ["3.10.14", "3.12.1"])
def test_setup_refuses_a_python_the_package_does_not_declare_in_one_line(tmp_path, version):
    fake = tmp_path / "python3"
    fake.write_text(f"#!/bin/sh\necho {version}\n")
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake)}
    done = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and done.stdout == "", done.stdout + done.stderr
    needs = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert done.stderr == f"error: {fake} is Python {version}; rayckpt needs Python {needs} (set PYTHON=...)\n"
