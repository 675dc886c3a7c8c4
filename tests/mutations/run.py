"""Mutation proof of the case tests: each fault-reintroducing patch must make its named test fail.

::

    MUTATIONS (tests/mutations/mutations.py: case, file, old text, new text, test node ids)
        │ check: every ``old`` occurs exactly once in its file (else stop before running anything)
        ▼
    baseline: the named tests pass on an unpatched scratch copy of the tree
        ▼
    per mutation, in its own scratch copy (2 at a time):  patch ──▶ pytest <its tests>
        exit 1 (a test failed) or past the time limit: killed     exit 0: SURVIVED
        anything else (collection error, usage error): ERROR

The working tree is never modified: the tracked and untracked (not ignored) files are copied to a
temporary directory, ``workers``, ``ipc`` and ``tools`` are linked into the copy's ``kvoffload``
folder (as setup.cfg's ``package_dir`` maps them), and the copy is put first on ``PYTHONPATH``, so
it is imported in place of the installed package (the editable install's finder comes after the
path). Worker processes inherit ``PYTHONPATH`` and the working directory, so they run the patched
code too; each scratch copy is checked to import from itself before it is used. Tests wait at most
:data:`WAIT_S` for what should come (``KVOFFLOAD_TEST_WAIT_S``), so a patch that hangs a test costs
seconds, not the suite's two-minute bounds. ``--no-baseline`` is for a run right after the suite has
passed (CI): the baseline only re-runs tests it has just passed.

Usage: ``python tests/mutations/run.py [-j 2] [--case C08 ...] [--no-baseline] [--keep]``
(``tox -e mutations`` runs it); ``--list`` prints the mutations under their case's title from
docs/cases.md, the catalogue of cases, and runs nothing. Exit status: 0 every mutation killed, 1
one survived or errored, 2 a patch does not apply or the baseline fails.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))  # last: tests/ holds modules named like libraries (s3, prom)

import case_catalogue  # noqa: E402
from mutations import MUTATIONS, Mutation  # noqa: E402

# setup.cfg's package_dir: these top-level folders are subpackages of kvoffload once installed.
_MAPPED = {"workers": "workers", "ipc": "ipc", "tools": "tools"}
_SKIP_DIRS = {
    ".git",
    ".tox",
    ".venv",
    "__pycache__",
    ".pytest_cache",
    ".hypothesis",
    "build",
    "dist",
}


@dataclass
class Outcome:
    mutation: Mutation
    verdict: str  # killed | SURVIVED | ERROR
    seconds: float
    detail: str = ""


def repo_files(repo: str) -> list[str]:
    """Tracked files plus untracked ones git does not ignore (the working tree as it is now)."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        check=True,
        capture_output=True,
    ).stdout
    return sorted({p for p in out.decode().split("\0") if p})


def check_patches(mutations: list[Mutation], repo: str) -> list[str]:
    """Problems with the list: an ``old`` text not found exactly once, a patched Python file that
    does not compile, an unknown file, a test file that does not exist, a duplicate name."""
    problems = []
    names = set()
    for mu in mutations:
        if mu.name in names:
            problems.append(f"{mu.case} {mu.name!r}: duplicate name")
        names.add(mu.name)
        path = os.path.join(repo, mu.file)
        if not os.path.isfile(path):
            problems.append(f"{mu.case} {mu.name!r}: no file {mu.file}")
            continue
        with open(path, encoding="utf-8") as f:
            text = f.read()
        n = text.count(mu.old)
        if n != 1:
            problems.append(
                f"{mu.case} {mu.name!r}: the text to replace occurs {n} times in "
                f"{mu.file} (must be exactly once):\n{mu.old}"
            )
        elif mu.file.endswith(".py"):
            try:  # a patch that breaks the syntax "fails" every test for the wrong reason
                compile(text.replace(mu.old, mu.new), mu.file, "exec")
            except SyntaxError as e:
                problems.append(
                    f"{mu.case} {mu.name!r}: the patched {mu.file} does not compile: "
                    f"{e.msg} (line {e.lineno})"
                )
        if mu.old == mu.new:
            problems.append(f"{mu.case} {mu.name!r}: the patch changes nothing")
        if not mu.tests:
            problems.append(f"{mu.case} {mu.name!r}: no test named")
        for t in mu.tests:
            if not os.path.isfile(os.path.join(repo, t.split("::")[0])):
                problems.append(f"{mu.case} {mu.name!r}: no test file for {t}")
    return problems


