#!/usr/bin/env python
"""Mutation run: put one plausible one-line bug at a time into the library and check that the
tests named for it fail.

Each mutant in the list (``scripts/mutants.py`` by default: ``MUTANTS``, a list of dicts) names a file, an ``original``
snippet that occurs exactly once in it, its ``replacement``, and the ``tests`` (pytest ids or
files) that must kill it. For every mutant the file is changed, those tests run in a fresh
``pytest`` process (``-x``, no bytecode written), and the file is restored byte for byte with its
old modification time, whatever happens: a test failure, a timeout, Ctrl-C, SIGTERM. A backup
(``FILE.mutate-orig``) exists while a mutant is in place; a later run restores any left behind
(after a SIGKILL) before it starts.

Outcomes: ``killed`` (a named test failed; the report names it), ``survived`` (all passed),
``skipped`` (every named test was skipped: nothing was checked), ``timeout`` (counted as killed:
the mutant hangs the tests), ``error`` (pytest could not run the tests: collection or usage
error). A mutant whose snippet is missing or not unique is refused before anything runs.
Every listed mutant must be killed: the exit status is 0 only then.

Usage::

    python scripts/mutate.py                      # every mutant, after a baseline run
    python scripts/mutate.py --only ID [ID ...]   # some of them
    python scripts/mutate.py --check              # only check that every snippet is unique
    python scripts/mutate.py --list               # the mutants and their tests
    python scripts/mutate.py --json report.json   # also write the report as JSON

Not part of the test suite: it runs pytest once per mutant (minutes for the whole list).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_LIST = ROOT / "scripts" / "mutants.py"
BACKUP_SUFFIX = ".mutate-orig"


@dataclass
class Mutant:
    id: str
    file: str
    original: str
    replacement: str
    tests: list[str]
    area: str = ""
    why: str = ""


@dataclass
class Outcome:
    mutant: Mutant
    status: str  # killed | survived | skipped | timeout | error | refused
    killer: str = ""
    seconds: float = 0.0
    detail: str = ""
    counts: dict = field(default_factory=dict)


class MutantListError(Exception):
    """The list of mutants cannot be read."""


def load_mutants(path: Path) -> list[Mutant]:
    """The ``MUTANTS`` list of the Python file ``path`` (dicts with id, file, original,
    replacement, tests and optionally area, why)."""
    try:
        data = runpy.run_path(str(path)).get("MUTANTS")
    except (OSError, SyntaxError) as err:
        raise MutantListError(f"{path}: cannot read the mutant list ({err}); expected a Python file defining MUTANTS") from err
    if not isinstance(data, list) or not data:
        raise MutantListError(f"{path}: no MUTANTS list found; expected MUTANTS = [dict(id=..., file=..., ...), ...]")
    mutants, seen = [], set()
    for k, entry in enumerate(data):
        missing = [key for key in ("id", "file", "original", "replacement", "tests") if key not in entry]
        if missing:
            raise MutantListError(f"{path}: mutant #{k + 1} lacks {', '.join(missing)}; each needs id, file, original, replacement, tests")
        if entry["id"] in seen:
            raise MutantListError(f"{path}: mutant id {entry['id']!r} appears twice; ids must be unique")
        if entry["original"] == entry["replacement"]:
            raise MutantListError(f"{path}: mutant {entry['id']!r} replaces its snippet by itself; give a different replacement")
        seen.add(entry["id"])
        tests = entry["tests"] if isinstance(entry["tests"], list) else [entry["tests"]]
        mutants.append(Mutant(entry["id"], entry["file"], entry["original"], entry["replacement"], list(tests),
                              entry.get("area", ""), entry.get("why", "")))  # fmt: skip
    return mutants


def snippet_problem(m: Mutant) -> Optional[str]:
    """One line saying why ``m`` cannot be applied (missing file, snippet not exactly once), or None."""
    path = ROOT / m.file
    if not path.is_file():
        return f"mutant {m.id}: file {m.file} does not exist; update the mutant's file"
    n = path.read_text().count(m.original)
    if n != 1:
        first = m.original.strip().splitlines()[0] if m.original.strip() else m.original
        return f"mutant {m.id}: original snippet {first!r} found {n} times in {m.file}, expected exactly once; update the snippet"
    return None


def restore_leftovers() -> list[str]:
    """Put back files a killed earlier run left mutated (their ``.mutate-orig`` backups)."""
    restored = []
    for backup in ROOT.rglob(f"*{BACKUP_SUFFIX}"):
        if ".git" in backup.parts:
            continue
        target = backup.with_name(backup.name[: -len(BACKUP_SUFFIX)])
        os.replace(backup, target)
        restored.append(str(target.relative_to(ROOT)))
    return restored


class Applied:
    """Context manager: the mutant is in the file inside, the original (bytes and mtime) after."""

    def __init__(self, m: Mutant) -> None:
        self.path = ROOT / m.file
        self.m = m

    def __enter__(self) -> "Applied":
        self.stat = self.path.stat()
        self.data = self.path.read_bytes()
        backup = self.path.with_name(self.path.name + BACKUP_SUFFIX)
        backup.write_bytes(self.data)
        os.utime(backup, ns=(self.stat.st_atime_ns, self.stat.st_mtime_ns))
        try:
            text = self.data.decode()
            self.path.write_text(text.replace(self.m.original, self.m.replacement, 1))
            # a modification time that no cached bytecode of the original can claim
            later = max(time.time(), self.stat.st_mtime + 2)
            os.utime(self.path, (later, later))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.path.write_bytes(self.data)
        os.utime(self.path, ns=(self.stat.st_atime_ns, self.stat.st_mtime_ns))
        self.path.with_name(self.path.name + BACKUP_SUFFIX).unlink(missing_ok=True)


def run_pytest(tests: list[str], *, timeout: float, extra: list[str]) -> tuple[str, str, float, dict]:
    """(status, first failing test, seconds, counts) of one pytest run over ``tests``."""
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        xml = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
               f"--junitxml={xml}", *extra, *tests]  # fmt: skip
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return "timeout", "", time.monotonic() - t0, {}
        except BaseException:  # Ctrl-C, SIGTERM: stop the tests too, then let the caller restore
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        seconds = time.monotonic() - t0
        counts = {"passed": 0, "failed": 0, "skipped": 0}
        failed = []
        if xml.is_file():
            for case in ET.parse(xml).getroot().iter("testcase"):
                name = f"{case.get('file') or case.get('classname', '').replace('.', '/') + '.py'}::{case.get('name')}"
                if case.find("failure") is not None or case.find("error") is not None:
                    counts["failed"] += 1
                    failed.append(name)
                elif case.find("skipped") is not None:
                    counts["skipped"] += 1
                else:
                    counts["passed"] += 1
        if proc.returncode == 1 and failed:
            return "killed", failed[0], seconds, counts
        if proc.returncode == 0:
            if counts["passed"] == 0:
                return "skipped", "", seconds, counts
            return "survived", "", seconds, counts
        tail = " | ".join(line for line in out.strip().splitlines()[-3:])
        return "error", f"pytest exit status {proc.returncode}" + (f": {tail}" if tail else ""), seconds, counts


def _sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mutants", type=Path, default=DEFAULT_LIST, help="the mutant list (TOML, [[mutant]] tables)")
    ap.add_argument("--only", nargs="+", metavar="ID", help="run only these mutants")
    ap.add_argument("--check", action="store_true", help="check that every snippet occurs exactly once, run nothing")
    ap.add_argument("--list", action="store_true", help="print the mutants and their tests")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run of every named test on the unmutated code")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per pytest run (a mutant that hangs: 'timeout')")
    ap.add_argument("--json", type=Path, help="also write the report here")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments, after --")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _sigterm)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started with SIGINT ignored (a background job)
    lock = open(Path(tempfile.gettempdir()) / f"mutate-{hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]}.lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        print(f"another mutation run is using {ROOT}; wait for it to end (two runs would undo each other's mutants)", file=sys.stderr)
        return 2
    for f in restore_leftovers():
        print(f"restored {f} from a backup an interrupted run left behind")
    try:
        mutants = load_mutants(args.mutants)
    except MutantListError as err:
        print(err, file=sys.stderr)
        return 2
    if args.only:
        unknown = sorted(set(args.only) - {m.id for m in mutants})
        if unknown:
            print(f"unknown mutant id(s) {', '.join(unknown)}; see --list", file=sys.stderr)
            return 2
        mutants = [m for m in mutants if m.id in args.only]
    if args.list:
        for m in mutants:
            print(f"{m.id:32s} {m.area:22s} {m.file}\n{'':32s} tests: {' '.join(m.tests)}")
        return 0
    problems = [p for p in (snippet_problem(m) for m in mutants) if p]
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        return 2
    if args.check:
        print(f"{len(mutants)} mutants, every snippet found exactly once")
        return 0

    if not args.no_baseline:
        tests = list(dict.fromkeys(t for m in mutants for t in m.tests))
        print(f"baseline: {len(tests)} test ids on the unmutated code ...", flush=True)
        status, first, seconds, counts = run_pytest(tests, timeout=args.timeout * 3, extra=args.pytest_args)
        if status != "survived":
            print(f"baseline: the named tests do not pass unmutated ({status}: {first}); fix them first", file=sys.stderr)
            return 2
        print(f"baseline: {counts['passed']} passed, {counts['skipped']} skipped in {seconds:.0f} s", flush=True)

    outcomes: list[Outcome] = []
    try:
        for k, m in enumerate(mutants, 1):
            print(f"[{k}/{len(mutants)}] {m.id} ({m.file}) ...", end=" ", flush=True)
            with Applied(m):
                status, first, seconds, counts = run_pytest(m.tests, timeout=args.timeout, extra=args.pytest_args)
            o = Outcome(m, status, killer=first if status == "killed" else "", seconds=seconds,
                        detail=first if status == "error" else "", counts=counts)  # fmt: skip
            outcomes.append(o)
            by = f" by {o.killer}" if o.killer else (f": {o.detail}" if o.detail else "")
            print(f"{status} in {seconds:.0f} s{by}", flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted: the mutated file was restored", file=sys.stderr)
        return 130

    print("\nmutant                                 area                   outcome   killing test")
    for o in outcomes:
        print(f"{o.mutant.id:38s} {o.mutant.area:22s} {o.status:9s} {o.killer or o.detail}")
    killed = sum(o.status in ("killed", "timeout") for o in outcomes)
    print(f"\n{killed} of {len(outcomes)} mutants killed")
    if args.json:
        args.json.write_text(json.dumps([{"id": o.mutant.id, "file": o.mutant.file, "area": o.mutant.area, "status": o.status,
                                          "killer": o.killer, "detail": o.detail, "seconds": round(o.seconds, 1),
                                          "tests": o.mutant.tests} for o in outcomes], indent=1))  # fmt: skip
    return 0 if killed == len(outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
