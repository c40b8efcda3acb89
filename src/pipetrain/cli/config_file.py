"""Config files of a verb: TOML whose keys are its long flag names, grouped in sections; command-line flags win.

Generic over the argparse parser: every flag a verb defines is a key, with no list to maintain.

- A key is a flag's long name without the dashes (`batch-size`; `batch_size` is the same key; an alias such
  as `n-microbatches` for `chunks` too). Sections are the parser's argument groups, named by their titles in
  lower case with dashes (`[parallelism]`, `[training]`, `[checkpoints-and-failures]`, ...); a section only
  groups, any flag may be given in any section or at the top.
- Values have TOML types: integers, floats (an integer is accepted for a float), strings (paths are
  strings), `true`/`false` for on/off flags, an array for a comma-separated flag (`balance = [3, 5]`).
  An unset flag is left out (TOML has no null).
- Precedence: a flag on the command line, else the file, else the flag's default.
- `--print-config` prints the effective configuration (file and flags applied) in this format, and
  `--config` reads back exactly what it printed.

Errors (an unknown key or section, naming the closest known one; a value of the wrong type, naming key,
value and expected type; a file that is not TOML) are one-line `ConfigError`s: the CLI exits 2.
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipetrain.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

__all__ = ["add_config_arguments", "apply_config_file", "effective_config", "load_config", "dump_config",
           "section_name"]

#: dests that configure the configuration itself, never keys of a file
_OWN = ("config", "print_config", "help", "config_parser")
#: the title argparse gives the group of flags added outside any group
_UNGROUPED = ("options", "optional arguments")


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `--config FILE` and `--print-config` to a verb's parser."""
    group = parser.add_argument_group("configuration")
    group.add_argument("--config", type=Path, default=None, metavar="FILE",
                       help="read flags from this TOML file (keys: long flag names; flags given here win)")
    group.add_argument("--print-config", action="store_true",
                       help="print the effective configuration as a file --config reads, and exit")


def section_name(title: str | None) -> str:
    """The TOML section of an argument group: its title in lower case, runs of other characters as one dash."""
    return re.sub(r"[^a-z0-9]+", "-", (title or "").lower()).strip("-")


def _key(text: str) -> str:
    return text.lstrip("-").replace("_", "-").lower()


def _configurable(action: argparse.Action) -> bool:
    return (action.dest not in _OWN and action.default is not argparse.SUPPRESS
            and any(s.startswith("--") for s in action.option_strings)
            and isinstance(action, (argparse._StoreAction, argparse._StoreTrueAction, argparse._StoreFalseAction,
                                    argparse.BooleanOptionalAction)))


def _key_of(action: argparse.Action) -> str:
    """The key printed for `action`: its first long option."""
    return _key(next(s for s in action.option_strings if s.startswith("--")))


def _groups(parser: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    """(section, configurable actions) of each argument group of `parser`, in order ("" for ungrouped flags)."""
    out = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if _configurable(a)]
        if actions:
            out.append(("" if group.title in _UNGROUPED else section_name(group.title), actions))
    return out


def _index(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every key `parser` accepts (long options and their aliases; not the `--no-` half of a boolean pair)."""
    keys: dict[str, argparse.Action] = {}
    for _, actions in _groups(parser):
        for action in actions:
            for option in action.option_strings:
                if option.startswith("--"):
                    if isinstance(action, argparse.BooleanOptionalAction) and option.startswith("--no-"):
                        continue
                    keys[_key(option)] = action
    return keys


def _closest(word: str, known: Sequence[str], what: str) -> str:
    close = difflib.get_close_matches(word, list(known), n=1)
    return f"did you mean {close[0]!r}?" if close else f"known {what}s: {', '.join(sorted(known))}"


def _type_name(action: argparse.Action) -> str:
    if _is_switch(action):
        return "true or false"
    kind = action.type
    if kind is int:
        return "an integer"
    if kind is float:
        return "a number"
    if kind is None or kind is str:
        return "a string"
    if kind is Path:
        return "a path (a string)"
    return f"a string (or an array) that {_key_of(action)} accepts"


def _is_switch(action: argparse.Action) -> bool:
    return action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction)


def _scalar(action: argparse.Action, value: Any, where: str, source: str) -> Any:
    """One TOML value converted as the flag's `type` would convert its text; ConfigError when it cannot be."""
    kind = action.type

    def wrong(extra: str = "") -> ConfigError:
        return ConfigError(f"{source}: {where} = {value!r} is not {_type_name(action)}{extra}",
                           hint=f"write e.g. {_example(action)}")

    if isinstance(value, bool) or isinstance(value, (dict,)):
        raise wrong()
    if kind is int:
        if not isinstance(value, int):
            raise wrong()
        return value
    if kind is float:
        if not isinstance(value, (int, float)):
            raise wrong()
        return float(value)
    if isinstance(value, list):
        if kind is None or kind is str or kind is Path or not all(isinstance(v, (int, float, str)) for v in value):
            raise wrong()
        value = ",".join(str(v) for v in value)  # a flag that reads comma-separated values
    if isinstance(value, (int, float)) and kind not in (None, str, Path):
        value = str(value)  # a flag whose own type reads numbers or words (e.g. --keep 3|all)
    if not isinstance(value, str):
        raise wrong()
    if kind is None or kind is str:
        return value
    try:
        return kind(value)
    except (argparse.ArgumentTypeError, TypeError, ValueError) as err:
        raise wrong(f" ({err})") from None


def _example(action: argparse.Action) -> str:
    key = _key_of(action)
    if _is_switch(action):
        return f"{key} = true"
    examples = {int: "4", float: "0.001"}
    return f"{key} = {examples.get(action.type, chr(34) + 'TEXT' + chr(34))}"


def _convert(action: argparse.Action, value: Any, where: str, source: str) -> Any:
    if _is_switch(action):
        if not isinstance(value, bool):
            raise ConfigError(f"{source}: {where} = {value!r} is not {_type_name(action)}",
                              hint=f"write e.g. {_example(action)}")
        if isinstance(action, argparse.BooleanOptionalAction) or action.const is True:
            return value
        return action.default if not value else action.const  # store_false / store_const
    if action.nargs == "?" and isinstance(value, bool):  # the flag alone (its const), or not given (or its `off`)
        return action.const if value else getattr(action, "off", action.default)
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{source}: {where} = {value!r} is not one of {list(action.choices)}",
                          hint=f"choose one of: {', '.join(map(str, action.choices))}")
    if action.nargs in ("+", "*") or isinstance(action.nargs, int):
        if not isinstance(value, list):
            raise ConfigError(f"{source}: {where} = {value!r} is not an array", hint=f"write {where} = [...]")
        return [_scalar(action, v, where, source) for v in value]
    return _scalar(action, value, where, source)


