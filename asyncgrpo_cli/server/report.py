"""What a generation server says about itself (``ServerReport``), asked without changing its state, and the
``Problem`` type every capability check returns.

``read_server`` asks: ``/v1/models`` (served names, ``max_model_len``), ``GET /is_paused`` (the dev routes exist:
``VLLM_SERVER_DEV_MODE=1``), ``/server_info?config_format=json`` (logprobs mode, ``--max-logprobs``, dtype, device,
worker extension, weight-transfer backend, ``--return-sampling-mask``), ``/version``, and
``POST /inference/v1/generate`` with an empty body, which vLLM rejects without generating: 403 without
``--enable-scale-out``, 404 before the route existed, a validation error (400 / 422) when it is served. No pause,
no generation. Every request has a timeout; a server that answers garbage is an error.

The checks sit beside it, one module per feature (``mask_support.py``, ``lora_support.py``) and the general ones
in ``probe.py``, which runs them all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import httpx

from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.server.control import ServerControl
from asyncgrpo_cli.sync.lora_policy import ServerLora
from asyncgrpo_cli.vllm_ext import EXTENSION_CLS

PROBE_TIMEOUT_S = 30.0
GENERATE_ROUTE = "/inference/v1/generate"


@dataclass
class ServerReport:
    """What the server says about itself; None where it does not say."""

    base_url: str
    model_ids: list[str]
    max_model_len: int | None
    dev_routes: bool
    """``GET /is_paused`` answered: the weight-update routes exist."""
    embedded: bool = False
    """The project's embedded server (its ``/server_info`` says so)."""
    model: str | None = None
    """The model path or id the server loaded."""
    logprobs_mode: str | None = None
    max_logprobs: int | None = None
    """``--max-logprobs``; -1 means no cap."""
    dtype: str | None = None
    """Serving dtype without the ``torch.`` prefix (``float32``, ``bfloat16``)."""
    device: str | None = None
    """``cpu``, ``cuda``, ...; None when the server does not say."""
    worker_extension: str | None = None
    weight_transfer_backend: str | None = None
    version: str | None = None
    lora: ServerLora | None = None
    """LoRA serving (``lora_config``: ``--enable-lora``, ``--max-lora-rank``, ``--max-loras``; data parallelism)."""
    lora_loading: bool | None = None
    """``/v1/load_lora_adapter`` exists (vLLM: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``); None: not asked."""
    api_server_count: int | None = None
    """``--api-server-count`` when ``/server_info`` says (``parallel_config._api_process_count``)."""
    return_sampling_mask: bool | None = None
    """``--return-sampling-mask`` (``model_config.return_sampling_mask``); the embedded server reports true."""
    generate_route: str | None = None
    """``POST /inference/v1/generate``: ``enabled``, ``disabled`` (403: no ``--enable-scale-out``), ``missing``
    (404 / 405: vLLM too old), None when the answer says neither (e.g. 401 behind an API key)."""

    @property
    def returns_sampling_mask(self) -> bool:
        """Each generated token's candidate set comes back (through ``/inference/v1/generate``)."""
        return self.generate_route == "enabled" and self.return_sampling_mask is True

    @property
    def is_cpu_vllm(self) -> bool:
        return not self.embedded and self.device == "cpu"

    @property
    def has_extension(self) -> bool:
        return self.worker_extension == EXTENSION_CLS


@dataclass
class Problem:
    """One missing capability: what is wrong, the ``vllm serve`` flags that fix it, or the config change."""

    what: str
    flags: list[str] = field(default_factory=list)
    config_fix: str | None = None


def _get(client: httpx.Client, path: str, params: dict[str, str] | None = None) -> httpx.Response:
    try:
        return client.get(path, params=params)
    except httpx.HTTPError as e:
        raise UserError(
            f"the generation server at {client.base_url} did not answer GET {path} within "
            f"{PROBE_TIMEOUT_S:g}s ({type(e).__name__}: {e}); is it running?"
        ) from e


