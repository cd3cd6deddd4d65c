"""LoRA adapters on the embedded server: vLLM's runtime-loading routes, and each request served with its adapter.

Routes (``--enable-lora``; vLLM needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` too), with vLLM's shapes:

- ``POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace": false}`` -> 200, plain text
  ``Success: LoRA adapter 'X' added successfully.``; 400 ``InvalidUserInput`` for a name already loaded (unless
  ``load_inplace``) or the base model's name; 404 ``NotFoundError`` for a path without an adapter; 400 for an
  adapter the server cannot apply (DoRA, trained biases, ``modules_to_save``, unknown modules, bad shapes);
- ``POST /v1/unload_lora_adapter {"lora_name"}`` -> 200 ``Success: LoRA adapter 'X' removed successfully.``;
  404 ``NotFoundError`` for an unknown name;
- a completion whose ``model`` is an adapter's name is served with that adapter, and answers under that name;
  ``/v1/models`` lists adapters with ``parent`` = the base model, ``root`` = their path.

How a batch mixes adapters: each loaded adapter keeps its low-rank factors per adapted ``nn.Linear`` (``A`` [r,
in], ``B`` [out, r], ``scaling``). Forward hooks on those modules add ``scaling * B(A(x))`` to the rows of the batch
that belong to the adapter (rows grouped by adapter inside the hook; base-model rows untouched), so one forward
serves base and several adapters at once, as vLLM's LoRA kernels do, and the adapter is exactly PEFT's
``base(x) + lora_B(lora_A(x)) * scaling``. The engine says which adapter each row has (``lora_batch``). Rows in
flight hold their adapter object, so unloading (or reloading in place) never changes a request mid-generation;
the prefix cache keys on the adapter object too, so KV never crosses adapters.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncgrpo_cli.embedded.api import ApiError, ModelContext

log = logging.getLogger("asyncgrpo.server")

SAVED_PREFIX = "base_model.model."
MAX_LORA_RANK = 512


@dataclass(eq=False)
class LoadedAdapter:
    """One adapter on the server; compared by identity (a reload in place is a new object)."""

    name: str
    path: str
    lora_int_id: int
    rank: int
    weights: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = field(repr=False)
    """Module name -> (A [r, in], B [out, r], scaling)."""
    requests: int = 0
    """Generation requests served under this adapter (logged when it is unloaded)."""


def _api_error(
    message: str, status: int = 400, err_type: str = "BadRequestError", param: str | None = None
) -> ApiError:
    return ApiError(message, status, err_type, param)


def _not_found(name: str, path: str) -> ApiError:
    return _api_error(f"Loading lora {name} failed: No adapter found for {path}", 404, "NotFoundError")


def read_adapter(model: torch.nn.Module, name: str, path: str) -> tuple[int, dict[str, Any]]:
    """(rank, weights) of the PEFT adapter at ``path``, validated against ``model``; ``ApiError`` otherwise."""
    from safetensors.torch import load_file

    root = Path(path)
    config_file, weights_file = root / "adapter_config.json", root / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise _not_found(name, path)
    try:
        config = json.loads(config_file.read_text())
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (ValueError, KeyError, TypeError) as e:
        raise _api_error(
            f"Loading lora {name} failed: bad adapter_config.json ({e!r}).", param="lora_path"
        ) from None
    unsupported = {
        "use_dora": False,
        "bias": "none",
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    for key, neutral in unsupported.items():
        value = config.get(key)
        if value not in (neutral, None, {}, []):
            raise _api_error(
                f"Loading lora {name} failed: {key}={value!r} is not supported by the embedded server.",
                param="lora_path",
            )
    if rank > MAX_LORA_RANK:
        raise _api_error(
            f"LoRA rank {rank} is greater than max_lora_rank {MAX_LORA_RANK}.", param="lora_path"
        )
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    modules = dict(model.named_modules())
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        short = key.removeprefix(SAVED_PREFIX)
        for kind in ("lora_A", "lora_B"):
            if short.endswith(f".{kind}.weight"):
                parts.setdefault(short[: -len(f".{kind}.weight")], {})[kind] = tensor
                break
        else:
            raise _api_error(f"Loading lora {name} failed: unexpected tensor {key!r}.", param="lora_path")
    weights: dict[str, Any] = {}
    for module_name, ab in parts.items():
        module = modules.get(module_name)
        a, b = ab.get("lora_A"), ab.get("lora_B")
        if not isinstance(module, torch.nn.Linear) or module is model.get_output_embeddings():
            raise _api_error(
                f"Loading lora {name} failed: {module_name!r} is not a linear layer of the model.",
                param="lora_path",
            )
        if (
            a is None
            or b is None
            or a.shape != (rank, module.in_features)
            or b.shape != (module.out_features, rank)
        ):
            raise _api_error(
                f"Loading lora {name} failed: {module_name} needs lora_A [{rank}, {module.in_features}] "
                f"and lora_B [{module.out_features}, {rank}].",
                param="lora_path",
            )
        like = module.weight  # the served dtype and device
        weights[module_name] = (a.to(like.device, like.dtype), b.to(like.device, like.dtype), scaling)
    return rank, weights


class _RowHooks:
    """Forward hooks adding each row's adapter to the outputs of the model's linear layers (see the module doc)."""

    def __init__(self, model: torch.nn.Module):
        head = model.get_output_embeddings()
        self.groups: list[tuple[LoadedAdapter, torch.Tensor | None]] | None = None
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and module is not head:
                module.register_forward_hook(self._hook(name))

    def _hook(self, name: str) -> Any:
        def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
            if self.groups is None:
                return None
            x = args[0]
            for adapter, rows in self.groups:
                w = adapter.weights.get(name)
                if w is None:
                    continue
                a, b, scaling = w
                xs = x if rows is None else x.index_select(0, rows)
                delta = (xs.to(a.dtype) @ a.T @ b.T * scaling).to(output.dtype)
                output = output + delta if rows is None else output.index_add(0, rows, delta)
            return output

        return hook


@contextmanager
def lora_batch(model: torch.nn.Module, adapters: Sequence[LoadedAdapter | None]) -> Iterator[None]:
    """Run the model's next forwards with ``adapters[i]`` applied to batch row ``i`` (None: the base model)."""
    hooks: _RowHooks | None = getattr(model, "_asyncgrpo_lora_hooks", None)
    if hooks is None or all(a is None for a in adapters):
        yield
        return
    rows: dict[int, tuple[LoadedAdapter, list[int]]] = {}
    for i, adapter in enumerate(adapters):
        if adapter is not None:
            rows.setdefault(id(adapter), (adapter, []))[1].append(i)
    device = next(model.parameters()).device
    hooks.groups = [
        (adapter, None if len(idx) == len(adapters) else torch.tensor(idx, dtype=torch.int64, device=device))
        for adapter, idx in rows.values()
    ]
    try:
        yield
    finally:
        hooks.groups = None


