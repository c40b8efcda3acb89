"""Workloads named by import path: `MODULE:NAME` or `path/to/file.py:NAME` (a Workload, subclass or factory).

`load_workload(spec)` imports the module (a file is loaded under a module name made from its absolute path,
so loading it twice in one process gives the same classes) and turns `NAME` into a `Workload`: an instance is
used as it is, a `Workload` subclass or any other callable is called with no argument. Ranks are fresh
processes: they get the spec string (never the workload object) and load it again. Objects whose classes live
in a loaded file (a dataset of the user's own type) cross to a rank inside `portable(spec, obj)`, which loads
the file in the rank before unpickling them.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import pickle
import sys
from pathlib import Path
from typing import Any

from pipetrain.errors import ConfigError
from pipetrain.workloads.base import Workload
from pipetrain.workloads.names import is_import_spec

__all__ = ["is_import_spec", "load_workload", "load_object", "workload_label", "portable", "Portable"]

_FILE_MODULE_PREFIX = "pipetrain_user_workload_"


def workload_label(spec: str) -> str:
    """A short name of the workload `spec` for folder names: `NAME` of an import path, else `spec` itself."""
    return spec.rpartition(":")[2] if is_import_spec(spec) else spec


def _split(spec: str, flag: str = "--workload") -> tuple[str, str]:
    where, _, name = spec.rpartition(":")
    if not where or not name or not name.isidentifier():
        raise ConfigError(f"{flag} {spec!r} is not MODULE:NAME or path/to/file.py:NAME",
                          hint="e.g. --workload examples/my_model.py:workload or --workload mypkg.models:workload")
    return where, name


def _is_file(where: str) -> bool:
    return where.endswith(".py") or "/" in where or "\\" in where


def _load_file(spec: str, where: str, flag: str = "--workload") -> Any:
    path = Path(where).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"{flag} {spec!r}: no such file {where!r}" + (" (a folder)" if path.is_dir() else ""),
                          hint="pass the path of a .py file (relative to the current folder, or absolute)")
    module_name = _FILE_MODULE_PREFIX + hashlib.sha1(str(path).encode()).hexdigest()[:16]
    if module_name in sys.modules:
        return sys.modules[module_name]
    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"{flag} {spec!r}: {where!r} cannot be loaded as a Python module",
                          hint="pass a .py file")
    module = importlib.util.module_from_spec(module_spec)
    if str(path.parent) not in sys.path:  # as `python FILE` does: the file may import the modules beside it
        sys.path.append(str(path.parent))
    sys.modules[module_name] = module  # before running it: dataclasses and pickle look the module up by name
    try:
        module_spec.loader.exec_module(module)
    except BaseException as err:
        del sys.modules[module_name]
        raise _import_failed(spec, where, err, flag) from err
    return module


def _import_failed(spec: str, where: str, err: BaseException, flag: str = "--workload") -> ConfigError:
    line = ""
    tb = err.__traceback__
    while tb is not None:  # the innermost frame of the user's file says where it broke
        if tb.tb_frame.f_code.co_filename.endswith(Path(where).name):
            line = f" (line {tb.tb_lineno})"
        tb = tb.tb_next
    return ConfigError(f"{flag} {spec!r}: importing {where!r} failed{line}: {type(err).__name__}: {err}",
                       hint="fix the error above (run `python -c 'import ...'` or the file itself to see the "
                            "traceback)")


def _load_module(spec: str, where: str, flag: str = "--workload") -> Any:
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as err:
        itself = err.name is not None and (where == err.name or where.startswith(err.name + "."))
        if itself:
            raise ConfigError(f"{flag} {spec!r}: cannot import {where!r}: no module named {err.name!r}",
                              hint="check the name, put its folder on PYTHONPATH, or pass a file: "
                                   "path/to/file.py:NAME") from None
        raise ConfigError(f"{flag} {spec!r}: importing {where!r} failed: it needs the module {err.name!r}, "
                          "which is not installed", hint=f"install the package that provides {err.name!r}") from None
    except Exception as err:
        raise _import_failed(spec, where, err, flag) from err


def load_object(spec: str, flag: str) -> Any:
    """The object that the import path `spec` (`MODULE:NAME` or `file.py:NAME`, given as `flag`) names, as it is;
    every kind of bad input raises one ConfigError naming `flag`."""
    where, name = _split(spec, flag)
    module = _load_file(spec, where, flag) if _is_file(where) else _load_module(spec, where, flag)
    if not hasattr(module, name):
        raise ConfigError(f"{flag} {spec!r}: {where!r} has no {name!r}", hint=f"define {name} in {where}")
    return getattr(module, name)


def load_workload(spec: str):
    """The `Workload` that the import path `spec` names; every kind of bad input raises one ConfigError."""
    where, name = _split(spec)
    module = _load_file(spec, where) if _is_file(where) else _load_module(spec, where)
    if not hasattr(module, name):
        found = sorted(key for key, value in vars(module).items()
                       if not key.startswith("_") and (isinstance(value, Workload)
                                                       or inspect.isclass(value) and issubclass(value, Workload)
                                                       and value is not Workload and not inspect.isabstract(value)))
        raise ConfigError(f"--workload {spec!r}: {where!r} has no {name!r}",
                          hint=f"workloads found there: {', '.join(found)}" if found
                          else "define a Workload instance, subclass or factory under that name")
    obj = getattr(module, name)
    if isinstance(obj, Workload):
        return obj
    if inspect.isclass(obj) and not issubclass(obj, Workload):
        raise _not_a_workload(spec, f"the class {obj.__name__}, not a Workload subclass")
    if inspect.isclass(obj) and inspect.isabstract(obj):
        missing = ", ".join(sorted(obj.__abstractmethods__))
        raise ConfigError(f"--workload {spec!r}: {obj.__name__} is abstract (it does not define {missing})",
                          hint="define those methods of pipetrain.workloads.base.Workload")
    if not callable(obj):
        raise _not_a_workload(spec, _a(type(obj).__name__))
    try:
        made = obj()
    except TypeError as err:
        raise ConfigError(f"--workload {spec!r}: calling {name}() failed: {err}",
                          hint="a factory takes no arguments and returns a Workload") from None
    if not isinstance(made, Workload):
        raise _not_a_workload(spec, f"a factory returning {_a(type(made).__name__)}")
    return made


def _a(noun: str) -> str:
    """`noun` with its indefinite article: "an int", "a str"."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _not_a_workload(spec: str, what: str) -> ConfigError:
    return ConfigError(f"--workload {spec!r} is {what}, not a workload",
                       hint="NAME must be a pipetrain.workloads.base.Workload instance, subclass, or a factory "
                            "returning one")


class Portable:
    """`obj` pickled so that a fresh process loads the workload `spec` (its file's classes) before unpickling it."""

    def __init__(self, spec: str, obj: Any) -> None:
        self.spec, self.obj = spec, obj

    def __reduce__(self):
        return _restore, (self.spec, pickle.dumps(self.obj))


def _restore(spec: str, blob: bytes) -> Any:
    if is_import_spec(spec):
        where, _ = _split(spec)
        _load_file(spec, where) if _is_file(where) else _load_module(spec, where)
    return pickle.loads(blob)


def portable(spec: str, obj: Any) -> Any:
    """`obj` as it should be handed to spawned ranks: wrapped in `Portable` for an import-path workload (the
    rank receives `obj` itself, unpickled after the workload's module is loaded), else unchanged."""
    return Portable(spec, obj) if is_import_spec(spec) else obj
