"""The startup probe: does the generation server have every capability this run needs? Ask it, before training.

``read_server`` asks the server, without changing its state (no pause, no generation): ``/v1/models`` (served
names, ``max_model_len``), ``GET /is_paused`` (the dev routes exist: ``VLLM_SERVER_DEV_MODE=1``),
``/server_info?config_format=json`` (logprobs mode, ``--max-logprobs``, dtype, device, worker extension,
weight-transfer backend, ``--return-sampling-mask``), ``/version``, and ``POST /inference/v1/generate`` with an
empty body, which vLLM rejects without generating: 403 without ``--enable-scale-out``, 404 before the route
existed, a validation error (400 / 422) when it is served. ``find_problems`` compares that report with the
config, on plain data (sampling-mask findings: ``server/mask_support.py``). ``probe_server`` does both and raises one ``UserError`` listing every problem with its fix, and, for a vLLM
server, the exact ``vllm serve`` command that fixes them all. ``asyncgrpo check --probe-server`` and ``train``
(right after the server is up) run it. Every request has a timeout; a server that answers garbage is an error.
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from asyncgrpo_cli.config.schema import RootConfig, VllmLaunchConfig
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.server.control import ServerControl
from asyncgrpo_cli.sync.lora_policy import ServerLora, lora_problems
from asyncgrpo_cli.vllm_ext import EXTENSION_CLS

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 30.0
GENERATE_ROUTE = "/inference/v1/generate"
PROCESSED = "processed_logprobs"


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


# -- asking the server ------------------------------------------------------------------------------------------
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


# -- comparing with the config ----------------------------------------------------------------------------------
def find_problems(report: ServerReport, cfg: RootConfig, prompt_tokens: int | None = None) -> list[Problem]:
    """Every capability the run needs that the server lacks. ``prompt_tokens``: the longest prompt, when known."""
    s, sv = cfg.sampling, cfg.server
    launch = sv.backend == "vllm_launch"
    out: list[Problem] = []
    name = cfg.model.served_model_name
    if name and name not in report.model_ids:
        out.append(
            Problem(
                f"model.served_model_name={name!r} is not served (the server lists {report.model_ids})",
                ["--served-model-name", name],
            )
        )
    if not report.dev_routes:
        out.append(
            Problem(
                "the weight-update routes (/pause, /resume, /collective_rpc, /is_paused) do not exist: the server "
                "was started without VLLM_SERVER_DEV_MODE=1",
            )
        )
    if report.logprobs_mode is not None and report.logprobs_mode != PROCESSED:
        out.append(
            Problem(
                f"--logprobs-mode is {report.logprobs_mode}: the sampler's log-probs must be those of the "
                "distribution it sampled from",
                ["--logprobs-mode", PROCESSED],
            )
        )
    need_lp = s.num_sampler_logprobs
    if report.max_logprobs is not None and report.max_logprobs != -1 and report.max_logprobs < need_lp:
        out.append(
            Problem(
                f"--max-logprobs is {report.max_logprobs}, below sampling.num_sampler_logprobs={need_lp}",
                ["--max-logprobs", str(need_lp)],
                f"server.vllm_launch.max_logprobs={need_lp}" if launch else None,
            )
        )
    need_len = (prompt_tokens or 1) + s.max_completion_length
    if report.max_model_len is not None and report.max_model_len < need_len:
        prompt = f"the longest prompt ({prompt_tokens})" if prompt_tokens else "a prompt"
        out.append(
            Problem(
                f"max_model_len is {report.max_model_len}: too short for {prompt} plus "
                f"sampling.max_completion_length={s.max_completion_length}",
                ["--max-model-len", str(need_len)],
                _len_fix(sv.backend, need_len, s.max_completion_length),
            )
        )
    if report.is_cpu_vllm and s.seed_per_request:
        out.append(
            Problem(
                "sampling.seed_per_request=true: vLLM's CPU build kills its engine on per-request seeds under "
                "concurrent load ('CPU Generator does not use offset')",
                config_fix="sampling.seed_per_request=false",
            )
        )
    if report.is_cpu_vllm and sv.weight_sync == "disk" and not report.has_extension:
        out.append(
            Problem(
                "disk weight sync on vLLM's CPU build needs asyncgrpo's worker extension: plain reload_weights "
                "leaves a tied lm_head serving the old weights",
                ["--worker-extension-cls", EXTENSION_CLS],
            )
        )
    from asyncgrpo_cli.server.mask_support import mask_problems

    out += mask_problems(report, cfg)
    out += lora_problems(report, cfg)
    if sv.weight_sync == "nccl" and not report.embedded:
        if report.is_cpu_vllm:
            out.append(
                Problem(
                    "server.weight_sync=nccl cannot run on vLLM's CPU build",
                    config_fix="server.weight_sync=disk",
                )
            )
        elif report.dev_routes and report.device is not None and report.weight_transfer_backend != "nccl":
            out.append(
                Problem(
                    "server.weight_sync=nccl needs the server's NCCL weight-transfer engine",
                    ["--weight-transfer-config", '{"backend": "nccl"}'],
                )
            )
    if sv.weight_sync == "nccl" and report.embedded and report.weight_transfer_backend != "nccl":
        out.append(
            Problem(
                f"server.weight_sync=nccl needs the embedded server on a GPU; it runs on {report.device or 'cpu'}",
                config_fix="server.embedded.device=cuda:N (another GPU than the trainer's)",
            )
        )
    return out


def _len_fix(backend: str, need_len: int, completion: int) -> str:
    if backend == "embedded":
        return (
            f"server.embedded.max_model_len={need_len} (or lower sampling.max_completion_length={completion})"
        )
    if backend == "vllm_launch":
        return f"server.vllm_launch.max_model_len={need_len} (or lower sampling.max_completion_length)"
    return f"or lower sampling.max_completion_length={completion}"


def fix_command(report: ServerReport, cfg: RootConfig, model_path: str | None = None) -> str:
    """The ``vllm serve`` command line that gives the server every capability the run needs."""
    from asyncgrpo_cli.server.vllm_launch import (
        CPU_SERVER_MODULE,
        LORA_ENV,
        extension_pythonpath,
        serve_flags,
    )

    s = cfg.sampling
    need_len = max(report.max_model_len or 0, s.max_completion_length + 1)
    need_lp = -1 if report.max_logprobs == -1 else max(report.max_logprobs or 0, s.num_sampler_logprobs, 20)
    base = cfg.server.vllm_launch if cfg.server.backend == "vllm_launch" else VllmLaunchConfig()
    launch = replace(
        base,
        max_model_len=need_len,
        max_logprobs=need_lp,
        dtype=report.dtype or cfg.model.dtype,
        gpus=[] if report.is_cpu_vllm else base.gpus,
    )
    if cfg.server.weight_sync != "nccl" and cfg.server.backend != "vllm_launch":
        launch = replace(launch, weight_transfer_backend=None)
    name = cfg.model.served_model_name or (report.model_ids[0] if report.model_ids else None)
    model = report.model or model_path or cfg.model.name_or_path
    if name == model:
        name = None
    from asyncgrpo_cli.server.mask_support import suggest_mask_flags

    lora = cfg.server.weight_sync == "lora"
    if lora:  # the limits adapter sync needs (derived by config validation when left null)
        need = cfg.server.vllm_launch
        launch = replace(launch, max_lora_rank=need.max_lora_rank, max_loras=need.max_loras)
    flags = serve_flags(
        launch,
        served_model_name=name,
        cpu=report.is_cpu_vllm,
        sampling_mask=suggest_mask_flags(report, cfg),
        lora=lora,
    )
    env = f"VLLM_SERVER_DEV_MODE=1 PYTHONPATH={shlex.quote(str(extension_pythonpath()))}"
    if lora:
        env += "".join(f" {k}={v}" for k, v in LORA_ENV.items())
    if report.is_cpu_vllm:
        head = ["python", "-m", CPU_SERVER_MODULE, "--model", model]
    else:
        head = ["vllm", "serve", model]
    return f"{env} {shlex.join(head + flags)}"


def probe_server(
    control: ServerControl,
    cfg: RootConfig,
    *,
    model_path: str | None = None,
    prompt_tokens: int | None = None,
) -> ServerReport:
    """Check the server against the run's needs; raise one ``UserError`` naming every gap and the fix."""
    report = read_server(control)
    problems = find_problems(report, cfg, prompt_tokens)
    if not problems:
        log.info(
            "server probe OK: %s serves %s (vLLM %s, %s, max_model_len %s, max_logprobs %s, worker extension %s, "
            "sampling masks %s)",
            report.base_url,
            report.model_ids[0],
            report.version or "-",
            "embedded" if report.embedded else (report.device or "?"),
            report.max_model_len,
            report.max_logprobs,
            "yes" if report.has_extension else "no",
            "yes" if report.returns_sampling_mask else "no",
        )
        return report
    lines = [f"the generation server at {report.base_url} cannot run this config:"]
    for p in problems:
        fix = p.config_fix or (shlex.join(p.flags) if p.flags else None)
        lines.append(f"  - {p.what}" + (f" (fix: {fix})" if fix else ""))
    server_side = [p for p in problems if p.config_fix is None]
    if server_side and report.embedded:
        lines.append(
            "The embedded server is configured under server.embedded (asyncgrpo check --explain server)."
        )
    elif server_side and cfg.server.backend == "vllm_launch":
        lines.append(
            "server=vllm_launch passes these flags itself: server.vllm_launch.extra_args or env override one. "
            "A command that works:"
        )
        lines.append(f"  {fix_command(report, cfg, model_path)}")
    elif server_side:
        lines.append("Restart vLLM with (every fix applied):")
        lines.append(f"  {fix_command(report, cfg, model_path)}")
    raise UserError("\n".join(lines))
