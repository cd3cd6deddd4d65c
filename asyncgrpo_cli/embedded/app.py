"""The embedded generation server: the subset of vLLM's HTTP API the rollout client and the weight sync use.

Same routes, field names, shapes and metric names as vLLM (``VLLM_SERVER_DEV_MODE=1`` routes included), so the
client has one code path. It exists so the quickstart runs on a laptop CPU and tests run in seconds; it is not a
production engine. The HTTP layer (starlette + uvicorn, as vLLM) is ``http_server.py``; loopback by default.
Started as ``python -m asyncgrpo_cli.embedded --config FILE`` (``embedded/__main__.py``) or ``asyncgrpo serve``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from asyncgrpo_cli.config.schema import EmbeddedServerConfig
from asyncgrpo_cli.embedded import http_server, lora, weight_transfer
from asyncgrpo_cli.embedded import metrics as prom
from asyncgrpo_cli.embedded.api import ApiError, ModelContext
from asyncgrpo_cli.embedded.completions import (
    build_completion_response,
    parse_completion_request,
)
from asyncgrpo_cli.embedded.engine import GenerationEngine
from asyncgrpo_cli.embedded.generate import build_generate_response, parse_generate_request
from asyncgrpo_cli.embedded.http_server import EmbeddedHTTPServer, Payload, Route
from asyncgrpo_cli.embedded.http_server import PortInUseError as PortInUseError  # re-exported: __main__.py
from asyncgrpo_cli.errors import UserError

log = logging.getLogger("asyncgrpo.server")


@dataclass
class EmbeddedApp:
    """Server state shared by the request threads: the engine, the model context and the weight version."""

    engine: GenerationEngine
    ctx: ModelContext
    model_dir: str
    cfg: EmbeddedServerConfig
    dtype_name: str
    weight_version: str = "default"
    stopping: threading.Event = field(default_factory=threading.Event)
    weight_transfer: weight_transfer.WeightReceiver | None = None
    """The NCCL weight-transfer receiver (``weight_transfer.py``); built from the engine when not given."""
    adapters: lora.AdapterSet | None = None
    """Loaded LoRA adapters (``lora.py``); None without ``--enable-lora``."""
    registry: CollectorRegistry = field(init=False)
    """What ``GET /metrics`` renders: the engine's counters under vLLM's names (``metrics.py``)."""

    def __post_init__(self) -> None:
        if self.weight_transfer is None:
            self.weight_transfer = weight_transfer.WeightReceiver(self.engine)
        self.registry = prom.metrics_registry(
            lambda: self.engine.stats(), lambda: self.ctx.served_name, self.cfg
        )


def _json_body(body: bytes) -> Any:
    if not body:
        return {}
    try:
        return json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None


def _wait_all(app: EmbeddedApp, handles: list[Any]) -> None:
    for h in handles:
        while not h.wait(1.0):
            if app.stopping.is_set():
                raise ApiError("the server is shutting down", 503, "ServiceUnavailableError")
        if h.error:
            raise ApiError(h.error, 500, "InternalServerError")


# -- routes -----------------------------------------------------------------------------------------------------
def completions(app: EmbeddedApp, query: dict[str, str], body: bytes) -> tuple[int, Payload]:
    req = _json_body(body)
    ctx, adapter = lora.for_request(app, req)  # "model" may name a LoRA adapter
    plan = parse_completion_request(req, ctx)
    for r in plan.requests:
        r.adapter = adapter
    handles = [app.engine.submit(r) for r in plan.requests]
    _wait_all(app, handles)
    return 200, build_completion_response(plan, [h.completions for h in handles], ctx)


def generate(app: EmbeddedApp, query: dict[str, str], body: bytes) -> tuple[int, Payload]:
    """vLLM's ``/inference/v1/generate`` (tokens in, tokens + log-probs + sampling masks out; ``generate.py``)."""
    req = _json_body(body)
    ctx, adapter = lora.for_request(app, req)  # "model" may name a LoRA adapter
    plan = parse_generate_request(req, ctx)
    plan.request.adapter = adapter
    handle = app.engine.submit(plan.request)
    _wait_all(app, [handle])
    return 200, build_generate_response(plan, handle.completions, ctx)


def models(app: EmbeddedApp, query: dict[str, str], body: bytes) -> tuple[int, Payload]:
    card = {
        "id": app.ctx.served_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "asyncgrpo",
        "root": app.model_dir,
        "parent": None,
        "max_model_len": app.ctx.max_model_len,
        "permission": [],
    }
    adapters = app.adapters.cards() if app.adapters is not None else []
    return 200, {"object": "list", "data": [card, *adapters]}


def health(app: EmbeddedApp, query: dict[str, str], body: bytes) -> tuple[int, Payload]:
    return 200, None


def metrics(app: EmbeddedApp, query: dict[str, str], body: bytes) -> tuple[int, Payload]:
    return 200, prom.render(app.registry)


