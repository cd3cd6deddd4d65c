"""Async client for the generation server, tokens in and out: ``/v1/completions`` (vLLM's OpenAI-compatible API)
and, for truncated sampling with candidate sets, ``/inference/v1/generate`` (``--enable-scale-out``).

Every request carries token ids, asks for the sampled token's log-prob plus the top-N (``logprobs: N``), with
``return_token_ids`` and ``return_tokens_as_token_ids`` so nothing is ever re-tokenized and top-logprob keys are
token ids (decoded-string keys collide for partial UTF-8 bytes). ``generate`` speaks vLLM's tokens-in/tokens-out
protocol instead (integer ids everywhere, vLLM ``SamplingParams`` names) and keeps each token's ``sampling_mask``
(the candidate set it was drawn from, ``--return-sampling-mask``) as compact ``CandidateSets``, capped at
``max_mask_candidates`` ids per token.

Failures, with exponential backoff capped at 16 s, every re-send counted in ``retry_count``
(``rollout/vllm_retry_count``):

- connection failures (refused, dropped, reset) mean the server may be down: they are retried until the time
  budget ``retry_budget_s`` (``server.timeout``) has passed since the first one, so a server that is restarted
  within it costs a pause, not the run. With a ``ServerLink`` the failure also marks the server lost, and every
  request (first send or retry) waits until the link is healthy again, i.e. until the trainer has pushed the
  weights to a restarted server (``asyncgrpo_cli.rollout.resync``);
- timeouts, 5xx, 408 and 429 (a live but struggling server) are retried ``max_retries`` times;
- any other 4xx is the user's configuration and stops the run with the server's message.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from asyncgrpo_cli.rollout.resync import ServerLink
from asyncgrpo_cli.rollout.served_name import request_model, retired_fallback
from asyncgrpo_cli.samples import CandidateSets, TurnRecord

MAX_BACKOFF_S = 16.0
GENERATE_ROUTE = "/inference/v1/generate"


class ServerRequestError(RuntimeError):
    """The server rejected a request (4xx: ``status``) or kept failing after every retry (``status`` None)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    num_logprobs: int = 0


def parse_token_key(key: str) -> int:
    """``"token_id:123"`` -> 123."""
    return int(key.rsplit(":", 1)[1])


def build_payload(model: str, prompt_ids: list[int], p: SamplingParams, seed: int | None) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt_ids),
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "n": 1,
        "logprobs": p.num_logprobs,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
    }
    return payload | optional_sampling_fields(p, seed)


def optional_sampling_fields(p: SamplingParams, seed: int | None) -> dict[str, Any]:
    """The filters, penalty and seed, sent only where they change vLLM's defaults."""
    fields: dict[str, Any] = {}
    if p.top_p < 1.0:
        fields["top_p"] = p.top_p
    if p.top_k > 0:
        fields["top_k"] = p.top_k
    if p.min_p > 0:
        fields["min_p"] = p.min_p
    if p.repetition_penalty != 1.0:
        fields["repetition_penalty"] = p.repetition_penalty
    if seed is not None:
        fields["seed"] = seed
    return fields


def parse_choice(prompt_ids: list[int], choice: dict[str, Any], want_topk: bool) -> TurnRecord:
    """Turn one ``choices[i]`` of a completions response into a ``TurnRecord``."""
    output_ids = choice.get("token_ids")
    if output_ids is None:
        raise ServerRequestError(
            "the server's completion has no 'token_ids': it must support return_token_ids (vLLM >= 0.10)"
        )
    logprobs = choice.get("logprobs") or {}
    token_lps = logprobs.get("token_logprobs") or []
    if len(token_lps) != len(output_ids):
        raise ServerRequestError(
            f"the server returned {len(token_lps)} log-probs for {len(output_ids)} tokens"
        )
    top: list[dict[int, float]] | None = None
    if want_topk:
        raw = logprobs.get("top_logprobs") or []
        top = [{parse_token_key(k): float(v) for k, v in (entry or {}).items()} for entry in raw]
        if len(top) != len(output_ids):
            raise ServerRequestError(
                f"the server returned {len(top)} top-logprob entries for {len(output_ids)} tokens"
            )
    return TurnRecord(
        prompt_ids=list(prompt_ids),
        output_ids=[int(t) for t in output_ids],
        output_log_probs=[float(x) if x is not None else 0.0 for x in token_lps],
        output_sampler_logprobs=top,
        finish_reason=choice.get("finish_reason"),
    )