def make_scratch(repo: str, files: list[str], parent: str, label: str) -> str:
    """A copy of ``files`` under ``parent/label/tree``, importable as the kvoffload package."""
    root = os.path.join(parent, label)
    tree = os.path.join(root, "tree")
    for rel in files:
        if set(rel.split("/")[:-1]) & _SKIP_DIRS:
            continue
        src = os.path.join(repo, rel)
        if not os.path.isfile(src):  # listed but deleted in the working tree
            continue
        dst = os.path.join(tree, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copy2(src, dst)
    for sub, folder in _MAPPED.items():
        os.symlink(os.path.join("..", folder), os.path.join(tree, "kvoffload", sub))
    return root


#: The most a test waits for what should come under a patch (``KVOFFLOAD_TEST_WAIT_S``, read by
#: tests/helpers.py's ``patience`` and the tier contract's ``WAIT_S``): a patch that makes the
#: awaited thing never come fails its test in this time, not in the suite's minutes. Thirty times
#: what those waits take on an idle 2-core machine.
WAIT_S = "30"


def env_for(scratch: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("KVOFFLOAD_TEST_WAIT_S", WAIT_S)
    tree = os.path.join(scratch, "tree")
    env["PYTHONPATH"] = tree + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def check_isolation(scratch: str) -> None:
    """The copy, not the installed package, is what Python (and so every worker) imports."""
    code = (
        "import kvoffload, kvoffload.workers.fs_io as w, kvoffload.ipc.arena as a, "
        "kvoffload.tools.cli as c; print(kvoffload.__file__, w.__file__, a.__file__, c.__file__)"
    )
    tree = os.path.join(scratch, "tree")
    for cwd in (tree, scratch):
        out = subprocess.run(
            [sys.executable, "-c", code],
            env=env_for(scratch),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=120,
        )
        paths = out.stdout.split()
        if out.returncode != 0 or len(paths) != 4 or not all(p.startswith(tree) for p in paths):
            raise SystemExit(
                f"the scratch copy {scratch} does not shadow the installed package "
                f"(from {cwd}):\n{out.stdout}{out.stderr}"
            )


def apply(mu: Mutation, tree: str) -> None:
    path = os.path.join(tree, mu.file)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if text.count(mu.old) != 1:
        raise RuntimeError(f"{mu.case} {mu.name!r}: patch no longer applies to {mu.file}")
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace(mu.old, mu.new))


def pytest_cmd(tests: list[str], scratch: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=--strict-markers",
        "--basetemp",
        os.path.join(scratch, "pytest-tmp"),
        *tests,
    ]


def run_tests(tests: list[str], scratch: str, limit_s: float) -> tuple[int | None, float, str]:
    """(pytest exit status or None on time-out, seconds, output tail)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        pytest_cmd(tests, scratch),
        cwd=os.path.join(scratch, "tree"),
        env=env_for(scratch),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=limit_s)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the session this pytest started: its workers too
        out, _ = proc.communicate()
        rc = None
    return rc, time.monotonic() - t0, "\n".join(out.splitlines()[-25:])


def run_one(
    mu: Mutation, files: list[str], parent: str, label: str, limit_s: float, keep: bool
) -> Outcome:
    scratch = make_scratch(REPO, files, parent, label)
    try:
        apply(mu, os.path.join(scratch, "tree"))
        rc, secs, tail = run_tests(list(mu.tests), scratch, limit_s)
    finally:
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)
    if rc is None:
        return Outcome(mu, "killed", secs, f"(time limit {limit_s:.0f} s)")
    if rc == 1:
        return Outcome(mu, "killed", secs)
    if rc == 0:
        return Outcome(mu, "SURVIVED", secs, tail)
    return Outcome(mu, "ERROR", secs, f"pytest exit status {rc}\n{tail}")


def print_list(chosen: list[Mutation], whole: bool) -> None:
    """The mutations grouped under their case's title from docs/cases.md, in case order; with
    ``whole`` (no --case or --name), then the catalogue's cases that have no mutation."""
    titles = case_catalogue.titles()
    cases = sorted({mu.case for mu in chosen})
    for case in cases:
        print(titles.get(case, f"{case} (no entry in docs/cases.md)"))
        for mu in chosen:
            if mu.case == case:
                print(f"  {mu.case}  {mu.name}  ({mu.file})  -> {' '.join(mu.tests)}")
    if whole:
        bare = [case for case in titles if case not in cases]
        if bare:
            print(f"\nno mutation yet ({len(bare)} of {len(titles)} cases): {', '.join(bare)}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-j", "--jobs", type=int, default=2, help="mutations run at once (default 2)")
    ap.add_argument(
        "--case",
        action="append",
        default=[],
        help="only this case's mutations (repeatable), e.g. C08",
    )
    ap.add_argument("--name", action="append", default=[], help="only the mutation of this name")
    ap.add_argument(
        "--no-baseline",
        action="store_true",
        help="skip checking that the named tests pass unpatched",
    )
    ap.add_argument(
        "--limit-s",
        type=float,
        default=420.0,
        help="time limit per mutation's test run (seconds; past it counts as killed)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the scratch copies (for debugging)")
    ap.add_argument(
        "--list",
        action="store_true",
        help="list the mutations under their case's title (docs/cases.md) and exit",
    )
    args = ap.parse_args(argv)

    chosen = [
        mu
        for mu in MUTATIONS
        if (not args.case or mu.case in args.case) and (not args.name or mu.name in args.name)
    ]
    if args.list:
        print_list(chosen, whole=not (args.case or args.name))
        return 0
    problems = check_patches(chosen, REPO)
    if problems:
        print("mutation list does not apply:\n" + "\n".join(problems), file=sys.stderr)
        return 2
    if not chosen:
        print("no mutation chosen", file=sys.stderr)
        return 2
    files = repo_files(REPO)
    parent = tempfile.mkdtemp(prefix="kvoffload-mutations-")
    t_start = time.monotonic()
    try:
        check_isolation(make_scratch(REPO, files, parent, "isolation"))
        if not args.no_baseline:
            tests = list(dict.fromkeys(t for mu in chosen for t in mu.tests))
            jobs = max(1, min(args.jobs, len(tests)))
            print(
                f"baseline: {len(tests)} test(s) on the unpatched tree, {jobs} at a time ...",
                flush=True,
            )
            t0 = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
                runs = list(
                    pool.map(
                        lambda i: run_tests(
                            tests[i::jobs],
                            make_scratch(REPO, files, parent, f"baseline{i}"),
                            3 * args.limit_s,
                        ),
                        range(jobs),
                    )
                )
            failed = [(rc, tail) for rc, _, tail in runs if rc != 0]
            if failed:
                print(
                    f"baseline failed (exit {failed[0][0]}): the named tests must pass "
                    f"unpatched\n{failed[0][1]}",
                    file=sys.stderr,
                )
                return 2
            print(f"baseline: passed in {time.monotonic() - t0:.0f} s", flush=True)
        outcomes: list[Outcome] = []
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            futs = {
                pool.submit(run_one, mu, files, parent, f"m{i:03d}", args.limit_s, args.keep): mu
                for i, mu in enumerate(chosen)
            }
            for fut in concurrent.futures.as_completed(futs):
                o = fut.result()
                outcomes.append(o)
                print(
                    f"{o.verdict:8s} {o.seconds:6.1f} s  {o.mutation.case}  {o.mutation.name}",
                    flush=True,
                )
                if o.verdict != "killed" or o.detail.startswith("(time"):
                    if o.detail:
                        print("    " + o.detail.replace("\n", "\n    "), flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(parent, ignore_errors=True)
    order = {mu.name: i for i, mu in enumerate(chosen)}
    outcomes.sort(key=lambda o: order[o.mutation.name])
    print("\ncase  verdict   seconds  mutation")
    for o in outcomes:
        print(f"{o.mutation.case:5s} {o.verdict:8s} {o.seconds:8.1f}  {o.mutation.name}")
    bad = [o for o in outcomes if o.verdict != "killed"]
    killed = len(outcomes) - len(bad)
    print(
        f"\n{killed}/{len(outcomes)} mutations killed in {time.monotonic() - t_start:.0f} s"
        + (
            f"; not killed: {', '.join(f'{o.mutation.case} {o.mutation.name}' for o in bad)}"
            if bad
            else ""
        )
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
