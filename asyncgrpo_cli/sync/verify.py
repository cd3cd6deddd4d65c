"""Weight-sync correctness check: after a sync, do the server's log-probs equal the trainer's?

A sync can "succeed" without taking: the server reloads another directory, a CPU vLLM keeps its tied ``lm_head``
pre-packed from the old weights, an adapter is never delivered. Rollouts then come from a policy the trainer
does not have, and nothing fails. This check makes that loud, cheaply: the server continues a fixed probe text
(``PROBE_NEW_TOKENS`` tokens sampled at temperature 1 with nothing truncated: top_k = the vocabulary size,
top_p 1, min_p 0, neutral penalties; the processed log-probs of such a request are the raw log-softmax, on every
``--logprobs-mode``), the trainer scores the same tokens with its own forward, and the mean absolute gap is logged as ``sync/logprob_gap`` (max: ``sync/logprob_gap_max``).
Above the tolerance (``server.verify_sync_tolerance``, default by the coarser of the trainer's and the server's
dtype) it raises :class:`WeightSyncMismatchError` naming the version, the gap and what to check.

What it can see: a sync that did not take shows once the trained policy has moved further from what the server
serves than the dtype's noise; in float32 that is after the first step or so, in bfloat16 it may take several
steps at a small learning rate. The request works on the embedded server and on vLLM alike (also with
``--return-sampling-mask``, which refuses greedy requests).

With several trainer ranks, rank 0 asks the server and broadcasts the tokens; every rank runs the (sharded)
forward; rank 0's verdict is broadcast so every rank raises together.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from asyncgrpo_cli.config.schema import ServerConfig
from asyncgrpo_cli.server.control import ServerControl, ServerControlError

if TYPE_CHECKING:
    from asyncgrpo_cli.protocols import WeightSync

PROBE_TEXT = (
    "Question: a farmer has 12 apples and gives 5 to a friend. How many apples are left?\n"
    "Answer: 12 - 5 = 7, so the farmer has"
)
"""The fixed probe prompt (tokenized with the run's tokenizer, without special tokens)."""
PROBE_MAX_PROMPT_TOKENS = 48
PROBE_NEW_TOKENS = 16
TOLERANCES = {"float32": 1e-3, "float16": 2e-2, "bfloat16": 5e-2}
"""Mean |log-prob gap| (nats) allowed by dtype; the coarser of the trainer's and the server's applies."""
_DTYPE_NAMES = {
    "fp32": "float32",
    "float": "float32",
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
}


class WeightSyncMismatchError(RuntimeError):
    """The server's log-probs after a sync differ from the trainer's: the sync did not take."""


@dataclass
class ServerScore:
    """The server's continuation of the probe: all token ids and the continuation's log-probs."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]


def dtype_name(dtype: Any) -> str | None:
    """``torch.bfloat16`` / ``"torch.bfloat16"`` / ``"bf16"`` -> ``"bfloat16"``; None when unknown."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.").lower()
    name = _DTYPE_NAMES.get(name, name)
    return name if name in TOLERANCES else None


def default_tolerance(*dtypes: Any) -> tuple[float, str]:
    """The tolerance of the coarsest known dtype among ``dtypes`` (float32 when none is known), and its name."""
    names = [n for n in (dtype_name(d) for d in dtypes) if n is not None] or ["float32"]
    worst = max(names, key=TOLERANCES.__getitem__)
    return TOLERANCES[worst], worst


def probe_prompt_ids(tokenizer: Any) -> list[int]:
    ids = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])[:PROBE_MAX_PROMPT_TOKENS]
    if not ids:
        raise ValueError("the tokenizer turned the weight-sync probe text into no tokens")
    return ids


