"""The README and the docstrings cite only files that exist in the repository."""

from __future__ import annotations

import ast
import importlib
import io
import re
import shlex
import subprocess
import sys
import tokenize
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
    docs = ROOT / "docs"
    return [p for p in tracked() if p.suffix == ".py" or p.name == "README.md" or docs in p.parents]


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
                bases = (ROOT, source.parent, ROOT / "core", ROOT / "core" / "src" / "nanovllm", ROOT / "docs",
                         ROOT / "examples" / "nanovllm-window")
                found = any((base / cited).exists() for base in bases)
            elif cited.endswith(".md") and "tests" not in source.parts:
                found = cited in names  # a document named alone; tests name the scratch files they write
            elif cited.endswith(".py") and source.name == "architecture.md":
                found = cited in names  # a module the documentation names alone (architecture.md)
            else:
                continue
            if not found:
                missing.append(f"{source.relative_to(ROOT)} cites {cited}")
    assert not missing, "\n".join(missing)


# -- the user documentation: links, commands, generated tables -------------------------------------------------

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")  # [text](target), not images


def user_docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+\s+(.*)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_relative_links_resolve():
    broken = []
    for page in user_docs():
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):  # a URL
                continue
            path, _, anchor = target.partition("#")
            linked = page.parent / path if path else page
            if not linked.exists() or (anchor and linked.suffix == ".md" and anchor not in anchors(linked)):
                broken.append(f"{page.relative_to(ROOT)} links to {target}")
    assert not broken, "\n".join(broken)


def test_generated_option_tables_are_current():
    script = ROOT / "scripts" / "gen_config_docs.py"
    out = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def readme_blocks() -> tuple[list[str], list[str]]:
    """The README's shell commands (indented or fenced lines starting with a program) and Python blocks."""
    text = (ROOT / "README.md").read_text()
    python = re.findall(r"```python\n(.*?)```", text, re.S)
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    commands = [line.strip() for line in text.splitlines() if line.startswith("    ") and line.strip()]
    return commands, python


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250, "the README is a summary: move details to docs/"


def test_readme_commands_use_existing_options():
    from nanovllm.cli import build_parser

    commands, _ = readme_blocks()
    assert commands, "the README shows no commands"
    parser = build_parser()
    make_targets = re.findall(r"^(\w+):", (ROOT / "Makefile").read_text(), re.M)
    for line in commands:
        words = shlex.split(line.split("  #")[0], comments=True)
        if words[0] == "nanovllm":
            try:
                parser.parse_args(words[1:])
            except SystemExit as exc:
                pytest.fail(f"README: {line!r} is not a valid command line ({exc})")
        elif words[0] == "make":
            assert words[1] in make_targets, line
        elif words[0] == "pip":
            for path in (w.split("[")[0].strip('"') for w in words if w.startswith(("./", '"./'))):
                assert (ROOT / path / "pyproject.toml").is_file(), f"README installs {path}, which is no distribution"
        else:
            pytest.fail(f"README: a command the test does not know how to check: {line!r}")


