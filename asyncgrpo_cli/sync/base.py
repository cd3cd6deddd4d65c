"""The defaults of ``protocols.WeightSync``: no optional hook, built from ``(control, directory, info)``."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncgrpo_cli.protocols import WeightSync

if TYPE_CHECKING:
    from asyncgrpo_cli.config.schema import RootConfig
    from asyncgrpo_cli.server.control import ServerControl
    from asyncgrpo_cli.train.distributed import DistInfo


class BaseWeightSync(WeightSync):
    """Subclass it and write ``push`` and ``close``; override a hook only when the backend has it."""

    control: ServerControl | None = None
    directory: Path | None = None
    served_name_template: str | None = None
    repush = None

    @classmethod
    def build(cls, cfg: RootConfig, control: ServerControl | None, directory: Path, info: DistInfo) -> Any:
        """A backend without settings of its own: ``cls(control, directory, info)``."""
        return cls(control, directory, info)

    def push(self, model: Any, version: int) -> dict[str, float]:
        raise NotImplementedError

    def served_name(self, version: int) -> str | None:
        return None

    def close(self) -> None:
        raise NotImplementedError