def server_score(
    client: httpx.Client,
    model: str,
    prompt_ids: list[int],
    max_tokens: int = PROBE_NEW_TOKENS,
    *,
    vocab_size: int | None = None,
) -> ServerScore:
    """A sampled continuation (temperature 1) with its tokens' log-probs; neutral penalties so no server default
    applies. ``top_k`` = the vocabulary size truncates nothing yet is a request vLLM with
    ``--return-sampling-mask`` accepts (it refuses greedy requests and top_k 0); the trainer scores the same tokens
    at temperature 1."""
    from asyncgrpo_cli.rollout.client import parse_choice

    payload = {
        "model": model,
        "prompt": list(prompt_ids),
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "top_p": 1.0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "logprobs": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "n": 1,
    }
    if vocab_size:
        payload["top_k"] = vocab_size
    try:
        resp = client.post("/v1/completions", json=payload)
    except httpx.HTTPError as e:
        raise ServerControlError(
            f"POST {client.base_url}/v1/completions (weight-sync probe) failed: {type(e).__name__}: {e}"
        ) from e
    if resp.status_code != 200:
        raise ServerControlError(
            f"POST {client.base_url}/v1/completions (weight-sync probe) answered HTTP {resp.status_code}: "
            f"{resp.text[:500]}"
        )
    choices = resp.json().get("choices") or []
    if not choices:
        raise ServerControlError(f"the weight-sync probe got no choices: {resp.text[:300]}")
    turn = parse_choice(prompt_ids, choices[0], want_topk=False)
    if not turn.output_ids:
        raise ServerControlError("the weight-sync probe got an empty completion")
    return ServerScore(list(prompt_ids), turn.output_ids, turn.output_log_probs)


def _vocab_size(model: Any) -> int | None:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return int(head.weight.shape[0]) if head is not None and hasattr(head, "weight") else None


def trainer_logprobs(model: Any, prompt_ids: list[int], output_ids: list[int]) -> list[float]:
    """The trainer's log-probs of ``output_ids`` after ``prompt_ids`` (one forward, no grad, eval mode)."""
    import torch

    ids = list(prompt_ids) + list(output_ids)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids], device=device), use_cache=False).logits[0]
    finally:
        model.train(was_training)
    start = len(prompt_ids) - 1
    lp = torch.log_softmax(logits[start : start + len(output_ids)].float(), dim=-1)
    target = torch.tensor(output_ids, device=lp.device)[:, None]
    return lp.gather(-1, target).squeeze(-1).tolist()


