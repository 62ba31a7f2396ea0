#!/usr/bin/env python3
"""Checks that every citation of a document section resolves.

A citation is a document name followed by a quoted section title, as the code
and the docs write them:  design.md "KV cache",  docs/tp.md, "A step",
(docs/perf.md "Roofline").  Comment markers (//, #) and line breaks inside a
citation are allowed: a title may run onto the next comment line. A title
resolves when docs/<name> has a Markdown heading (any level) with that text,
ignoring `code` marks; a heading may add a parenthetical or a ": subtitle"
to the cited title ("Roofline" names "Roofline: one model for every
benchmark"), except in docs/design.md, whose citations must match a heading
exactly. In src/, tests/,
bench/ and tools/ a bare "design.md" without a title is reported too (it names
no section); README.md and docs/ may point at the whole document.

Usage: tools/check_doc_citations.py [repo root]   (default: the parent of tools/)
Exit status 0 when every citation resolves, 1 otherwise (each failure printed
as path:line: document "title").
"""
import pathlib
import re
import sys

ROOT = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent)
SCAN = ["src", "tests", "bench", "tools", "docs", "README.md"]
SUFFIXES = {".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh", ".py", ".sh", ".md", ".txt", ".cmake", ".inc"}

# name.md, an optional comma, then a quoted title that may span comment lines.
CITATION = re.compile(r'\b((?:docs/)?[\w-]+\.md)\b,?\s*(?:(?://|#)\s*)?"([^"\n]*(?:\n\s*(?://|#)?\s*[^"\n]*)?)"')
BARE_DESIGN = re.compile(r"\bdesign\.md\b(?!,?\s*(?:(?://|#)\s*)?\")")


def headings(doc, exact):
    out = set()
    for line in doc.read_text(encoding="utf-8").splitlines():
        m = re.match(r"#+\s+(.*?)\s*$", line)
        if m:
            title = m.group(1).replace("`", "")
            out.add(title)
            if exact:
                continue
            bare = re.sub(r"\s*\([^()]*\)", "", title)
            out.update({bare, title.split(": ", 1)[0], bare.split(": ", 1)[0]})
    return out


def files():
    for entry in SCAN:
        p = ROOT / entry
        if p.is_file():
            yield p
        elif p.is_dir():
            for f in sorted(p.rglob("*")):
                if f.is_file() and f.suffix in SUFFIXES:
                    yield f


def main():
    docs = {d.name: headings(d, d.name == "design.md") for d in (ROOT / "docs").glob("*.md")}
    bad = checked = 0
    for f in files():
        if f.resolve() == pathlib.Path(__file__).resolve():
            continue
        text = f.read_text(encoding="utf-8", errors="replace")
        rel = f.relative_to(ROOT)
        for m in CITATION.finditer(text):
            name = pathlib.PurePath(m.group(1)).name
            if name == "README.md":
                continue
            title = re.sub(r"\s*\n\s*(?://|#)?\s*", " ", m.group(2)).strip()
            line = text.count("\n", 0, m.start()) + 1
            checked += 1
            if name not in docs or title.replace("`", "") not in docs[name]:
                bad += 1
                print(f"{rel}:{line}: {m.group(1)} \"{title}\" does not resolve")
        if rel.parts[0] not in ("src", "tests", "bench", "tools"):
            continue
        for m in BARE_DESIGN.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            bad += 1
            print(f"{rel}:{line}: design.md cited without a section title")
    print(f"{checked} section citations checked, {bad} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
