"""``F``: a dataclass field carrying its documentation (``asyncgrpo check --explain`` prints it). Imports no torch."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def F(default: Any = None, help: str = "", *, factory: Any = None) -> Any:  # noqa: A002 - mirrors argparse
    """A dataclass field carrying its documentation."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})
