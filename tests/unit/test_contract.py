"""The durability and lifecycle contract is written once, in ``docs/durability.md`` (``D1``, ...) and
``docs/lifecycle.md`` (``L1``, ...), and cited by code as ``(contract D7)``.

A clause starts a paragraph with its id in bold (``**D7. Title.**``) and ends with a ``Test:`` line naming
``tests/path.py::test_name`` references (or ``none yet``). These tests fail when a clause id is defined
twice, when a clause has no ``Test:`` line, when a ``Test:`` reference names a test the file does not
define, when the package's code (``otel_capture/``, and ``exporters/``, which installs inside it) cites a
clause the docs do not define, or names one outside the citation form. Clauses no code cites, and clauses
with no test yet, are printed (run with ``-s``): information, not a failure.
"""

from __future__ import annotations

import ast
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = (REPO / "docs" / "durability.md", REPO / "docs" / "lifecycle.md")
CODE = (REPO / "otel_capture", REPO / "exporters")  # exporters/ installs as otel_capture.exporters

CLAUSE = re.compile(r"^\*\*([DL]\d+)\. ")
"""A clause's first line: its id in bold at the start of a paragraph."""
TEST_LINE = re.compile(r"^Test: (.+)$")
TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")
CITATION = re.compile(r"\(contract ([A-Z]+\d+(?:, [A-Z]+\d+)*)\)")
"""The one citation form code uses: ``(contract D7)``, or ``(contract D3, L6)`` for several."""


@dataclass
class Clause:
    id: str
    doc: str
    tests: list[tuple[str, str]]
    test_line: str | None


def _clauses(doc: Path) -> list[Clause]:
    clauses: list[Clause] = []
    current: Clause | None = None
    for line in doc.read_text(encoding="utf-8").splitlines():
        start = CLAUSE.match(line)
        if start:
            current = Clause(start.group(1), doc.name, [], None)
            clauses.append(current)
            continue
        if current is None:
            continue
        if not line.strip():
            current = None  # a clause is one paragraph: its Test: line ends it
            continue
        test = TEST_LINE.match(line)
        if test:
            current.test_line = test.group(1)
            current.tests = TEST_REF.findall(test.group(1))
    return clauses


def _all_clauses() -> list[Clause]:
    return [clause for doc in DOCS for clause in _clauses(doc)]


def _defined_tests(path: Path) -> set[str]:
    """The names a pytest node id can take in a test module: its top-level functions, classes and the
    names it assigns (``TestMachine = Machine.TestCase``)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
    return names


def _citations() -> dict[str, list[str]]:
    """Each clause id cited in the package's code, with where."""
    cited: dict[str, list[str]] = {}
    for path in sorted(p for folder in CODE if folder.is_dir() for p in folder.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in CITATION.finditer(line):
                for clause_id in match.group(1).split(", "):
                    cited.setdefault(clause_id, []).append(f"{path.relative_to(REPO)}:{number}")
    return cited


def test_the_docs_define_clauses_of_both_families_and_the_citation_form() -> None:
    ids = {clause.id for clause in _all_clauses()}
    assert any(i.startswith("D") for i in ids) and any(i.startswith("L") for i in ids)
    # the form durability.md tells code to use is the one this checker matches
    assert CITATION.fullmatch("(contract D7)") and "`(contract D7)`" in DOCS[0].read_text(encoding="utf-8")


def test_no_clause_id_is_defined_twice() -> None:
    counts = Counter(clause.id for clause in _all_clauses())
    assert [i for i, n in counts.items() if n > 1] == []


def test_every_clause_names_its_tests_or_says_none_yet() -> None:
    missing = [c.id for c in _all_clauses() if c.test_line is None]
    assert missing == [], "clauses without a Test: line"
    unnamed = [c.id for c in _all_clauses() if not c.tests and c.test_line != "none yet"]
    assert unnamed == [], "a Test: line names tests as `tests/path.py::test_name`, or says none yet"
    untested = [c.id for c in _all_clauses() if c.test_line == "none yet"]
    print("clauses with no test yet:", ", ".join(untested) or "none")


def test_every_test_a_clause_names_exists() -> None:
    defined: dict[str, set[str]] = {}
    missing: list[str] = []
    for clause in _all_clauses():
        for path, name in clause.tests:
            if path not in defined:
                file = REPO / path
                defined[path] = _defined_tests(file) if file.is_file() else set()
            if name not in defined[path]:
                missing.append(f"{clause.id}: {path}::{name}")
    assert missing == []


def test_code_cites_clauses_only_in_the_documented_form() -> None:
    """``contract D7`` anywhere but in ``(contract D7)`` is a citation this checker would not see."""
    loose = re.compile(r"\bcontract [A-Z]+\d+")
    stray = [
        f"{path.relative_to(REPO)}:{number}"
        for folder in CODE
        if folder.is_dir()
        for path in sorted(folder.rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if loose.search(CITATION.sub("", line))
    ]
    assert stray == []


def test_code_cites_only_clauses_the_docs_define() -> None:
    ids = {clause.id for clause in _all_clauses()}
    cited = _citations()
    undefined = {i: where for i, where in cited.items() if i not in ids}
    assert undefined == {}
    uncited = sorted((i for i in ids if i not in cited), key=lambda i: (i[0], int(i[1:])))
    print("clauses cited nowhere in code:", ", ".join(uncited) or "none")


def test_the_checker_catches_what_it_is_for(tmp_path: Path) -> None:
    """The parser sees a duplicate, a missing Test: line and a citation, so the checks above can fail."""
    doc = tmp_path / "doc.md"
    doc.write_text(
        "**D1. One.** Text.\nTest: `tests/unit/test_contract.py::test_no_clause_id_is_defined_twice`\n\n"
        "**D1. Again.** Text.\nTest: none yet\n\n**L2. No test line.** Text.\n"
    )
    clauses = _clauses(doc)
    assert [c.id for c in clauses] == ["D1", "D1", "L2"]
    assert clauses[0].tests == [("tests/unit/test_contract.py", "test_no_clause_id_is_defined_twice")]
    assert clauses[1].test_line == "none yet" and clauses[2].test_line is None
    assert CITATION.findall("x = 1  # the sync (contract D3, L6)") == ["D3, L6"]
    assert CITATION.findall("# D3: not a citation") == []
    assert CITATION.sub("", "(contract D3) and (contract L6, D2)") == " and "
