"""Frozen dataclasses filled from parsed flags: each field from the flag of the same name, unless given."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any, TypeVar

__all__ = ["from_flags"]

T = TypeVar("T")


def from_flags(cls: type[T], args: argparse.Namespace, **given: Any) -> T:
    """`cls(...)` with every field that `given` does not set taken from the parsed flag of its name (`args.<field>`);
    a field with no flag of its name keeps its default."""
    values = {f.name: getattr(args, f.name) for f in fields(cls) if f.init and hasattr(args, f.name)}
    return cls(**{**values, **given})