def load_config(path: Path, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The flag values (dest -> value) of the config file `path` for `parser`'s flags; ConfigError on a bad file."""
    source = f"config file {str(path)!r}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read the {source}: {err.strerror or err}",
                          hint="pass --config with a TOML file you can read") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"the {source} is not valid TOML: {err}", hint="see https://toml.io for the syntax") from None
    keys = _index(parser)
    sections = {name for name, _ in _groups(parser) if name}
    values: dict[str, Any] = {}
    given: dict[str, str] = {}

    def take(key: str, value: Any, where: str) -> None:
        action = keys.get(_key(key))
        if action is None:
            raise ConfigError(f"{source}: unknown key {where!r}", hint=_closest(_key(key), list(keys), "key"))
        if action.dest in given:
            raise ConfigError(f"{source}: {where!r} sets {_key_of(action)}, already set by {given[action.dest]!r}",
                              hint="keep one of them")
        given[action.dest] = where
        values[action.dest] = _convert(action, value, where, source)

    for name, value in data.items():
        if not isinstance(value, dict):
            take(name, value, name)
            continue
        if section_name(name) not in sections:
            raise ConfigError(f"{source}: unknown section [{name}]", hint=_closest(section_name(name), sorted(sections),
                                                                                  "section"))
        for key, item in value.items():
            if isinstance(item, dict):
                raise ConfigError(f"{source}: [{name}] {key} is a table; sections do not nest",
                                  hint="write the flags of a section as key = value lines")
            take(key, item, f"[{name}] {key}")
    return values


def _toml_value(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple):
        return [_toml_value(v) for v in value]
    if isinstance(value, list):
        return [_toml_value(v) for v in value]
    return value


def dump_config(parser: argparse.ArgumentParser, args: argparse.Namespace, *, title: str = "") -> str:
    """The effective flag values of `args` as a TOML file `load_config` reads back (unset flags left out)."""
    import tomli_w

    data: dict[str, Any] = {}
    for section, actions in _groups(parser):
        table = data if not section else data.setdefault(section, {})
        for action in actions:
            value = getattr(args, action.dest, None)
            if _is_switch(action) and not isinstance(action, argparse.BooleanOptionalAction) and action.const is not True:
                value = value == action.const
            if value is not None:
                table[_key_of(action)] = _toml_value(value)
    head = f"# {title}\n" if title else ""
    return head + tomli_w.dumps({k: v for k, v in data.items() if v != {}})


def _verb_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(getattr(args, action.dest, None))
    return None


def apply_config_file(parser: argparse.ArgumentParser, argv: Sequence[str], args: argparse.Namespace
                      ) -> argparse.Namespace:
    """`args` again, with the values of `--config FILE` under the flags given in `argv`, and the effective
    configuration as TOML text in `args.effective_config`; `args` itself for a verb without `--config`."""
    verb = _verb_parser(parser, args) or parser
    if not any(a.dest == "config" for a in verb._actions):
        return args
    if args.config is not None:
        verb.set_defaults(**load_config(args.config, verb))
        args = parser.parse_args(list(argv))
    args.config_parser = verb  # to print the configuration again once the verb has resolved its defaults
    args.effective_config = effective_config(args)
    return args


def effective_config(args: argparse.Namespace) -> str:
    """The configuration of `args` (parsed and passed through `apply_config_file`) as a file `--config` reads."""
    verb = args.config_parser
    return dump_config(verb, args, title=f"{verb.prog}: effective configuration (read by --config FILE)")
