"""Entry of the embedded server process: ``python -m asyncgrpo_cli.embedded --config FILE``.

``FILE`` is the JSON object ``server/launch.py`` writes: ``model``, ``served_model_name``, ``ready_file``,
``parent_pid`` and ``server`` (the validated ``EmbeddedServerConfig``). The parent watch starts before anything
heavy is imported (torch, transformers, the model), so a launcher killed at any moment leaves no server behind:
Linux's ``PR_SET_PDEATHSIG`` (set by the launcher before ``exec``) plus a parent-PID check here, which also
covers a parent that died before the child got that far.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from asyncgrpo_cli.parent_watch import watch_parent

PORT_IN_USE_EXIT = 3


def read_spec(path: str) -> dict[str, Any]:
    try:
        spec = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: cannot read the server config {path}: {e}") from None
    if not isinstance(spec, dict) or "model" not in spec or "server" not in spec:
        raise SystemExit(f"error: {path} is not an embedded-server config (needs 'model' and 'server')")
    return spec


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) != 2 or argv[0] != "--config":
        print("usage: python -m asyncgrpo_cli.embedded --config FILE", file=sys.stderr)
        return 2
    spec = read_spec(argv[1])
    if spec.get("parent_pid"):
        watch_parent(int(spec["parent_pid"]))

    import logging

    from asyncgrpo_cli.config.schema import EmbeddedServerConfig
    from asyncgrpo_cli.errors import UserError

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = EmbeddedServerConfig(**spec["server"])
    except TypeError as e:
        print(f"error: {argv[1]}: 'server' does not match EmbeddedServerConfig: {e}", file=sys.stderr)
        return 2
    from asyncgrpo_cli.embedded.app import PortInUseError, run_server

    try:
        run_server(
            spec["model"],
            cfg,
            served_model_name=spec.get("served_model_name"),
            ready_file=spec.get("ready_file"),
        )
    except PortInUseError as e:
        print(f"error: {e}", file=sys.stderr)
        return PORT_IN_USE_EXIT
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
