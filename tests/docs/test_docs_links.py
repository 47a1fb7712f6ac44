"""README.md and docs/*.md name only what exists: relative links (and their #anchors), repository paths
in inline code and commands, `kvserve` subcommands and their --options (read from the CLI's parser),
`serve run serve_app:app key=value` keys (AppArgs' fields), `make` targets (the Makefile's rules) and
`python -m` modules. Commands are read from shell code blocks and from inline code."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import re
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_LANGS = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^ {0,3}(```+|~~~+)\s*([\w+-]*)[^\n]*$")
INLINE_CODE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PYTHON = re.compile(r"^python(3(\.\d+)?)?$")
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")", ";;"}
REDIRECTS = {">", ">>", "<", ">&", "&>", "2>", "<<"}


@dataclass(frozen=True)
class Facts:
    """What the pages may name: each set is derived from the code, not written out here."""

    subcommands: dict[str, frozenset[str]]  # kvserve subcommand -> its option strings
    app_args: frozenset[str]
    make_targets: frozenset[str]
    make_outputs: frozenset[str]  # paths the Makefile's recipes write (named there; need not exist yet)
    top_level: frozenset[str]  # the repository's top-level directories (a path starting with one is checked)


class _Parsed(Exception):
    pass


def _kvserve_parser() -> argparse.ArgumentParser:
    """The parser `kvserve` builds, caught when main() would parse (cluster/cli.py builds it in main)."""
    from cluster import cli

    original = argparse.ArgumentParser.parse_args

    def capture(self, *args, **kwargs):
        raise _Parsed(self)

    argparse.ArgumentParser.parse_args = capture
    try:
        cli.main([])
    except _Parsed as parsed:
        return parsed.args[0]
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError("cluster.cli.main returned without parsing its arguments")


def _makefile() -> tuple[frozenset[str], frozenset[str]]:
    targets, outputs = set(), set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        rule = re.match(r"^([^\s#=:$][^:=]*?)\s*::?(?!=)", line)
        if rule and not rule.group(1).startswith("."):
            targets.update(rule.group(1).split())
        if line.startswith("\t"):
            outputs.update(m.group(1) for m in re.finditer(r"--out[= ](\S+)", line))
    return frozenset(targets), frozenset(outputs)


@functools.cache
def facts() -> Facts:
    from cluster.app_args import AppArgs

    parser = _kvserve_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    subcommands = {name: frozenset(sub._option_string_actions) for name, sub in commands.choices.items()}
    targets, outputs = _makefile()
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    top = frozenset(p.split("/", 1)[0] for p in tracked.splitlines() if "/" in p)
    return Facts(subcommands, frozenset(AppArgs.model_fields), targets, outputs, top)


# --- reading a page ------------------------------------------------------------------------------


def split_page(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(the prose with fenced blocks blanked out, [(language, block text)])."""
    prose, blocks, fence, lang, body = [], [], None, "", []
    for line in text.splitlines():
        match = FENCE.match(line)
        if fence is None and match:
            fence, lang, body = match.group(1), match.group(2).lower(), []
            prose.append("")
        elif fence is not None and line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
            blocks.append((lang, "\n".join(body)))
            fence = None
            prose.append("")
        elif fence is not None:
            body.append(line)
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), blocks