def pause(app: EmbeddedApp, query: dict[str, str], body: bytes) -> tuple[int, Payload]:
    mode = query.get("mode", "abort")
    if mode not in ("abort", "wait", "keep"):
        raise ApiError(f"mode must be one of abort, wait, keep; got {mode!r}", param="mode")
    clear = query.get("clear_cache", "true").lower()
    if clear not in ("true", "false", "1", "0"):
        raise ApiError(f"clear_cache must be true or false; got {clear!r}", param="clear_cache")
    app.engine.pause(mode, clear_cache=clear in ("true", "1"))
    return 200, {"status": "paused"}


def resume(app: EmbeddedApp, query: dict[str, str], body: bytes) -> tuple[int, Payload]:
    app.engine.resume()
    return 200, {"status": "resumed"}


def is_paused(app: EmbeddedApp, query: dict[str, str], body: bytes) -> tuple[int, Payload]:
    return 200, {"is_paused": app.engine.is_paused}


def collective_rpc(app: EmbeddedApp, query: dict[str, str], body: bytes) -> tuple[int, Payload]:
    req = _json_body(body)
    method = req.get("method") if isinstance(req, dict) else None
    if method != "reload_weights":
        raise ApiError(
            f"collective_rpc method {method!r} is not supported by the embedded server "
            "(supported: reload_weights)",
            param="method",
        )
    kwargs = req.get("kwargs") or {}
    args = req.get("args") or []
    path = kwargs.get("weights_path") or (args[0] if args else None) or app.model_dir
    try:
        app.engine.reload_weights(path)
    except (ValueError, OSError) as e:
        raise ApiError(str(e), param="weights_path") from None
    log.info("reloaded weights from %s", path)
    return 200, {"results": [None]}


def reset_prefix_cache(app: EmbeddedApp, query: dict[str, str], body: bytes) -> tuple[int, Payload]:
    return 200, {"success": app.engine.reset_prefix_cache()}


def update_weight_version(app: EmbeddedApp, query: dict[str, str], body: bytes) -> tuple[int, Payload]:
    req = _json_body(body)
    version = req.get("new_version") if isinstance(req, dict) else None
    if version is None:
        raise ApiError("new_version is required", param="new_version")
    app.weight_version = str(version)
    return 200, {"success": True, "new_version": app.weight_version}


def weight_info(app: EmbeddedApp, query: dict[str, str], body: bytes) -> tuple[int, Payload]:
    return 200, {"weight_version": app.weight_version}


def world_size(app: EmbeddedApp, query: dict[str, str], body: bytes) -> tuple[int, Payload]:
    return 200, {"world_size": 1}


def server_info(app: EmbeddedApp, query: dict[str, str], body: bytes) -> tuple[int, Payload]:
    model_config = {
        "model": app.model_dir,
        "served_model_name": app.ctx.served_name,
        "dtype": app.dtype_name,
        "max_model_len": app.ctx.max_model_len,
        "max_logprobs": app.ctx.max_logprobs,
        "logprobs_mode": "processed_logprobs",
        "return_sampling_mask": True,  # /inference/v1/generate returns each token's candidate set
    }
    config = {
        "model_config": model_config,
        "lora_config": app.adapters.server_config() if app.adapters is not None else None,
        "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1, "pipeline_parallel_size": 1},
        "cache_config": {
            "block_size": 1,
            "num_gpu_blocks": app.cfg.kv_cache_tokens,
            "enable_prefix_caching": app.cfg.prefix_cache_size > 0,
        },
        "scheduler_config": {"max_num_seqs": app.cfg.max_num_seqs},
        "device_config": {"device": str(app.weight_transfer.device)},
        "weight_transfer_config": {"backend": "nccl"} if app.weight_transfer.supported else None,
    }
    if query.get("config_format", "text") == "json":
        return 200, {"vllm_config": config, "server": "asyncgrpo-embedded"}
    return 200, {"vllm_config": json.dumps(config), "server": "asyncgrpo-embedded"}


ROUTES: dict[tuple[str, str], Route] = {
    ("GET", "/health"): health,
    ("GET", "/v1/models"): models,
    ("POST", "/v1/completions"): completions,
    ("POST", "/inference/v1/generate"): generate,
    ("GET", "/metrics"): metrics,
    ("POST", "/pause"): pause,
    ("POST", "/resume"): resume,
    ("GET", "/is_paused"): is_paused,
    ("POST", "/collective_rpc"): collective_rpc,
    ("POST", "/reset_prefix_cache"): reset_prefix_cache,
    ("POST", "/update_weight_version"): update_weight_version,
    ("GET", "/weight_info"): weight_info,
    ("GET", "/get_world_size"): world_size,
    ("GET", "/server_info"): server_info,
    **weight_transfer.ROUTES,
    **lora.ROUTES,
}


