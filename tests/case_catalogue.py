"""Reads docs/cases.md, the catalogue of failure cases, into one ``Case`` per entry.

Used by ``tests/mutations/run.py --list`` (each mutation under its case's title) and by
``tests/unit/test_cases_catalogue.py`` (which keeps the catalogue true). The format is described at the
top of docs/cases.md: a ``## CNN — title`` heading per case, then ``**Test:**`` and
``**Mutation:**`` each followed by a list of backquoted names (or ``none yet``), and an optional
``Status: open (issue N)`` line. A list item followed by ``(lands with issue N)`` names a test or
mutation that is still on an unmerged branch.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CATALOGUE = os.path.join(REPO, "docs", "cases.md")

_HEADING = re.compile(r"^## (C\d\d) — (\S.*)$")
_SECTION = re.compile(r"^\*\*(Fault|Must|Test|Mutation):\*\*\s*(.*)$")
_ITEM = re.compile(r"^- `([^`]+)`(.*)$")
_STATUS = re.compile(r"^Status: (.+)$")
_PENDING = re.compile(r"^\s*\(lands with issue \d+\)\s*$")


@dataclass
class Named:
    """A test node id (``tests/file.py::test_name``) or a mutation name, as an entry lists it."""

    name: str
    pending: bool  # marked "(lands with issue N)": on an unmerged branch, may not exist yet
    line: int  # 1-based line in docs/cases.md
    trailer: str  # whatever follows the backquoted name on its line


@dataclass
class Case:
    case: str  # "C07"
    title: str  # the short name after the dash
    line: int  # 1-based line of the heading
    status: str = ""  # "open (issue 25)", or "" when fixed
    # Fault, Must, Test, Mutation: the text on the heading's own line
    sections: dict[str, str] = field(default_factory=dict)
    tests: list[Named] = field(default_factory=list)
    mutations: list[Named] = field(default_factory=list)

    @property
    def heading(self) -> str:
        return f"{self.case} — {self.title}"

    @property
    def is_open(self) -> bool:
        return self.status.startswith("open")


def parse(text: str) -> list[Case]:
    """Every ``## CNN — title`` entry of ``text`` in file order (fenced code blocks are skipped)."""
    cases: list[Case] = []
    current: Case | None = None
    section = ""
    fenced = False
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.rstrip()
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        m = _HEADING.match(line)
        if m:
            current = Case(m.group(1), m.group(2).strip(), n)
            cases.append(current)
            section = ""
            continue
        if line.startswith("#"):
            current, section = None, ""
            continue
        if current is None:
            continue
        m = _STATUS.match(line)
        if m:
            current.status = m.group(1).strip()
            continue
        m = _SECTION.match(line)
        if m:
            section = m.group(1)
            current.sections[section] = m.group(2).strip()
            continue
        m = _ITEM.match(line)
        if m and section in ("Test", "Mutation"):
            item = Named(m.group(1), bool(_PENDING.match(m.group(2))), n, m.group(2).strip())
            (current.tests if section == "Test" else current.mutations).append(item)
    return cases


def load(path: str = CATALOGUE) -> list[Case]:
    with open(path, encoding="utf-8") as f:
        return parse(f.read())


def titles(path: str = CATALOGUE) -> dict[str, str]:
    """Case id -> its heading (``"C07 — A failed tier load livelocks its request"``); empty when
    the catalogue is missing (a partial checkout)."""
    try:
        return {c.case: c.heading for c in load(path)}
    except FileNotFoundError:
        return {}
