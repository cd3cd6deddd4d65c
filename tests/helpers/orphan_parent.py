"""A stand-in for the train process in the orphan tests: it starts a child the way ``train`` does and is
SIGKILLed by the test while the child is still starting.

    python -m tests.helpers.orphan_parent server MODEL_DIR LOG   # the embedded server (server/launch.py)
    python -m tests.helpers.orphan_parent rollout                # the rollout process (rollout/process.py)
"""

from __future__ import annotations

import sys
import time


class SlowToUnpickle:
    """A dataset whose unpickling in the rollout process takes a while (heavy imports, a large dataset)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __setstate__(self, state: dict) -> None:
        time.sleep(state["seconds"])
        self.__dict__.update(state)


def server(model_dir: str, log: str) -> None:
    from asyncgrpo_cli.config.schema import EmbeddedServerConfig
    from asyncgrpo_cli.server.launch import EmbeddedServerProcess

    cfg = EmbeddedServerConfig(port=0, max_model_len=256, max_num_seqs=4, num_threads=1)
    EmbeddedServerProcess(model_dir, cfg, log_path=log, startup_timeout=120).start()
    time.sleep(120)


def rollout() -> None:
    from asyncgrpo_cli.rollout.process import RolloutProcess, RolloutSpec

    spec = RolloutSpec("default", settings=None, dataset=SlowToUnpickle(60.0), reward_entries=[])
    RolloutProcess(spec, worker_timeout=120, start_timeout=120).start()  # waits for a ready that never comes
    time.sleep(120)


if __name__ == "__main__":
    {"server": server, "rollout": rollout}[sys.argv[1]](*sys.argv[2:])