def build_generate_payload(
    model: str, prompt_ids: list[int], p: SamplingParams, seed: int | None
) -> dict[str, Any]:
    """A ``/inference/v1/generate`` body: vLLM ``SamplingParams`` names, tokens only (no detokenization)."""
    params: dict[str, Any] = {
        "n": 1,
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "logprobs": p.num_logprobs,
        "skip_special_tokens": False,
        "detokenize": False,
    }
    params |= optional_sampling_fields(p, seed)
    return {"model": model, "token_ids": list(prompt_ids), "sampling_params": params, "output_mode": "tokens"}


def parse_generate_choice(
    prompt_ids: list[int], choice: dict[str, Any], want_topk: bool, max_mask_candidates: int | None
) -> TurnRecord:
    """Turn one ``choices[i]`` of a ``/inference/v1/generate`` response into a ``TurnRecord``.

    Top log-probs are read by ``token_id`` (their count differs between vLLM 0.32 and 0.33). ``sampling_mask``
    becomes ``output_sampling_mask`` (None when the server sent none); sets over ``max_mask_candidates`` or
    without the sampled token are emptied (``CandidateSets.num_overflow`` / ``num_invalid`` count them).
    """
    output_ids = choice.get("token_ids")
    if output_ids is None:
        raise ServerRequestError(f"the server's {GENERATE_ROUTE} choice has no 'token_ids'")
    output_ids = [int(t) for t in output_ids]
    content = (choice.get("logprobs") or {}).get("content") or []
    if len(content) != len(output_ids):
        raise ServerRequestError(f"the server returned {len(content)} log-probs for {len(output_ids)} tokens")
    top: list[dict[int, float]] | None = None
    if want_topk:
        top = [
            {int(e["token_id"]): float(e["logprob"]) for e in (entry.get("top_logprobs") or [])}
            for entry in content
        ]
    mask = choice.get("sampling_mask")
    sets = None
    if mask is not None:
        if len(mask) != len(output_ids):
            raise ServerRequestError(
                f"the server returned {len(mask)} sampling masks for {len(output_ids)} tokens"
            )
        sets = CandidateSets.from_lists(mask, max_mask_candidates, sampled=output_ids)
    return TurnRecord(
        prompt_ids=list(prompt_ids),
        output_ids=output_ids,
        output_log_probs=[float(e["logprob"]) if e.get("logprob") is not None else 0.0 for e in content],
        output_sampling_mask=sets,
        output_sampler_logprobs=top,
        finish_reason=choice.get("finish_reason"),
    )