def test_readme_cheap_commands_run():
    for argv in (["plugins"], ["--version"]):
        out = subprocess.run([sys.executable, "-m", "nanovllm.cli", *argv], capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0, out.stderr
    listed = subprocess.run([sys.executable, "-m", "nanovllm.cli", "plugins"], capture_output=True, text=True).stdout
    readme = (ROOT / "README.md").read_text()
    for name in ("quest", "minference", "xattn", "LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma3ForCausalLM"):
        assert name in listed and f"`{name}" in readme, name


def test_readme_python_uses_existing_options():
    import attrs
    from nanovllm.config import EngineConfig
    from nanovllm.sampling_params import SamplingParams

    accepted = {"LLM": {f.name for f in attrs.fields(EngineConfig)},
                "SamplingParams": {f.name for f in attrs.fields(SamplingParams)}}
    _, blocks = readme_blocks()
    assert blocks
    for block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                assert all(hasattr(module, a.name) for a in node.names), ast.unparse(node)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in accepted:
                unknown = {k.arg for k in node.keywords} - accepted[node.func.id]
                assert not unknown, f"README: {node.func.id} has no option {unknown}"


# -- docs/writing-plugins.md: one runnable example per hook, run in CI -------------------------------------

PLUGIN_GUIDE = ROOT / "docs" / "writing-plugins.md"


def guide_examples() -> list[str]:
    """The guide's runnable examples: its Python blocks whose first line is ``# example: ...``."""
    blocks = re.findall(r"```python\n(.*?)```", PLUGIN_GUIDE.read_text(), re.S)
    return [b for b in blocks if b.startswith("# example:")]


def test_every_hook_has_an_example():
    from nanovllm.hookspecs import RegistrationSpec
    from nanovllm.sparse import POLICY_METHODS, ObserverSpec

    hooks = [n for spec in (RegistrationSpec, ObserverSpec) for n in vars(spec) if not n.startswith("_")]
    defined = {node.name for block in guide_examples() for node in ast.walk(ast.parse(block))
               if isinstance(node, ast.FunctionDef)}
    missing = [h for h in [*hooks, *POLICY_METHODS] if h not in defined]
    assert not missing, f"docs/writing-plugins.md has no runnable example of {missing}"


@pytest.mark.slow
def test_plugin_guide_examples_run(monkeypatch, tmp_path):
    import types

    from nanovllm.plugins import reload_plugins

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # the examples' model directories
    module = types.ModuleType("writing_plugins_examples")  # registered targets name it: "module:Class"
    monkeypatch.setitem(sys.modules, module.__name__, module)
    try:
        for index, block in enumerate(guide_examples()):
            exec(compile(block, f"docs/writing-plugins.md example {index}", "exec"), module.__dict__)
    finally:
        reload_plugins()


def doc_commands() -> list[tuple[Path, str]]:
    """Commands quoted in backticks in the docs and the results README (wrapped lines joined)."""
    pages = [*user_docs(), ROOT / "benchmarks" / "results" / "README.md"]
    found = []
    for page in pages:
        for quoted in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", page.read_text(), flags=re.S)):
            command = " ".join(quoted.split())
            if re.match(r"(nanovllm (generate|chat|serve|plugins|bench)|python benchmarks/)\b", command) and (
                    "..." not in command and "NAME.py" not in command):  # prose, not a command
                found.append((page, command))
    return found


def test_documented_commands_use_existing_options():
    from nanovllm.cli import build_parser

    parser = build_parser()
    for page, command in doc_commands():
        words = shlex.split(command)
        where = f"{page.relative_to(ROOT)}: {command!r}"
        if words[0] == "nanovllm" and len(words) == 2:  # a command named in prose: it must exist
            assert words[1] in ("generate", "chat", "serve", "plugins", "bench"), where
        elif words[0] == "nanovllm":  # placeholders (URL, FILE) parse as the values they stand for
            try:
                parser.parse_args(words[1:])
            except SystemExit as exc:
                assert exc.code == 0 and "--help" in words, f"{where} is not a valid command line"
        else:  # python benchmarks/NAME.py --flag ...: the script exists and defines each flag
            script = ROOT / words[1]
            assert script.is_file(), f"{where}: no such script"
            source = script.read_text() + "".join(
                (ROOT / "core" / "src" / "nanovllm" / "quality" / name).read_text() for name in ("prefill.py",))
            for flag in (w.split("=")[0] for w in words[2:] if w.startswith("--")):
                assert f'"{flag}"' in source, f"{where}: {script.name} has no option {flag}"


# -- docs/architecture.md: its floors are the imports' ----------------------------------------------------

PACKAGE = ROOT / "core" / "src" / "nanovllm"


def architecture_floors() -> dict[str, int]:
    """Top-level module or package of nanovllm -> its floor in the architecture picture (the numbered lines
    and the lines under them, up to the next number or a ruled line)."""
    picture = re.search(r"## The shape.*?```\n(.*?)```", (ROOT / "docs" / "architecture.md").read_text(), re.S)
    floors, floor = {}, None
    for line in picture.group(1).splitlines():
        numbered = re.match(r"\s?(\d)\s\s", line)
        if numbered:
            floor = int(numbered.group(1))
        elif line.strip().startswith("---") or not line.strip():
            floor = None
        if floor is None:
            continue
        for name in re.findall(r"(?<![\w/.])([a-z_]+)(?:\.py\b|/(?![\w.]))", line):  # engine/, llm.py; not paths
            if (PACKAGE / f"{name}.py").is_file() or (PACKAGE / name).is_dir():
                floors.setdefault(name, floor)
    return floors


def runtime_imports(path: Path) -> set[str]:
    """The nanovllm top-level names a module imports when it runs (TYPE_CHECKING blocks left out)."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in
                   ast.unparse(node.test) for n in ast.walk(node)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        modules = ([node.module] if isinstance(node, ast.ImportFrom) and node.module else
                   [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        names |= {m.split(".")[1] for m in modules if m.startswith("nanovllm.")}
    return names


def test_architecture_floors_match_the_imports():
    floors = architecture_floors()
    upward = []
    for path in PACKAGE.rglob("*.py"):
        top = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if top in ("__init__", "__main__"):
            continue
        assert top in floors, f"docs/architecture.md does not place {top} on a floor"
        for name in runtime_imports(path):
            if floors.get(name, 0) > floors[top]:
                upward.append(f"{path.relative_to(PACKAGE)} (floor {floors[top]}) imports {name} (floor {floors[name]})")
    assert not upward, "\n".join(upward)


# -- the installed code's comments and docstrings state behaviour, not one machine's timings -------------

# a time ("7.3 us"), a speed-up in percent, or a GPU model introducing figures ("H100: ...", "(H100, ...")
TIMING = re.compile(r"\d(?:\.\d+)?\s?(?:ns|us|µs|ms)\b|\d%\s+(?:faster|slower)|\b[ABH]\d00\b\s*[(:,]")


def prose(path: Path):
    """(line, text) of every comment and docstring of ``path``."""
    text = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield node.body[0].lineno, doc


def test_installed_code_quotes_no_timings():
    installed = [p for p in tracked() if p.suffix == ".py" and "src" in p.relative_to(ROOT).parts]
    assert any("nanovllm_quest" in p.parts for p in installed)  # the scan sees the plugins
    found = [f"{path.relative_to(ROOT)}:{line}: {match.group(0)!r}" for path in installed
             for line, text in prose(path) for match in TIMING.finditer(text)]
    assert not found, ("say why, not what one machine measured (the numbers belong in benchmarks/results):\n"
                       + "\n".join(found))
