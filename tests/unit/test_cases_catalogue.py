"""docs/cases.md stays true to the code: the catalogue every ``CNN`` in a comment, a test name or a
mutation refers to. Reads files only (ast for the tests, the mutation list as data); starts nothing.

What it holds (docs/cases.md, "Adding a case"):

- the entries are C01, C02, ... in order, none missing or repeated, each with its fault, what must
  happen, its tests and its mutations (``none yet`` allowed for tests only while ``Status: open``);
- every case cited in the code and the docs has an entry;
- every test an entry names exists (file and function), every mutation it names is in
  ``tests/mutations/mutations.py`` under that case; a name marked ``(lands with issue N)`` may be
  missing, and must be unmarked once it exists;
- every mutation is listed in its case's entry, which names at least one of the tests the mutation
  must fail, and those tests exist;
- every ``test_cNN_*`` (or ``*_cNN_*``) test is named in case NN's entry.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re

import case_catalogue
import pytest

REPO = case_catalogue.REPO
CITED_IN = ("tests", "kvoffload", "ipc", "workers", "tools", "docs")
TEXT_SUFFIXES = (".py", ".md", ".ini", ".cfg", ".toml", ".txt", ".yaml", ".yml", ".sh", ".json")
CASE_REF = re.compile(r"\bC\d\d\b")
CASE_IN_TEST_NAME = re.compile(r"(?:^|_)c(\d\d)_")


@functools.cache
def catalogue() -> list[case_catalogue.Case]:
    return case_catalogue.load()


@functools.cache
def entries() -> dict[str, case_catalogue.Case]:
    return {c.case: c for c in catalogue()}


@functools.cache
def mutations() -> list:
    path = os.path.join(REPO, "tests", "mutations", "mutations.py")
    spec = importlib.util.spec_from_file_location("_catalogue_mutations", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.MUTATIONS)


@functools.cache
def functions_in(rel: str) -> frozenset[str]:
    """``name`` and ``Class::name`` of every test function in the repository file ``rel``."""
    path = os.path.join(REPO, rel)
    if not os.path.isfile(path):
        return frozenset()
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), rel)
    found = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found.add(node.name)
        elif isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.add(f"{node.name}::{sub.name}")
    return frozenset(found)


def node_exists(node_id: str) -> bool:
    """Whether a pytest node id (``tests/f.py::test_x``, a ``[param]`` suffix ignored) names a
    function that is there."""
    rel, _, func = node_id.partition("::")
    return bool(func) and func.split("[")[0] in functions_in(rel)


def repo_text_files() -> list[str]:
    out = []
    for top in CITED_IN:
        for dirpath, dirnames, filenames in os.walk(os.path.join(REPO, top)):
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
            out += [os.path.join(dirpath, f) for f in filenames if f.endswith(TEXT_SUFFIXES)]
    out += [os.path.join(REPO, f) for f in os.listdir(REPO) if f.endswith(".md")]
    return sorted(out)


def all_test_functions() -> list[tuple[str, str]]:
    """(repository path, name) of every test function under tests/."""
    found = []
    for dirpath, dirnames, filenames in os.walk(os.path.join(REPO, "tests")):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for f in filenames:
            if f.startswith("test_") and f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), REPO).replace(os.sep, "/")
                found += [(rel, name) for name in functions_in(rel)]
    return sorted(found)


def test_entries_are_numbered_in_order_and_complete():
    numbers = [c.case for c in catalogue()]
    assert numbers, f"no '## CNN — title' entry in {case_catalogue.CATALOGUE}"
    assert numbers == [f"C{i:02d}" for i in range(1, len(numbers) + 1)], (
        "entries must run C01, C02, ... in order, with none missing or repeated"
    )
    problems = []
    for c in catalogue():
        for section in ("Fault", "Must", "Test", "Mutation"):
            if section not in c.sections:
                problems.append(f"{c.case} (line {c.line}): no **{section}:**")
        if not c.sections.get("Fault") or not c.sections.get("Must"):
            problems.append(f"{c.case}: the fault and what must happen are each written out")
        if c.tests and c.sections.get("Test"):
            problems.append(f"{c.case}: **Test:** is followed by text and a list; one of them")
        if not c.tests and not c.sections.get("Test", "").startswith("none yet"):
            problems.append(f"{c.case}: **Test:** lists no test and does not say 'none yet'")
        if not c.tests and not c.is_open:
            problems.append(f"{c.case}: no test, and not 'Status: open (issue N)'")
        if not c.mutations and not c.sections.get("Mutation", "").startswith("none yet"):
            problems.append(f"{c.case}: **Mutation:** lists none and does not say 'none yet'")
        for kind, items in (("test", c.tests), ("mutation", c.mutations)):
            names = [i.name for i in items]
            if len(set(names)) != len(names):
                problems.append(f"{c.case}: a {kind} is listed twice")
            for i in items:
                if i.trailer and not i.pending:
                    problems.append(
                        f"{c.case} line {i.line}: after the name only '(lands with issue N)' "
                        f"may follow, not {i.trailer!r}"
                    )
    assert not problems, "\n".join(problems)


def test_every_case_cited_in_the_code_has_an_entry():
    missing: dict[str, str] = {}
    for path in repo_text_files():
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError:
            continue
        for case in CASE_REF.findall(text):
            if case not in entries():
                missing.setdefault(case, os.path.relpath(path, REPO))
    assert not missing, "cases cited with no entry in docs/cases.md: " + ", ".join(
        f"{case} (in {where})" for case, where in sorted(missing.items())
    )


def test_every_test_an_entry_names_exists():
    problems = []
    for c in catalogue():
        for t in c.tests:
            if not re.fullmatch(r"tests/[\w/]+\.py::\w+(::\w+)?", t.name):
                problems.append(f"{c.case} line {t.line}: {t.name!r} is not tests/file.py::test")
            elif node_exists(t.name) and t.pending:
                problems.append(f"{c.case}: {t.name} exists now: remove its '(lands with ...)'")
            elif not node_exists(t.name) and not t.pending:
                problems.append(f"{c.case}: no test {t.name}")
    assert not problems, "\n".join(problems)


def test_every_mutation_an_entry_names_exists_under_that_case():
    by_name = {mu.name: mu for mu in mutations()}
    problems = []
    for c in catalogue():
        for m in c.mutations:
            mu = by_name.get(m.name)
            if mu is None and not m.pending:
                problems.append(f"{c.case}: no mutation {m.name!r} in tests/mutations/mutations.py")
            elif mu is not None and m.pending:
                problems.append(f"{c.case}: mutation {m.name!r} exists now: remove its mark")
            elif mu is not None and mu.case != c.case:
                problems.append(f"{c.case}: mutation {m.name!r} is {mu.case}'s")
    assert not problems, "\n".join(problems)


def test_every_mutation_is_in_its_cases_entry_with_one_of_its_tests():
    problems = []
    for mu in mutations():
        c = entries().get(mu.case)
        if c is None:
            problems.append(f"mutation {mu.name!r}: its case {mu.case} has no entry")
            continue
        if mu.name not in {m.name for m in c.mutations}:
            problems.append(f"mutation {mu.name!r} is not listed in {mu.case}'s entry")
        for t in mu.tests:
            if not node_exists(t):
                problems.append(f"mutation {mu.name!r}: no test {t}")
        listed = {t.name for t in c.tests}
        if not {t.split("[")[0] for t in mu.tests} & listed:
            problems.append(
                f"mutation {mu.name!r}: {mu.case}'s entry names none of the tests it must fail "
                f"({', '.join(mu.tests)})"
            )
    assert not problems, "\n".join(problems)


def test_every_case_test_is_named_in_its_entry():
    problems = []
    for rel, name in all_test_functions():
        for number in CASE_IN_TEST_NAME.findall(name.rsplit("::", 1)[-1]):
            c = entries().get(f"C{number}")
            if c is None:
                problems.append(f"{rel}::{name}: case C{number} has no entry")
            elif f"{rel}::{name}" not in {t.name for t in c.tests}:
                problems.append(f"{rel}::{name} is not listed in C{number}'s entry")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "text, expect",
    [
        ("## C01 — a\n\n**Test:**\n- `tests/t.py::test_c01_x`\n", ["tests/t.py::test_c01_x"]),
        ("```\n## C01 — in a fence\n```\n", None),
        ("## C01 — a\n**Test:**\n- `tests/t.py::test_y` (lands with issue 23)\n", ["pending"]),
    ],
)
def test_the_parser_reads_headings_lists_and_marks(text, expect):
    cases = case_catalogue.parse(text)
    if expect is None:
        assert cases == []
    elif expect == ["pending"]:
        assert [t.pending for t in cases[0].tests] == [True]
    else:
        assert [t.name for t in cases[0].tests] == expect and not cases[0].tests[0].pending


def test_every_test_the_readmes_security_model_names_exists():
    """README's Security model backs each guarantee with the test that attacks it: each test it
    names (``tests/f.py::test_x``, a bare ``test_x``, or a pattern ``test_c43_*``) is there."""
    import fnmatch

    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    section = readme.split("\n## Security model\n", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"`((?:tests/[\w/]+\.py::)?test_[\w*]+)`", section)
    assert len(names) >= 20, names
    everywhere = all_test_functions()
    for name in names:
        rel, _, func = name.rpartition("::")
        found = [t for r, t in everywhere if (not rel or r == rel) and fnmatch.fnmatch(t, func)]
        assert found, f"README's Security model names {name}, which is no test"


def test_every_mutation_applies_to_the_code_as_it_is():
    """Each mutation's text to replace occurs exactly once in its file and the patched file
    compiles (``tests/mutations/run.py``'s own check, which only the mutation stage ran): a
    refactor that moves the code a mutation names fails here, not minutes into CI."""
    import sys

    path = os.path.join(REPO, "tests", "mutations", "run.py")
    spec = importlib.util.spec_from_file_location("_catalogue_mutation_runner", path)
    assert spec is not None and spec.loader is not None
    runner = importlib.util.module_from_spec(spec)
    saved = list(sys.path)
    sys.modules[spec.name] = runner  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(runner)  # it puts tests/mutations on sys.path: put back after
    finally:
        sys.path[:] = saved
        del sys.modules[spec.name]
    problems = runner.check_patches(mutations(), REPO)
    assert not problems, "\n".join(problems)