class CompletionClient:
    """One pooled ``httpx.AsyncClient``; create it inside the rollout loop's event loop (``setup``)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        timeout: float,
        max_retries: int,
        max_connections: int,
        retry_budget_s: float | None = None,
        link: ServerLink | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.timeout = timeout
        self.max_retries = max_retries
        self.retry_budget_s = timeout if retry_budget_s is None else retry_budget_s
        """Seconds a request keeps retrying connection failures (and waiting for a lost server) before failing."""
        self.link = link
        self.retry_count = 0
        self.lost_count = 0
        """Connection failures that discovered a server loss (the link was healthy before)."""
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 30.0)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    async def close(self) -> None:
        await self._client.aclose()

    async def complete(self, prompt_ids: list[int], params: SamplingParams, seed: int | None) -> TurnRecord:
        payload = build_payload(request_model(self.model), prompt_ids, params, seed)
        data = await self._post("/v1/completions", payload)
        choices = data.get("choices") or []
        if not choices:
            raise ServerRequestError(f"{self.base_url}/v1/completions returned no choices: {str(data)[:200]}")
        return parse_choice(prompt_ids, choices[0], want_topk=params.num_logprobs > 0)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, seed: int | None, max_mask_candidates: int | None
    ) -> TurnRecord:
        """One request through ``/inference/v1/generate``, keeping each token's candidate set (sampling mask)."""
        payload = build_generate_payload(request_model(self.model), prompt_ids, params, seed)
        data = await self._post(GENERATE_ROUTE, payload)
        choices = data.get("choices") or []
        if not choices:
            raise ServerRequestError(
                f"{self.base_url}{GENERATE_ROUTE} returned no choices: {str(data)[:200]}"
            )
        return parse_generate_choice(prompt_ids, choices[0], params.num_logprobs > 0, max_mask_candidates)

    async def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        attempts = 0  # failures of a live server (timeouts, 5xx): bounded by max_retries
        conn_failures = 0  # connection failures: bounded by the time budget
        deadline = time.monotonic() + self.retry_budget_s
        while True:
            await self._wait_for_server(path, deadline)
            try:
                resp = await self._client.post(path, json=payload)
            except httpx.TimeoutException as e:
                if isinstance(e, httpx.ConnectTimeout):
                    err, connection = f"{type(e).__name__}: {e}", True
                else:
                    err, connection = f"{type(e).__name__}: {e}", False
            except httpx.TransportError as e:  # refused, reset, dropped mid-response
                err, connection = f"{type(e).__name__}: {e}", True
            except asyncio.TimeoutError as e:
                err, connection = f"{type(e).__name__}: {e}", False
            else:
                if resp.status_code == 200:
                    return resp.json()
                newer = retired_fallback(payload["model"]) if resp.status_code == 404 else None
                if newer is not None:  # the group's LoRA adapter left the server (rollout/served_name.py)
                    payload = {**payload, "model": newer}
                    continue
                if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
                    raise ServerRequestError(
                        f"{self.base_url}{path} rejected the request (HTTP {resp.status_code}): "
                        f"{_error_message(resp)}",
                        status=resp.status_code,
                    )
                err, connection = f"HTTP {resp.status_code}: {_error_message(resp)}", False
            if connection:
                conn_failures += 1
                if conn_failures == 1:  # the budget runs from the first connection failure
                    deadline = time.monotonic() + self.retry_budget_s
                if self.link is not None and self.link.mark_lost():
                    self.lost_count += 1
                if time.monotonic() >= deadline:
                    raise ServerRequestError(
                        f"{self.base_url}{path} could not be reached for {self.retry_budget_s:g}s "
                        f"({conn_failures} attempts, last: {err}); check the server, or raise server.timeout."
                    )
                delay = backoff_s(conn_failures)
            else:
                attempts += 1
                if attempts > self.max_retries:
                    raise ServerRequestError(
                        f"{self.base_url}{path} failed {attempts} times (last: {err}); check the server, or "
                        "raise server.max_retries / server.timeout."
                    )
                delay = backoff_s(attempts)
            self.retry_count += 1
            await self._sleep(delay, deadline)

    async def _wait_for_server(self, path: str, deadline: float) -> None:
        """Hold while the server is lost or waits for a weight resync (bounded by the retry budget)."""
        if self.link is None or self.link.healthy:
            return
        if not await self.link.wait_healthy(max(deadline, time.monotonic() + 1.0)):
            raise ServerRequestError(
                f"{self.base_url}{path}: the server was lost and did not come back with the trained weights "
                f"within {self.retry_budget_s:g}s (server.timeout); check the server."
            )

    async def _sleep(self, delay: float, deadline: float) -> None:
        """Back off; with a link, stop early once a lost server is back and resynced (it is then healthy)."""
        end = time.monotonic() + min(delay, max(0.0, deadline - time.monotonic()))
        was_healthy = self.link is None or self.link.healthy
        while (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(left, 0.1))
            if not was_healthy and self.link is not None and self.link.healthy:
                return


def backoff_s(attempt: int) -> float:
    """Exponential backoff with jitter: about 1, 2, 4, 8, 16, 16, ... seconds (times 0.5-1)."""
    return min(2.0 ** min(attempt - 1, 4), MAX_BACKOFF_S) * (0.5 + random.random() / 2)


def _error_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:300]
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict):
            return str(err.get("message", err))[:500]
        return str(err)[:500]
    return str(body)[:300]