class AdapterSet:
    """The loaded adapters by name, and the routes' logic (thread-safe: request threads call it)."""

    def __init__(self, model: torch.nn.Module, base_name: str):
        self.model = model
        self.base_name = base_name
        self._lock = threading.Lock()
        self._by_name: dict[str, LoadedAdapter] = {}
        self._ids = itertools.count(1)
        model._asyncgrpo_lora_hooks = _RowHooks(model)  # type: ignore[attr-defined]

    def get(self, name: str | None) -> LoadedAdapter | None:
        with self._lock:
            return self._by_name.get(name) if name is not None else None

    def load(self, req: Any) -> str:
        name, path, inplace = (
            _field(req, "lora_name"),
            _field(req, "lora_path"),
            bool(req.get("load_inplace")),
        )
        if not name or not path:
            raise _api_error("Both 'lora_name' and 'lora_path' must be provided.", 400, "InvalidUserInput")
        if name == self.base_name:
            raise _api_error(
                f"The lora adapter '{name}' conflicts with a served base model.", 400, "InvalidUserInput"
            )
        with self._lock:
            if name in self._by_name and not inplace:
                raise _api_error(
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                    "in place, set 'load_inplace' to True.",
                    400,
                    "InvalidUserInput",
                )
        rank, weights = read_adapter(self.model, name, path)  # outside the lock: reads files
        with self._lock:
            previous = self._by_name.get(name)
            lora_id = previous.lora_int_id if previous is not None else next(self._ids)
            self._by_name[name] = LoadedAdapter(name, path, lora_id, rank, weights)
        log.info("loaded LoRA adapter %r from %s (rank %d, %d modules)", name, path, rank, len(weights))
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, req: Any) -> str:
        name = _field(req, "lora_name")
        if not name:
            raise _api_error(
                "'lora_name' needs to be provided to unload a LoRA adapter.", 400, "InvalidUserInput"
            )
        with self._lock:
            adapter = self._by_name.pop(name, None)
        if adapter is None:
            raise _api_error(f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError")
        log.info("unloaded LoRA adapter %r (served %d requests)", name, adapter.requests)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def for_request(self, req: Any, ctx: ModelContext) -> tuple[ModelContext, LoadedAdapter | None]:
        """The request's context (answering under the adapter's name) and adapter, when ``model`` names one."""
        name = req.get("model") if isinstance(req, dict) else None
        with self._lock:
            adapter = self._by_name.get(name) if isinstance(name, str) else None
            if adapter is None:
                return ctx, None
            adapter.requests += 1
        return dataclasses.replace(ctx, served_name=adapter.name), adapter

    def cards(self) -> list[dict[str, Any]]:
        """``/v1/models`` cards of the adapters, as vLLM lists them."""
        with self._lock:
            adapters = list(self._by_name.values())
        return [
            {
                "id": a.name,
                "object": "model",
                "created": int(time.time()),
                "owned_by": "asyncgrpo",
                "root": a.path,
                "parent": self.base_name,
                "max_model_len": None,
                "permission": [],
            }
            for a in adapters
        ]

    def server_config(self) -> dict[str, Any]:
        """``lora_config`` of ``/server_info``, vLLM's keys."""
        return {
            "max_lora_rank": MAX_LORA_RANK,
            "max_loras": None,  # no limit: every row of a batch may carry its own adapter
            "max_cpu_loras": None,
            "target_modules": None,
            "fully_sharded_loras": False,
        }


def _field(req: Any, key: str) -> str | None:
    if not isinstance(req, dict):
        raise _api_error("the request body must be a JSON object.")
    value = req.get(key)
    if value is not None and not isinstance(value, str):
        raise _api_error(f"{key} must be a string, got {value!r}.", param=key)
    return value


# -- routes (merged into the embedded server's table, app.ROUTES) -------------------------------------------------
def for_request(app: Any, req: Any) -> tuple[ModelContext, LoadedAdapter | None]:
    """The model context and adapter of a generation request (``app.adapters`` is None without --enable-lora)."""
    if app.adapters is None:
        return app.ctx, None
    return app.adapters.for_request(req, app.ctx)


def _enabled(app: Any) -> AdapterSet:
    if app.adapters is None:  # vLLM has no such route without runtime LoRA updating
        raise _api_error(
            "Not Found: LoRA serving is off (start the embedded server with --enable-lora)",
            404,
            "NotFoundError",
        )
    return app.adapters


def _body(body: bytes) -> Any:
    try:
        return json.loads(body) if body else {}
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _api_error(f"the request body is not valid JSON: {e}") from None


def load_lora_adapter(app: Any, query: dict[str, str], body: bytes) -> tuple[int, str]:
    return 200, _enabled(app).load(_body(body))


def unload_lora_adapter(app: Any, query: dict[str, str], body: bytes) -> tuple[int, str]:
    return 200, _enabled(app).unload(_body(body))


ROUTES = {
    ("POST", "/v1/load_lora_adapter"): load_lora_adapter,
    ("POST", "/v1/unload_lora_adapter"): unload_lora_adapter,
}
