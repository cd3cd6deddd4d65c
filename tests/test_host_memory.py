"""``trainer.keep_host_memory``: glibc's thresholds are set in the process, unless the user set glibc's own
variables. A fresh process counts its page faults over allocations of a packed row's size, with the kept setting
and with the returned one ``bench planning host_memory=both`` compares against."""

from __future__ import annotations

import subprocess
import sys

import pytest

from asyncgrpo_cli import host_memory

FAULTS = """
import resource, sys
import numpy as np
from asyncgrpo_cli import host_memory
if sys.argv[1] == "keep":
    applied = host_memory.keep_freed_memory()
else:  # glibc's starting thresholds, fixed: what bench planning's host_memory=return compares against
    applied = host_memory.set_thresholds(host_memory.RETURN, trim=True)
for _ in range(3):  # warm: the first rounds fault the heap in either way
    a = np.ones(4 << 20, np.uint8); del a
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    a = np.ones(4 << 20, np.uint8); del a   # 4 MiB allocated, written and freed, again and again
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc = pytest.mark.skipif(host_memory._libc() is None, reason="needs glibc")


def faults(mode: str, env: dict | None = None) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", FAULTS, mode], capture_output=True, text=True, check=True, env=env, timeout=60
    ).stdout.split()
    return out[0], int(out[1])


@glibc
def test_kept_memory_serves_the_next_allocation_without_page_faults():
    applied, kept = faults("keep")
    _, returned = faults("return")
    assert applied == "True"
    # returned: every one of the 20 allocations faults fresh pages in (1,024 each, fewer with transparent huge
    # pages); kept: the heap serves them again
    assert returned >= 20 and kept * 10 < returned


@glibc
def test_the_users_own_malloc_variables_win(monkeypatch):
    import os

    env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": "131072"}
    applied, _ = faults("keep", env)
    assert applied == "False"