def inline_code(prose: str) -> list[str]:
    spans = []
    for paragraph in re.split(r"\n\s*\n", prose):
        spans += [m.group(2).strip() for m in INLINE_CODE.finditer(paragraph)]
    return spans


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"`|\*\*|__", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_page(path.read_text())
    found, seen = set(), {}
    for line in prose.splitlines():
        match = HEADING.match(line)
        if match:
            base = slug(match.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def shell_lines(block: str) -> list[str]:
    """A shell block's commands, continuation lines joined."""
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def words_of(command: str) -> list[list[str]]:
    """The simple commands in a line, each as its words (comments dropped, quotes removed)."""
    try:
        lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
    except ValueError:  # unbalanced quotes: prose-like inline code
        tokens = command.split()
    segments, current = [], []
    for token in tokens:
        if token in SEPARATORS:
            segments.append(current)
            current = []
        else:
            current.append(token)
    segments.append(current)
    return [s for s in segments if s]


# --- checking ------------------------------------------------------------------------------------


def check_path(word: str, base: Path, f: Facts, where: str) -> list[str]:
    """A word that is a repository path (its first part a top-level directory) must exist."""
    word = word.rstrip(".,:;")
    if "/" not in word or word.startswith(("/", "~", "$", "http")) or any(c in word for c in "<>{}*?[]$"):
        return []
    path = word.removeprefix("./")
    if path.split("/", 1)[0] not in f.top_level or path in f.make_outputs:
        return []
    if (ROOT / path).exists():
        return []
    module, dot, attribute = path.rpartition(".")  # `workers/kv_pool.HostKVTier`: a name in a module
    if dot and attribute.isidentifier() and (ROOT / f"{module}.py").is_file():
        return []
    return [f"{where}: path {word!r} does not exist"]


def check_module(name: str, where: str) -> list[str]:
    parts = name.split(".")
    local = ROOT.joinpath(*parts)
    if (ROOT / parts[0]).is_dir() or (ROOT / f"{parts[0]}.py").is_file():
        if local.with_suffix(".py").is_file() or (local / "__main__.py").is_file():
            return []
        return [f"{where}: `python -m {name}`: no module {name} in the repository"]
    if importlib.util.find_spec(parts[0]) is None or (len(parts) > 1 and importlib.util.find_spec(name) is None):
        return [f"{where}: `python -m {name}`: no such module"]
    return []


def check_command(words: list[str], base: Path, f: Facts, where: str) -> list[str]:
    problems = []
    while words and (ASSIGNMENT.match(words[0]) or words[0] in ("env", "sudo", "time", "exec")):
        problems += check_path(words[0].split("=", 1)[1], base, f, where) if "=" in words[0] else []
        words = words[1:]
    if not words:
        return problems
    program = words[0].rsplit("/", 1)[-1]
    args = words[1:]
    for word in words:
        problems += check_path(word.split("=", 1)[-1], base, f, where)
    if program == "kvserve" and args and not args[0].startswith("-"):
        sub = args[0]
        if sub not in f.subcommands:
            problems.append(f"{where}: `kvserve {sub}` is not a kvserve subcommand ({', '.join(sorted(f.subcommands))})")
        else:
            for arg in args[1:]:
                option = arg.split("=", 1)[0]
                if option.startswith("--") and option not in f.subcommands[sub]:
                    problems.append(f"{where}: `kvserve {sub}` has no option {option}")
    elif program == "make":
        skip = False
        for arg in args:
            if skip:
                skip = False
            elif arg in ("-C", "-f", "-j"):
                skip = True
            elif not arg.startswith("-") and not ASSIGNMENT.match(arg) and arg not in f.make_targets:
                problems.append(f"{where}: `make {arg}`: the Makefile has no target {arg!r}")
    elif program == "serve" and len(args) >= 2 and args[0] in ("run", "deploy", "build"):
        if args[1] == "serve_app:app":
            for arg in args[2:]:
                if "=" in arg and not arg.startswith("-"):
                    key = arg.split("=", 1)[0]
                    if key not in f.app_args:
                        problems.append(f"{where}: `serve {args[0]} serve_app:app {key}=...`: {key} is not an "
                                        "AppArgs field")
        elif ":" not in args[1] and "/" not in args[1] and not (ROOT / args[1]).exists():  # paths: check_path
            problems.append(f"{where}: `serve {args[0]} {args[1]}`: no such config")
    elif PYTHON.match(program) and "-m" in args[:-1]:
        problems += check_module(args[args.index("-m") + 1], where)
    return problems


def check_page(text: str, path: Path, f: Facts) -> list[str]:
    """Every problem in one page's text (``path`` places its relative links)."""
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    prose, blocks = split_page(text)
    problems = []
    spans = inline_code(prose)
    linkable = INLINE_CODE.sub("", prose)
    for target in LINK.findall(linkable):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            problems.append(f"{rel}: link {target!r}: {file_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{rel}: link {target!r}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    commands = [(span, "inline code") for span in spans]
    for lang, block in blocks:
        if lang in SHELL_LANGS:
            commands += [(line, "code block") for line in shell_lines(block)]
    for command, kind in commands:
        for words in words_of(command):
            problems += check_command(words, path.parent, f, f"{rel} ({kind} `{command[:60]}`)")
    return problems


# --- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_names_only_what_exists(page):
    problems = check_page(page.read_text(), page, facts())
    assert not problems, "\n".join(problems)


def test_the_facts_come_from_the_code():
    f = facts()
    assert {"generate", "make-model", "bench", "chaos"} <= set(f.subcommands)
    assert "--max-tokens" in f.subcommands["generate"]
    assert {"model", "tensor_parallel_size", "api_key"} <= f.app_args
    assert {"serve", "test", "demo", "install"} <= f.make_targets
    assert "docs/bench/gpu.json" in f.make_outputs
    assert {"engine", "infra", "docs", "tests"} <= f.top_level


BROKEN = """# A page

See [the missing page](docs/nowhere.md), [a heading that is not there](README.md#no-such-heading) and
[a good one](docs/architecture.md#on-ray-serve). Run `kvserve frobnicate --fast` or `kvserve generate
--no-such-flag`, then `make no-such-target`; `infra/missing.yaml` holds it.

```bash
serve run serve_app:app model=/m tensor_parallel_size=2 not_an_arg=1
.venv/bin/python -m kernels.nonexistent && python3 -m no_such_module_here
OUT=/tmp/x bash benchmarks/missing_check.sh
serve run infra/missing_config.yaml
```
"""


def test_a_broken_snippet_is_reported():
    problems = check_page(BROKEN, ROOT / "BROKEN.md", facts())
    text = "\n".join(problems)
    for expected in ("docs/nowhere.md does not exist", "no heading #no-such-heading",
                     "`kvserve frobnicate` is not a kvserve subcommand", "`kvserve generate` has no option --no-such-flag",
                     "has no target 'no-such-target'", "path 'infra/missing.yaml' does not exist",
                     "not_an_arg is not an AppArgs field", "no module kernels.nonexistent",
                     "`python -m no_such_module_here`: no such module", "path 'benchmarks/missing_check.sh'",
                     "path 'infra/missing_config.yaml' does not exist"):
        assert expected in text, f"not reported: {expected}\n{text}"
    assert len(problems) == 11, text  # the good link, model=, tensor_parallel_size= and /tmp pass


def test_a_clean_snippet_passes():
    clean = ("Run `kvserve generate --prompt Hi --max-tokens 4`, `make demo`, "
             "`serve run serve_app:app model=/m max_num_seqs=8`, `python -m kernels.cpu`; "
             "see [architecture](docs/architecture.md#on-ray-serve) and `infra/serve_config.yaml`.\n")
    assert check_page(clean, ROOT / "CLEAN.md", facts()) == []