def _json(resp: httpx.Response, what: str) -> Any:
    try:
        return resp.json()
    except ValueError:
        raise UserError(
            f"{resp.request.url} answered {resp.text[:200]!r}, which is not JSON ({what}): is "
            "server.base_url a vLLM server?"
        ) from None


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _int_or_none(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def read_server(control: ServerControl) -> ServerReport:
    """Ask the server what it can do. Raises ``UserError`` when it does not answer or answers garbage."""
    timeout = httpx.Timeout(min(control.timeout, PROBE_TIMEOUT_S), connect=10.0)
    with httpx.Client(base_url=control.base_url, timeout=timeout) as client:
        models = _json(_get(client, "/v1/models"), "the model list")
        try:
            cards = [c for c in models["data"] if isinstance(c, dict) and "id" in c]
        except (KeyError, TypeError):
            cards = []
        if not cards:
            raise UserError(
                f"{control.base_url}/v1/models answered {str(models)[:200]!r}, which is not an OpenAI-style "
                "model list: is server.base_url a vLLM server?"
            )
        report = ServerReport(
            base_url=control.base_url,
            model_ids=[str(c["id"]) for c in cards],
            max_model_len=_int_or_none(cards[0].get("max_model_len")),
            dev_routes=False,
        )
        paused = _get(client, "/is_paused")
        if paused.status_code == 200:
            if not isinstance(_json(paused, "GET /is_paused").get("is_paused"), bool):
                raise UserError(
                    f"{control.base_url}/is_paused answered {paused.text[:200]!r}: not vLLM's route"
                )
            report.dev_routes = True
        info = _get(client, "/server_info", {"config_format": "json"})
        if info.status_code == 200:
            _read_server_info(report, _json(info, "GET /server_info"))
        report.generate_route = _generate_route(client)
        report.lora_loading = _get(client, "/v1/load_lora_adapter").status_code == 405  # POST-only: it exists
        version = _get(client, "/version")
        if version.status_code == 200:
            data = _json(version, "GET /version")
            report.version = str(data.get("version")) if isinstance(data, dict) else None
    return report


def _generate_route(client: httpx.Client) -> str | None:
    """Whether ``POST /inference/v1/generate`` is served, from its answer to an empty body (nothing is generated)."""
    try:
        status = client.post(GENERATE_ROUTE, json={}).status_code
    except httpx.HTTPError as e:
        raise UserError(
            f"the generation server at {client.base_url} did not answer POST {GENERATE_ROUTE} within "
            f"{PROBE_TIMEOUT_S:g}s ({type(e).__name__}: {e}); is it running?"
        ) from e
    if status == 403:
        return "disabled"
    if status in (404, 405):
        return "missing"
    if status in (200, 400, 422):
        return "enabled"
    return None


def _read_server_info(report: ServerReport, data: Any) -> None:
    data = _mapping(data)
    config = data.get("vllm_config")
    if isinstance(config, str):  # config_format=text, or an older server
        return
    config = _mapping(config)
    model_config = _mapping(config.get("model_config"))
    parallel = _mapping(config.get("parallel_config"))
    report.embedded = data.get("server") == "asyncgrpo-embedded"
    report.model = model_config.get("model")
    report.logprobs_mode = model_config.get("logprobs_mode")
    report.max_logprobs = _int_or_none(model_config.get("max_logprobs"))
    report.max_model_len = _int_or_none(model_config.get("max_model_len")) or report.max_model_len
    dtype = model_config.get("dtype")
    report.dtype = str(dtype).removeprefix("torch.") if dtype else None
    device = _mapping(config.get("device_config")).get("device")
    report.device = str(device).split(":")[0] if device else None
    report.worker_extension = parallel.get("worker_extension_cls") or None
    mask = model_config.get("return_sampling_mask")
    report.return_sampling_mask = bool(mask) if mask is not None else None
    transfer = config.get("weight_transfer_config")
    report.weight_transfer_backend = _mapping(transfer).get("backend") if transfer else None
    report.lora = ServerLora.from_vllm_config(config)
    report.api_server_count = _int_or_none(parallel.get("_api_process_count"))


def server_config(control: ServerControl) -> dict[str, Any]:
    """The server's ``vllm_config`` from ``/server_info?config_format=json``; {} when it has no such route or
    answers something else (an external server without dev mode)."""
    try:
        with httpx.Client(base_url=control.base_url, timeout=min(control.timeout, PROBE_TIMEOUT_S)) as client:
            resp = client.get("/server_info", params={"config_format": "json"})
        if resp.status_code != 200:
            return {}
        return _mapping(_mapping(resp.json()).get("vllm_config"))
    except (httpx.HTTPError, ValueError):
        return {}


def has_worker_extension(control: ServerControl) -> bool:
    """True when the server was started with asyncgrpo's worker extension (``/server_info`` says so)."""
    parallel = _mapping(server_config(control).get("parallel_config"))
    return parallel.get("worker_extension_cls") == EXTENSION_CLS