def _world() -> tuple[int, int]:
    """(rank, world size) of an initialized process group, else (0, 1)."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return 0, 1
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _broadcast(obj: Any, world: int) -> Any:
    if world <= 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class SyncVerifier:
    """Compares the server with the trainer after each sync. Rank 0 holds ``control``; other ranks pass None."""

    def __init__(
        self,
        control: ServerControl | None,
        tokenizer: Any,
        *,
        tolerance: float | None = None,
        compute_dtype: str | None = None,
        sync_dir: str | None = None,
    ):
        self.control = control
        self.tokenizer = tokenizer
        self.tolerance = tolerance
        self.compute_dtype = compute_dtype
        self.sync_dir = sync_dir
        self._prompt_ids: list[int] | None = None
        self._model_name: str | None = None
        self._server_dtype: str | None = None
        self._client: httpx.Client | None = None

    def _setup(self) -> None:
        if self._client is not None or self.control is None:
            return
        from asyncgrpo_cli.server.report import server_config

        self._model_name = self.control.info().model_id
        dtype = server_config(self.control).get("model_config", {}).get("dtype")
        self._server_dtype = dtype_name(dtype)
        self._client = httpx.Client(
            base_url=self.control.base_url, timeout=httpx.Timeout(self.control.timeout, connect=10.0)
        )

    def check(self, model: Any, version: int, served_name: str | None = None) -> dict[str, float]:
        """Score the probe on the server (under ``served_name``, e.g. the version's LoRA adapter; default: the
        served model) and in ``model``; raise when the gap is above the tolerance."""
        t0 = time.monotonic()
        rank, world = _world()
        score = None
        if rank == 0:
            if self.control is None:
                raise ValueError("SyncVerifier on rank 0 needs the server control")
            self._setup()
            if self._prompt_ids is None:
                self._prompt_ids = probe_prompt_ids(self.tokenizer)
            assert self._client is not None and self._model_name is not None
            score = server_score(
                self._client, served_name or self._model_name, self._prompt_ids, vocab_size=_vocab_size(model)
            )
        score = _broadcast(score, world)
        mine = trainer_logprobs(model, score.prompt_ids, score.output_ids)
        verdict: tuple[str | None, dict[str, float]] = (None, {})
        if rank == 0:
            verdict = self._judge(model, version, score, mine, served_name)
        message, metrics = _broadcast(verdict, world)
        if message is not None:
            raise WeightSyncMismatchError(message)
        if rank == 0:
            metrics["perf/weight_sync_verify_s"] = time.monotonic() - t0
        return metrics

    def _judge(
        self, model: Any, version: int, score: ServerScore, mine: list[float], served_name: str | None = None
    ) -> tuple[str | None, dict[str, float]]:
        gaps = [abs(a - b) for a, b in zip(score.logprobs, mine)]
        gap, worst = sum(gaps) / len(gaps), max(gaps)
        trainer_dtype = self.compute_dtype or next(model.parameters()).dtype
        if self.tolerance is not None:
            tol, tol_from = self.tolerance, "server.verify_sync_tolerance"
        else:
            tol, name = default_tolerance(trainer_dtype, self._server_dtype)
            tol_from = f"the {name} default"
        metrics = {"sync/logprob_gap": gap, "sync/logprob_gap_max": worst}
        if gap <= tol:
            return None, metrics
        where = f" ({self.sync_dir})" if self.sync_dir else ""
        message = (
            f"weight sync to version {version} did not take: on a fixed probe ({len(gaps)} sampled tokens) the "
            f"server's log-probs differ from the trainer's by {gap:.3g} nats on average (max {worst:.3g}), above "
            f"the tolerance {tol:g} ({tol_from}; trainer {dtype_name(trainer_dtype) or trainer_dtype}, server "
            f"{self._server_dtype or 'dtype unknown'}). The server is not serving the trained weights"
            f"{f' under {served_name!r} (the LoRA adapter of this version)' if served_name else ''}. Check that "
            f"it reads server.weight_sync_dir{where} on the same filesystem, that a CPU vLLM runs with "
            "--worker-extension-cls asyncgrpo_cli.vllm_ext.WorkerExtension (its tied lm_head keeps the old "
            "weights otherwise), that its --dtype matches model.dtype, and that nothing else reloads it. Raise "
            "server.verify_sync_tolerance for a noisier setup; server.verify_sync=false turns the check off."
        )
        return message, metrics

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


_verifiers: weakref.WeakKeyDictionary[Any, SyncVerifier] = weakref.WeakKeyDictionary()


def verify_weight_sync(
    cfg: ServerConfig,
    weight_sync: WeightSync,
    model: Any,
    tokenizer: Any,
    version: int,
    *,
    compute_dtype: str | None = None,
) -> dict[str, float]:
    """The trainer's call after ``weight_sync.push(model, version)``: check the server serves ``model``.

    Every rank calls it (the forward may be sharded). Returns the metrics to log on rank 0 (``sync/logprob_gap``,
    ``sync/logprob_gap_max``, ``perf/weight_sync_verify_s``) and ``{}`` elsewhere; raises
    :class:`WeightSyncMismatchError` on every rank when the gap is above the tolerance. One verifier is kept
    per ``weight_sync`` object (it caches the probe tokens and the served model's name). A backend that serves
    each version under its own name (LoRA adapters) says which through ``weight_sync.served_name(version)``.
    """
    verifier = _verifiers.get(weight_sync)
    if verifier is None:
        directory = weight_sync.directory
        verifier = SyncVerifier(
            weight_sync.control,
            tokenizer,
            tolerance=cfg.verify_sync_tolerance,
            compute_dtype=compute_dtype,
            sync_dir=str(directory) if directory is not None else None,
        )
        _verifiers[weight_sync] = verifier
        weakref.finalize(weight_sync, verifier.close)
    return verifier.check(model, version, weight_sync.served_name(version))  # lora: the version's adapter
