"""Package sources cite public documentation, never files outside the repository (issue 11 part 4).

Docstrings and comments under nkilib/ must point to the public Neuron docs or to a recorded choice
in docs/simulator.md, and every `docs/simulator.md#<anchor>` they cite must exist.
"""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "simulator.md"
# the former out-of-repo research notes (nki-spec.md and its section numbers, design.md) and scratch
# notes nobody else has
FORBIDDEN = re.compile(r"/work/shared|nki-spec\.md|(?i:spec(?: sections?)? §)|/tmp/\S+\.md|(?<![\w/.-])design\.md")
_ANCHOR_REF = re.compile(r"docs/simulator\.md#([A-Za-z0-9_\-]+)")


def _sources(*dirs):
    for d in dirs:
        for p in sorted((ROOT / d).rglob("*")):
            if p.is_file() and p.suffix in (".py", ".md") and "__pycache__" not in p.parts:
                yield p.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("rel", list(_sources("nkilib")))
def test_no_out_of_repo_citations(rel):
    text = (ROOT / rel).read_text(encoding="utf-8")
    hits = [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in FORBIDDEN.finditer(text)]
    assert not hits, f"{rel} cites files outside the repository ({'; '.join(hits[:5])}); cite the public URL " \
                     "or docs/simulator.md#<anchor> instead (table 'Source map' in docs/simulator.md)"


def _doc_anchors() -> set:
    """Explicit `<a id>` anchors plus GitHub heading slugs of docs/simulator.md."""
    text = DOC.read_text(encoding="utf-8")
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', text))
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def test_cited_doc_anchors_exist():
    anchors = _doc_anchors()
    broken = []
    for rel in list(_sources("nkilib", "tests")) + ["README.md"]:
        for m in _ANCHOR_REF.finditer((ROOT / rel).read_text(encoding="utf-8")):
            if m.group(1) not in anchors:
                broken.append(f"{rel}: #{m.group(1)}")
    for target in re.findall(r"\]\(#([^)]+)\)", DOC.read_text(encoding="utf-8")):  # links inside the document
        if target not in anchors:
            broken.append(f"docs/simulator.md: #{target}")
    assert not broken, f"references to missing docs/simulator.md anchors: {broken}"


def _doc_section(title: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end]


def _bullet_names(section: str, prefix: str) -> set:
    """Backticked names of the bullet of `section` that starts with `prefix`."""
    bullet = next(b for b in section.split("\n- ") if b.startswith(prefix))
    return set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", bullet))


def test_not_simulated_lists_match_the_stubs():
    import nki.isa as nisa
    import nki.language as nl

    section = _doc_section("Not simulated")
    assert _bullet_names(section, "`nki.isa` (stubs)") == set(nisa._NOT_SIMULATED)
    assert _bullet_names(section, "`nki.language` (stubs)") - {"op", "nl"} >= set(nl._NOT_SIMULATED)
    for name in nisa._NOT_SIMULATED:  # a stub never shadows an implemented instruction
        assert not callable(nisa.__dict__.get(name)), f"nisa.{name} is implemented but listed as not simulated"


def test_every_exported_isa_function_is_documented():
    import enum

    import nki.isa as nisa

    exported = {n for n in dir(nisa) if not n.startswith("_") and callable(getattr(nisa, n))
                and not isinstance(getattr(nisa, n), (type, enum.Enum))}
    section = _doc_section("Instructions (`nki.isa`)")
    paragraph = section.split("Every exported `nki.isa` function:")[1].split("\n\n")[0]
    listed = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", paragraph))
    assert listed >= exported, f"docs/simulator.md does not list {sorted(exported - listed)}"
    headings = set(re.findall(r"^### .*$", section, flags=re.M))
    undocumented = sorted(n for n in exported if not any(f"`{n}`" in h or f"`nisa.{n}`" in h for h in headings))
    assert not undocumented, f"no '### ...' entry in docs/simulator.md for nisa.{undocumented}"
