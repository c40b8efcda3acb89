"""The command lines README.md and docs/*.md show: every `pipetrain VERB ...` line of a code block parses with the
CLI's own parser (each flag exists as spelled, each value has its type), and none passes a flag the CLI marks
deprecated. Shell variables set in the same block (`DIR=...`, `COMMON="..."`) are expanded; `...` is dropped."""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import shlex
from pathlib import Path

import pytest

from pipetrain.cli.main import VERBS, build_parser

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
ASSIGN = re.compile(r"""^(\w+)=(?:"([^"]*)"|'([^']*)'|(\S*))""", re.M)
COMMAND = re.compile(r"(?:^|[\s;(&|])pipetrain (\S.*)")


def _lines(body: str) -> list[str]:
    """A block's logical lines: variables expanded, continuations joined, comments dropped."""
    for name, double, single, bare in ASSIGN.findall(body):
        value = " ".join((double or single or bare).split())
        body = body.replace("${%s}" % name, value).replace("$" + name, value)
    lines, pending = [], ""
    for line in body.splitlines():
        line = "" if line.lstrip().startswith("#") else line.split(" #")[0]
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        lines.append(pending + line)
        pending = ""
    return lines


def doc_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `pipetrain`) for each command line in a code block of the README and the guides."""
    out = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in BLOCK.findall(page.read_text()):
            prompted = re.findall(r"^\$ (.*)$", block, re.M)  # a session: its commands follow `$ `, the rest is output
            for line in _lines("\n".join(prompted) if prompted else block):
                if not (match := COMMAND.search(line)):
                    continue
                text = re.split(r"\s(?:\||>|2>|&&|;|2>&1)\s", f" {match.group(1)} ")[0].strip().rstrip(")")
                argv = [word for word in shlex.split(text) if word not in ("...", "…")]
                if argv and argv[0] in VERBS:
                    out.append((f"{page.relative_to(ROOT)}: pipetrain {text}", argv))
    return out


@functools.lru_cache(maxsize=None)
def _parser(verb: str) -> argparse.ArgumentParser:
    return build_parser([verb])


def _parse(argv: list[str]) -> str | None:
    """None when the CLI's parser accepts `argv`, else its error line."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            _parser(argv[0]).parse_args(argv)
    except SystemExit as stop:
        return err.getvalue().strip().splitlines()[-1] if stop.code else None
    return None


def _deprecated(argv: list[str]) -> set[str]:
    """The flags of argv's verb whose help hides them or calls them deprecated."""
    parser = _parser(argv[0])
    verb = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[argv[0]]
    return {flag for action in verb._actions for flag in action.option_strings
            if action.help == argparse.SUPPRESS or (action.help or "").startswith("deprecated")}


COMMANDS = doc_commands()


def test_the_docs_show_command_lines():
    assert len(COMMANDS) > 150  # the extraction still finds them
    assert {argv[0] for _, argv in COMMANDS} >= {"train", "check", "plan", "sbatch", "generate", "eval", "export"}


def test_every_command_line_parses_and_uses_no_deprecated_flag():
    bad, deprecated = [], {}
    for where, argv in COMMANDS:
        train_argv = argv[argv.index("--") + 1:] if argv[0] == "sbatch" and "--" in argv else None
        for words in ([argv[:argv.index("--")], ["train", *train_argv]] if train_argv is not None else [argv]):
            if words[0] not in deprecated:
                deprecated[words[0]] = _deprecated(words)
            if (error := _parse(words)) or (error := ", ".join(sorted(deprecated[words[0]] & set(words)))):
                bad.append(f"{where}\n    {error}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("argv, fails", [(["train", "--pp", "2"], False), (["train", "--pp", "two"], True),
                                         (["plan", "--no-such-flag"], True)])
def test_the_check_can_fail(argv, fails):
    assert (_parse(argv) is not None) is fails
    assert "--gpu-node" in _deprecated(["plan"]) and "--no-pack" in _deprecated(["train"])
