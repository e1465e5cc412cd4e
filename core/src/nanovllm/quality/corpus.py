"""A long natural English text found on this machine (never downloaded) for attention-quality runs.

Candidates, in a fixed order; the first with enough tokens wins:

1. The GNU GPL version 3, from the first file that holds it: ``/usr/share/common-licenses/GPL-3``
   (Debian, Ubuntu), then the license files of installed distributions (torch and numpy wheels bundle
   it), in name order. The text is cut from its title to its last line and each line stripped, and it
   counts only if its SHA-256 is the published text's, so it is the same text whichever file held it.
   About 7,600 tokens of SmolLM2's tokenizer.
2. Python's documentation topics (``pydoc_data.topics``, part of CPython; over 100,000 tokens), topics
   in name order. Its content follows the Python version.
3. The longest license or notice file of the installed distributions, the Python installation and
   ``/usr/share/common-licenses``.

A caller may name its own file instead (``text_file``): then that file alone is read, whole.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

COMMON_LICENSES = Path("/usr/share/common-licenses")
LICENSE_PREFIXES = ("LICENSE", "LICENCE", "COPYING", "NOTICE")
GPL3_TITLE = "GNU GENERAL PUBLIC LICENSE"
GPL3_VERSION = "Version 3, 29 June 2007"
GPL3_LAST_LINE = "<https://www.gnu.org/licenses/why-not-lgpl.html>."
GPL3_SHA256 = "e1d91671e42d31c47523853055896fbb5f1472ada24f2ce2154c83a9828f722c"
CHARS_PER_TOKEN_BOUND = 16  # an English token covers far fewer characters: tokenize only this prefix


@attrs.define(frozen=True)
class CorpusText:
    """A text and where it came from."""

    name: str
    source: str  # the file it was read from
    text: str = attrs.field(repr=False)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "source": self.source, "chars": len(self.text), "sha256": self.sha256}


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def gpl3_text(raw: str) -> str | None:
    """The GPL-3 inside ``raw``, title to last line with every line stripped, or None when ``raw`` does
    not hold the exact published text."""
    lines = [line.strip() for line in raw.splitlines()]
    starts = [i for i, line in enumerate(lines[:-1]) if line == GPL3_TITLE and lines[i + 1] == GPL3_VERSION]
    for start in starts:
        try:
            end = lines.index(GPL3_LAST_LINE, start)
        except ValueError:
            return None
        text = "\n".join(lines[start : end + 1]) + "\n"
        if hashlib.sha256(text.encode()).hexdigest() == GPL3_SHA256:
            return text
    return None


def distribution_license_files() -> list[Path]:
    """License and notice files of every installed distribution, ordered by distribution name and path."""
    found = []
    for dist in md.distributions():
        name = (dist.metadata["Name"] or "").lower()
        for file in dist.files or []:
            if file.name.upper().startswith(LICENSE_PREFIXES):
                found.append((name, str(file), Path(dist.locate_file(file))))
    return [path for _, _, path in sorted(set(found))]


def python_license_files() -> list[Path]:
    base = Path(sys.base_prefix)
    stdlib = base / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return [p for p in (stdlib / "LICENSE.txt", base / "LICENSE.txt") if p.is_file()]


def common_license_files() -> list[Path]:
    return sorted(p for p in COMMON_LICENSES.iterdir() if p.is_file()) if COMMON_LICENSES.is_dir() else []


def candidates(license_files: list[Path] | None = None) -> Iterator[CorpusText]:
    """The texts in order of preference (see the module docstring); ``license_files`` replaces the
    machine's list (GPL-3 search and longest-file fallback)."""
    if license_files is None:
        license_files = [COMMON_LICENSES / "GPL-3", *distribution_license_files()]
        license_files += python_license_files() + common_license_files()
    for path in license_files:
        raw = _read(path)
        text = gpl3_text(raw) if raw else None
        if text is not None:
            yield CorpusText("GNU General Public License v3 (canonical text)", str(path), text)
            break
    topics = _pydoc_topics()
    if topics is not None:
        yield topics
    sized = [(p.stat().st_size, str(p), p) for p in set(license_files) if p.is_file()]
    if sized:
        _, _, longest = max(sized)
        raw = _read(longest)
        if raw:
            yield CorpusText("longest license or notice file", str(longest), raw)


def _pydoc_topics() -> CorpusText | None:
    try:
        import pydoc_data.topics as module
    except ImportError:
        return None
    topics = module.topics
    text = "\n\n".join(topics[key] for key in sorted(topics))
    return CorpusText(f"Python {sys.version_info.major}.{sys.version_info.minor} documentation topics",
                      str(module.__file__), text)


def file_text(path: Path | str) -> CorpusText:
    """A text file named by the user, read whole as UTF-8."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"text file {str(path)!r} does not exist; name a UTF-8 text file, or leave "
                                "it out to use the text this machine has")
    return CorpusText(f"the file {path.name}", str(path), path.read_text(encoding="utf-8", errors="replace"))


def corpus_tokens(tokenizer: Any, num_tokens: int, license_files: list[Path] | None = None,
                  text_file: Path | str | None = None) -> tuple[list[int], CorpusText]:
    """The first ``num_tokens`` tokens (``tokenizer.encode``) of the first candidate long enough, or of
    ``text_file`` alone when it is given."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    tried = []
    for text in [file_text(text_file)] if text_file is not None else candidates(license_files):
        ids = tokenizer.encode(text.text[: CHARS_PER_TOKEN_BOUND * num_tokens])
        if len(ids) >= num_tokens:
            return ids[:num_tokens], text
        tried.append(f"{text.name} at {text.source} ({len(ids)} tokens)")
    raise FileNotFoundError(
        f"no text of {num_tokens} tokens on this machine; tried: {'; '.join(tried) or 'nothing found'}. "
        "Ask for fewer tokens, or run where /usr/share/common-licenses/GPL-3 or Python's pydoc_data exists"
    )


def joined_corpus_tokens(tokenizer: Any, num_tokens: int,
                         license_files: list[Path] | None = None) -> tuple[list[int], list[CorpusText]]:
    """The first ``num_tokens`` tokens of the candidate texts joined in order (blank lines between them,
    each text once), for prompts longer than any one text; and the texts used."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be positive, got {num_tokens}")
    used: list[CorpusText] = []
    ids: list[int] = []
    for text in candidates(license_files):
        if any(t.sha256 == text.sha256 for t in used):
            continue
        used.append(text)
        ids = tokenizer.encode("\n\n".join(t.text for t in used))
        if len(ids) >= num_tokens:
            return ids[:num_tokens], used
    raise FileNotFoundError(
        f"the texts on this machine hold {len(ids)} tokens together, fewer than {num_tokens}: "
        f"{'; '.join(f'{t.name} at {t.source}' for t in used) or 'nothing found'}. Ask for fewer tokens"
    )
