"""The README and the docstrings cite only files that exist in the repository."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A path-like word ending in a file type we cite: "benchmarks/ANCHORS.md", "core/tests/quest_style.py";
# documents are also checked when named alone ("ANCHORS.md").
CITED = re.compile(r"(?<![\w./{<-])((?:[\w.-]+/)*[\w-]+\.(?:md|py|sh|json|toml))\b")
TEMPLATES = ("NAME", "<", "{", "*")  # placeholders in examples, not files


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    return [ROOT / line for line in out.stdout.splitlines()]


def sources() -> list[Path]:
    return [p for p in tracked() if p.suffix == ".py" or p.name == "README.md"]


def test_cited_files_exist():
    files = tracked()
    names = {p.name for p in files}
    missing = []
    for source in sources():
        if not source.is_file() or "results" in source.parts:
            continue
        for cited in CITED.findall(source.read_text(errors="replace")):
            if any(t in cited for t in TEMPLATES) or cited.startswith(("http", "www.")):
                continue
            if "/" in cited:  # a path: from the root, the citing file, or the example plugin (its layout)
                bases = (ROOT, source.parent, ROOT / "core", ROOT / "examples" / "nanovllm-window")
                found = any((base / cited).exists() for base in bases)
            elif cited.endswith(".md") and "tests" not in source.parts:
                found = cited in names  # a document named alone; tests name the scratch files they write
            else:
                continue
            if not found:
                missing.append(f"{source.relative_to(ROOT)} cites {cited}")
    assert not missing, "\n".join(missing)
