"""The failure and refusal reasons users see (metrics labels, ``kvoffload stress``'s summary) are
each explained, in one catalogue (``kvoffload/reasons.py``) that docs/observability.md repeats."""

from __future__ import annotations

import re
from pathlib import Path

from kvoffload.ipc.messages import CODE_NAMES
from kvoffload.reasons import FAILED, REFUSED
from kvoffload.tiering import HOST_REFUSALS, TIER_REFUSALS
from kvoffload.tools.stress import Report, reason_notes

DOC = Path(__file__).resolve().parents[2] / "docs" / "observability.md"


def _doc_tables() -> list[dict[str, tuple[str, str]]]:
    """The reason tables of docs/observability.md's "Failure and refusal reasons", in order."""
    text = DOC.read_text()
    section = text.split("### Failure and refusal reasons", 1)[1].split("\n## ", 1)[0]
    tables: list[dict[str, tuple[str, str]]] = []
    current: dict[str, tuple[str, str]] | None = None
    for line in section.splitlines():
        m = re.match(r"\| `([a-z_]+)` \| (.*) \| (.*) \|$", line)
        if m:
            if current is None:
                current = {}
                tables.append(current)
            current[m.group(1)] = (m.group(2), m.group(3))
        elif not line.startswith("|"):
            current = None
    return tables


def test_every_worker_result_code_and_refusal_reason_is_explained():
    assert {n for n in CODE_NAMES.values() if n != "ok"} <= set(FAILED)
    assert {r for _, r in HOST_REFUSALS + TIER_REFUSALS} <= set(REFUSED)


def test_the_docs_carry_the_catalogue_word_for_word():
    failed, refused = _doc_tables()
    assert failed == {k: tuple(v) for k, v in FAILED.items()}
    assert refused == {k: tuple(v) for k, v in REFUSED.items()}


def test_the_stress_summary_says_what_each_counted_reason_means():
    rep = Report(
        failures={"fs.store.rejected": 613, "obj.load.io_error": 2, "fs.load.strange": 1},
        refused={"obj.store.breaker_open": 40},
    )
    notes = reason_notes(rep)
    assert notes[0].startswith("failed 'io_error': a transient I/O failure")
    assert notes[1] == "failed 'rejected': " + FAILED["rejected"].meaning + ". Action: " + (
        FAILED["rejected"].action + "."
    )
    assert notes[2] == "failed 'strange': not in the catalogue (docs/observability.md)"
    assert notes[3].startswith("refused 'breaker_open': the tier's circuit breaker is open")
    assert len(notes) == 4
