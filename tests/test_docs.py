"""The docs tell the truth about the tree: links resolve, the gap reasons and the glossary's words
are documented, the README's module table is the packages' own docstrings.

Each check reads the real files of the repository; a stale doc fails here, not in a reader's hands.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "scripts" / "README.md"]

_LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^(```|~~~)")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    text = re.sub(r"`|\*\*|\*|_(?=\W)|(?<=\W)_", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file, duplicates numbered as GitHub does (-1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(path: Path):
    """(line number, target) of every relative markdown link outside code fences."""
    fenced = False
    for no, line in enumerate(path.read_text().splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        for m in _LINK.finditer(line):
            target = m.group(1)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):
                yield no, target


def test_slug_rules():
    """The slug function agrees with GitHub's on the shapes these docs use."""
    assert _slug("The fleet: one bucket for every host") == "the-fleet-one-bucket-for-every-host"
    assert _slug("Keeping every binary a session names") == "keeping-every-binary-a-session-names"
    assert _slug("`ring_bytes` and the 2 MiB rings") == "ring_bytes-and-the-2-mib-rings"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    """Every relative link names a file that exists, and its #anchor a heading of that file."""
    bad = []
    for no, target in _links(doc):
        file_part, _, anchor = target.partition("#")
        dest = doc if not file_part else (doc.parent / file_part).resolve()
        if not dest.exists():
            bad.append(f"{doc.name}:{no}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            bad.append(f"{doc.name}:{no}: {target}: no heading #{anchor} in {dest.name}")
    assert not bad, "\n".join(bad)


_POINTER = re.compile(r"docs/([\w.-]+\.md)(?:#([\w-]+)|,? ['\"]([^'\"]+)['\"])?")


def test_pointers_from_code_name_what_the_doc_holds():
    """A comment or docstring naming docs/X.md names a doc that exists, and the section it quotes
    ('Ring size', #anchor) is in it."""
    bad = []
    sources = [*(ROOT / "daemon").rglob("*.py"), *(ROOT / "daemon").rglob("*.c"), *(ROOT / "bpf").glob("*.[ch]"),
               *(ROOT / "systemd").iterdir(), ROOT / "pyproject.toml", *(ROOT / "scripts").iterdir()]
    for src in sources:
        if not src.is_file():
            continue
        try:
            text = src.read_text()
        except UnicodeDecodeError:
            continue
        for m in _POINTER.finditer(text):
            doc = ROOT / "docs" / m.group(1)
            where = f"{src.relative_to(ROOT)}: {m.group(0)}"
            if not doc.exists():
                bad.append(f"{where}: no such doc")
            elif m.group(2) and m.group(2) not in _anchors(doc):
                bad.append(f"{where}: no heading #{m.group(2)}")
            elif m.group(3) and m.group(3) not in doc.read_text():
                bad.append(f"{where}: the doc does not say {m.group(3)!r}")
    assert not bad, "\n".join(bad)


def test_every_gap_reason_is_documented():
    """Each reason the coverage ledger writes (store.coverage.GAP_REASONS, which every writer of a
    gap uses) is listed where operators and parsers read them."""
    from buildidd.store.coverage import GAP_REASONS

    status_only = {"in_progress"}
    for doc in ("docs/operations.md", "docs/record-format.md"):
        text = (ROOT / doc).read_text()
        missing = [r for r in GAP_REASONS if r not in status_only and f"`{r}`" not in text]
        assert not missing, f"{doc} lacks the gap reasons {missing}"


def test_readme_module_table_is_the_docstrings():
    """README.md's module table is what scripts/gen-modules makes of the modules' docstrings now."""
    got = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen-modules"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr


def test_module_table_lists_every_module():
    """Every module file of daemon/buildidd (but __main__) has its row, so a new module shows up."""
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("<!-- modules:begin -->"):readme.index("<!-- modules:end -->")]
    pkg = ROOT / "daemon" / "buildidd"
    for p in pkg.rglob("*.py"):
        rel = p.relative_to(pkg)
        if p.name == "__main__.py":
            continue
        name = f"{rel.parent}/" if p.name == "__init__.py" and str(rel.parent) != "." else str(rel)
        assert f"`{name}`" in table, f"{name} has no row in README.md's module table"


#: Words the code uses as terms of its own, each with the spelling the code uses (a regex, case-insensitive)
#: and the glossary's bold entry that defines it.
GLOSSARY_TERMS = {
    "settled": r"\bsettled\b", "hand-over": r"\bhand-?over", "hand-over queue": r"hand-?over ?queue",
    "pin": r"\bpins?\b", "route": r"\broutes?\b", "held": r"\bheld\b", "bulk": r"\bbulk\b", "live": r"\bLIVE\b",
    "at-risk": r"\bat[-_ ]risk\b", "throttled": r"\bthrottled\b", "gap": r"\bgaps?\b", "origin": r"\borigin\b",
    "provenance": r"\bprovenance\b", "quality": r"\bquality\b", "sighting": r"\bsightings?\b",
    "identity": r"\bidentity\b", "resolution": r"\bresolution\b", "copy queue": r"copy ?queue",
    "throttle": r"\bthrottle\b", "payer": r"\bpayer\b", "charged uid": r"\bcharged\b", "uid budget": r"uid_budget",
    "coverage ledger": r"\bcoverage\b", "file key": r"file ?keys?", "unreached": r"\bunreached\b",
    "synthesized": r"\bsynthesi[sz]", "step": r"\bstep\b", "quiet wait": r"quiet[_ ]wait", "rescan": r"\brescan\b",
    "seal": r"\bseal", "write-behind": r"write-?behind", "fast path": r"fast ?path", "alt": r"\balt\b",
}


def test_glossary_defines_the_words_the_code_uses():
    """Each listed term is used by the code (so the list stays honest) and has a bold entry in docs/glossary.md."""
    code = "\n".join(p.read_text() for p in (ROOT / "daemon" / "buildidd").rglob("*.py"))
    glossary = (ROOT / "docs" / "glossary.md").read_text()
    unused = [t for t, rx in GLOSSARY_TERMS.items() if not re.search(rx, code, re.IGNORECASE)]
    assert not unused, f"terms the code no longer uses (drop them here and from the glossary?): {unused}"
    missing = [t for t in GLOSSARY_TERMS if f"**{t}**" not in glossary]
    assert not missing, f"docs/glossary.md has no entry for {missing}"
