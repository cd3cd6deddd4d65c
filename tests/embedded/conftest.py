"""Fixtures of the embedded-server tests: one server subprocess per module (on the tiny model, one torch thread),
a client on it, and the transformers reference forward to compare against.

A module sets its server's config with ``SERVER = {...}`` (``EmbeddedServerConfig`` fields over these defaults).
"""

from __future__ import annotations

import httpx
import pytest
import torch

from asyncgrpo_cli.config.schema import EmbeddedServerConfig
from asyncgrpo_cli.server.launch import EmbeddedServerProcess

NAME = "tiny"
DEFAULTS = {"port": 0, "max_model_len": 256, "max_num_seqs": 8, "num_threads": 1}


@pytest.fixture(scope="module")
def server(request, tiny_model_dir, tmp_path_factory):
    cfg = EmbeddedServerConfig(**{**DEFAULTS, **getattr(request.module, "SERVER", {})})
    proc = EmbeddedServerProcess(
        tiny_model_dir,
        cfg,
        served_model_name=getattr(request.module, "NAME", NAME),
        log_path=tmp_path_factory.mktemp("server") / "server.log",
        startup_timeout=120,
    )
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The tiny model in transformers, for reference forwards."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