def bind(host: str, port: int) -> EmbeddedHTTPServer:
    """Bind the listening socket for ``ROUTES`` (port 0 picks a free one); a taken port raises ``PortInUseError``.

    In-process use: ``server = bind(host, 0); server.app = app; server.start()``, then ``server.stop()``.
    """
    return http_server.bind(host, port, ROUTES)


# -- startup ----------------------------------------------------------------------------------------------------
def build_app(model_dir: str, cfg: EmbeddedServerConfig, served_model_name: str | None = None) -> EmbeddedApp:
    """Load the model and tokenizer and start the engine thread."""
    from transformers import AutoTokenizer

    from asyncgrpo_cli.embedded.model import eos_token_ids, load_model, sampling_defaults

    if cfg.kv_cache_tokens < cfg.max_model_len:
        raise UserError(
            f"server.embedded.kv_cache_tokens ({cfg.kv_cache_tokens}) must hold at least one "
            f"server.embedded.max_model_len ({cfg.max_model_len}) sequence; raise kv_cache_tokens."
        )
    model = load_model(model_dir, cfg.dtype, serving_device(cfg.device))
    max_pos = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if max_pos is not None and cfg.max_model_len > max_pos:
        raise UserError(
            f"server.embedded.max_model_len ({cfg.max_model_len}) exceeds the model's "
            f"max_position_embeddings ({max_pos}); lower server.embedded.max_model_len."
        )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = GenerationEngine(
        model,
        eos_token_ids=eos_token_ids(model, tokenizer, model_dir),
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        kv_cache_tokens=cfg.kv_cache_tokens,
        prefix_cache_size=cfg.prefix_cache_size,
    ).start()
    ctx = ModelContext(
        served_name=served_model_name or model_dir,
        tokenizer=tokenizer,
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        max_model_len=cfg.max_model_len,
        defaults=sampling_defaults(model_dir),
    )
    adapters = lora.AdapterSet(model, ctx.served_name) if cfg.enable_lora else None
    return EmbeddedApp(
        engine=engine, ctx=ctx, model_dir=model_dir, cfg=cfg, dtype_name=str(model.dtype), adapters=adapters
    )


def serving_device(name: str):
    """``server.embedded.device`` as a torch device (made current on CUDA); a clear error when unusable."""
    import torch

    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"server.embedded.device ({name!r}) is not a device: use cpu or cuda:N") from None
    if device.type == "cuda":
        if device.index is None or not 0 <= device.index < torch.cuda.device_count():
            raise UserError(
                f"server.embedded.device={name}: this host has {torch.cuda.device_count()} CUDA device(s); "
                "name one as cuda:N (another GPU than the trainer's), or use cpu"
            )
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        raise UserError(f"server.embedded.device ({name!r}) must be cpu or cuda:N")
    return device


def default_num_threads() -> int:
    """Half the cores this process may run on (at least 1): the trainer shares the machine."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 2
    return max(1, cores // 2)


def write_ready_file(path: str | Path, port: int) -> None:
    """Write ``{"port", "pid"}`` atomically (a temporary file renamed over the target)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"port": port, "pid": os.getpid()}))
    os.replace(tmp, path)


def run_server(
    model_dir: str | Path,
    cfg: EmbeddedServerConfig,
    served_model_name: str | None = None,
    ready_file: str | Path | None = None,
) -> None:
    """Serve until SIGTERM / Ctrl-C. Binds first (a busy port fails fast), then loads the model."""
    import torch

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(cfg.num_threads or default_num_threads())
    server = bind(cfg.host, cfg.port)
    stop = threading.Event()
    previous = _install_signal_handlers(stop)
    try:
        app = build_app(str(model_dir), cfg, served_model_name)
        server.app = app
        server.start()
        port = server.port
        log.info(
            "embedded server: %s as %r on http://%s:%d (%d torch threads)",
            model_dir,
            app.ctx.served_name,
            cfg.host,
            port,
            torch.get_num_threads(),
        )
        if torch.get_num_threads() > 1 and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
            log.warning(
                "OMP_WAIT_POLICY is not PASSIVE: if other processes share these cores, generation can be "
                "10x slower; export OMP_WAIT_POLICY=PASSIVE before starting the server"
            )
        if ready_file:
            write_ready_file(ready_file, port)
        while not stop.wait(0.5) and server.is_alive():
            pass
        log.info("embedded server: stopping")
        app.stopping.set()  # requests waiting on the engine answer 503 within a second
        server.stop()
        app.engine.shutdown()
    finally:
        server.stop()
        _restore_signal_handlers(previous)


def _install_signal_handlers(stop: threading.Event) -> dict[int, Any]:
    previous: dict[int, Any] = {}
    if threading.current_thread() is not threading.main_thread():
        return previous
    for sig in (signal.SIGTERM, signal.SIGINT):
        previous[sig] = signal.signal(sig, lambda *_: stop.set())
    return previous


def _restore_signal_handlers(previous: dict[int, Any]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)
