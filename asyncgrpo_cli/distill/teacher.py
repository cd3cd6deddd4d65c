"""The teacher client: one teacher server scores a student's sampled tokens over HTTP (teacher-forced
``prompt_logprobs``); it knows nothing of losses, queues or routing (the rollout loop picks the row's teacher).

The request (vllm-rl-api.md section 4; reference section 5) sends the whole sequence, prompt then completion, as
token ids and generates one throw-away token::

    POST {base_url}/v1/completions
    {"model": M, "prompt": [ids], "max_tokens": 1, "temperature": 1.0, "prompt_logprobs": K, "n": 1}

``choices[0].prompt_logprobs`` is aligned with the prompt: entry 0 is null, entry ``t`` scores token ``t`` given
the tokens before it, as ``{"<id>": {"logprob", "rank", "decoded_token"}}``: the actual token plus the top K
(K entries when the actual token is one of them; ranks 1-based, ties sharing one). The completion positions
``start .. len - 1`` become the rows of a ``TeacherTopK`` (``samples.py``)::

    columns 0..K-1  the entries of rank <= K, sorted by (rank, -logprob, id): equal ranks by log-prob, then id
    column  K       the realized token token_ids[t] when it is not in columns 0..K-1 (on vLLM: its rank > K)
    padding         id -1, log-prob -inf; -9999.0 (vLLM's clamp of -inf) reads as -inf; a null entry: all -1

Temperature. Prompt tokens never go through the sampler, so a server never tempers prompt log-probs, whatever the
request or ``--logprobs-mode`` says (vllm-rl-api.md section 3): they are the raw T=1 values, and the loss applies
``loss.teacher_temperature`` to both sides itself. The request says ``temperature: 1.0`` to state that.

Failures, with the backoff of ``rollout/client.py`` (about 1, 2, 4, ... s, capped at 16 s), every re-send counted
in ``retry_count`` (the loop reports it as ``rollout/vllm_retry_total``):

- a timeout (each attempt is bounded by ``teacher.timeout`` seconds in all), a 5xx, 408 or 429 is retried
  ``teacher.max_retries`` times;
- a connection failure (refused, reset, dropped) is retried until ``teacher.timeout`` seconds have passed since
  the first one, so a teacher restarted within that time costs a pause;
- any other 4xx is not retried: the error carries the server's message and its fix (``refusal_fix``).

Errors are ``TeacherRequestError``, naming the teacher id, its URL and the key to change. Raised in the rollout
process, it stops the run with that one message (``rollout/worker.py`` hands it to the trainer).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np

from asyncgrpo_cli.rollout.client import ServerRequestError, _error_message, backoff_s
from asyncgrpo_cli.samples import TeacherTopK

ROUTE = "/v1/completions"
LOGPROB_FLOOR = -9999.0
"""vLLM serializes -inf log-probs as -9999.0 (and clamps anything below)."""


class TeacherRequestError(ServerRequestError):
    """A teacher refused a scoring request (4xx) or kept failing after every retry; names the teacher."""


def scoring_payload(model: str, token_ids: Sequence[int], top_k: int) -> dict[str, Any]:
    """The teacher-forced request: every token as prompt, one generated token, the top ``top_k`` per position."""
    return {
        "model": model,
        "prompt": [int(t) for t in token_ids],
        "max_tokens": 1,
        "temperature": 1.0,
        "prompt_logprobs": top_k,
        "n": 1,
    }


def _token_id(key: str) -> int:
    """A ``prompt_logprobs`` key: a plain id (``"123"``), or ``"token_id:123"``."""
    return int(str(key).rsplit(":", 1)[-1])


def _logprob(value: Any) -> float:
    lp = float("-inf") if value is None else float(value)
    return float("-inf") if lp <= LOGPROB_FLOOR else lp


def topk_rows(
    entries: Sequence[dict[str, Any] | None], token_ids: Sequence[int], start: int, top_k: int
) -> tuple[np.ndarray, np.ndarray]:
    """``prompt_logprobs`` entries -> (ids int64, log-probs float32), ``[len(token_ids) - start, top_k + 1]`` in
    the ``TeacherTopK`` layout (module doc). Raises ValueError on a list that is not aligned with the tokens."""
    if len(entries) != len(token_ids):
        raise ValueError(f"{len(entries)} prompt_logprobs entries for {len(token_ids)} tokens")
    n = len(token_ids) - start
    ids = np.full((n, top_k + 1), -1, dtype=np.int64)
    lps = np.full((n, top_k + 1), -np.inf, dtype=np.float32)
    for row in range(n):
        entry = entries[start + row]
        if not entry:
            continue
        cands = []
        for key, value in entry.items():
            rank = value.get("rank") if isinstance(value, dict) else None
            if rank is None:
                raise ValueError(f"prompt_logprobs entry {start + row} has no rank: {str(value)[:100]}")
            lp = _logprob(value.get("logprob"))
            cands.append((int(rank), -lp, _token_id(key), lp))
        cands.sort()
        top = [c for c in cands if c[0] <= top_k][:top_k]
        for col, (_, _, tid, lp) in enumerate(top):
            ids[row, col], lps[row, col] = tid, lp
        realized = int(token_ids[start + row])
        if all(c[2] != realized for c in top):
            hit = [c for c in cands if c[2] == realized]
            if hit:
                ids[row, top_k], lps[row, top_k] = realized, hit[0][3]
    return ids, lps


def refusal_fix(message: str, teacher_id: str) -> str:
    """The fix for a teacher's 4xx answer, from vLLM's message."""
    low = message.lower()
    if "logprobs" in low and "max allowed" in low:
        return "start it with --max-logprobs -1 or lower teacher.top_k"
    if "maximum context length" in low or "exceeds model's maximum" in low:
        return (
            "start it with a --max-model-len above the student's longest sequence (one more position: scoring "
            "generates one token)"
        )
    if "out of vocabulary" in low:
        return (
            "its vocabulary is smaller than the student's: a teacher must share the student's tokenizer "
            f"(teacher.servers.{teacher_id})"
        )
    if "does not exist" in low or "not found" in low:
        return f"teacher.servers.{teacher_id} points at a server that does not serve this model"
    return f"check the teacher server (teacher.servers.{teacher_id})"


class TeacherClient:
    """Scores sequences on one teacher; one pooled ``httpx.AsyncClient`` (create and close it in the rollout
    loop's event loop). ``index`` is this teacher's position in ``names`` (the sorted ids of ``teacher.servers``).

    ``last_score_s``: seconds the latest ``score`` took, retries included (``rollout/score_s``,
    ``teacher_score_s/<id>``); read it right after the ``await``, before the task awaits anything else.
    ``max_connections``: None leaves the pool unbounded (the loop bounds the requests in flight).
    """

    def __init__(
        self,
        teacher_id: str,
        index: int,
        names: tuple[str, ...],
        base_url: str,
        model: str,
        top_k: int,
        timeout: float,
        max_retries: int,
        *,
        max_connections: int | None = None,
    ):
        if not 0 <= index < len(names) or names[index] != teacher_id:
            raise ValueError(f"teacher {teacher_id!r} must be names[{index}] of {names}")
        self.teacher_id = teacher_id
        self.index = index
        self.names = tuple(names)
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.top_k = top_k
        self.timeout = timeout
        self.max_retries = max_retries
        self.retry_count = 0
        self.last_score_s = 0.0
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 30.0)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )

    @property
    def label(self) -> str:
        return f"teacher {self.teacher_id!r} ({self.base_url})"

    async def close(self) -> None:
        await self._client.aclose()

    async def score(self, token_ids: Sequence[int], start: int) -> TeacherTopK:
        """The teacher's top-K at tokens ``start .. len(token_ids) - 1`` (the completion; ``start`` = the prompt
        length): one row per token, ``top_k + 1`` columns."""
        t0 = time.perf_counter()
        if not 0 <= start <= len(token_ids):
            raise ValueError(f"start={start} is outside the {len(token_ids)} tokens to score")
        ids = np.full((0, self.top_k + 1), -1, dtype=np.int64)
        lps = np.full((0, self.top_k + 1), -np.inf, dtype=np.float32)
        if start < len(token_ids):
            resp = await self._post(scoring_payload(self.model, token_ids, self.top_k))
            # off the event loop: ~0.3 s of JSON and parsing for 2k tokens at top_k=64 (a 10 MB answer)
            ids, lps = await asyncio.to_thread(self._rows, resp, token_ids, start)
        n = len(ids)
        self.last_score_s = time.perf_counter() - t0
        return TeacherTopK(ids, lps, teacher=np.full(n, self.index, dtype=np.int64), teacher_names=self.names)

    async def _post(self, payload: dict[str, Any]) -> httpx.Response:
        attempts = 0  # failures of a live server (timeouts, 5xx): bounded by max_retries
        conn_failures = 0  # connection failures: bounded by the time since the first one
        deadline = float("inf")
        while True:
            try:
                resp = await asyncio.wait_for(self._client.post(ROUTE, json=payload), self.timeout)
            except httpx.ConnectTimeout as e:
                err, connection = f"{type(e).__name__}: {e}", True
            except (httpx.TimeoutException, asyncio.TimeoutError) as e:
                err, connection = f"{type(e).__name__} after {self.timeout:g}s", False
            except httpx.TransportError as e:  # refused, reset, dropped mid-response
                err, connection = f"{type(e).__name__}: {e}", True
            else:
                if resp.status_code == 200:
                    return resp
                if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
                    raise self._refused(resp)
                err, connection = f"HTTP {resp.status_code}: {_error_message(resp)}", False
            if connection:
                conn_failures += 1
                if conn_failures == 1:
                    deadline = time.monotonic() + self.timeout
                if time.monotonic() >= deadline:
                    raise TeacherRequestError(
                        f"{self.label} could not be reached for {self.timeout:g}s ({conn_failures} attempts, "
                        f"last: {err}): start it, fix teacher.servers.{self.teacher_id}, or raise teacher.timeout."
                    )
                delay = backoff_s(conn_failures)
            else:
                attempts += 1
                if attempts > self.max_retries:
                    raise TeacherRequestError(
                        f"{self.label} failed {attempts} scoring attempts (last: {err}): check the teacher "
                        f"server, or raise teacher.timeout ({self.timeout:g}s) / teacher.max_retries "
                        f"({self.max_retries})."
                    )
                delay = backoff_s(attempts)
            self.retry_count += 1
            await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))

    def _rows(
        self, resp: httpx.Response, token_ids: Sequence[int], start: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """A 200 answer's ``prompt_logprobs`` as ``TeacherTopK`` arrays; anything else is the server's fault."""
        try:
            data = resp.json()
        except ValueError:
            raise TeacherRequestError(
                f"{self.label} answered {resp.text[:200]!r}, which is not JSON: is teacher.servers."
                f"{self.teacher_id} a vLLM server?"
            ) from None
        try:
            entries = data["choices"][0]["prompt_logprobs"]
            if entries is None:
                raise TypeError("prompt_logprobs is null")
            return topk_rows(entries, token_ids, start, self.top_k)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise TeacherRequestError(
                f"{self.label} answered a scoring request with no usable prompt_logprobs ({type(e).__name__}: "
                f"{e}; answer {str(data)[:200]!r}): is teacher.servers.{self.teacher_id} a vLLM server?"
            ) from None

    def _refused(self, resp: httpx.Response) -> TeacherRequestError:
        message = _error_message(resp)
        fix = refusal_fix(message, self.teacher_id)
        if fix.startswith("start it with --max-logprobs"):
            what = f"refused prompt_logprobs={self.top_k}"
        else:
            what = f"refused the scoring request (HTTP {resp.status_code})"
        return TeacherRequestError(f"{self.label} {what}: {message}: {fix}.")
