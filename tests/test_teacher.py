"""The teacher client (``distill/teacher.py``): scores from the embedded server (``builtin:tiny-qwen3``) checked
against a transformers forward at T=1; the ``prompt_logprobs`` -> ``TeacherTopK`` parsing on hand-made entries
(ties, realized token inside and outside the top-K, clamps, padding); faults from a stdlib fake teacher (5xx and a
dropped connection retried and counted, a hang bounded by ``teacher.timeout``, a 4xx not retried) and a port where
nothing listens.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
import torch

from asyncgrpo_cli.config.schema import EmbeddedServerConfig
from asyncgrpo_cli.distill.teacher import ROUTE, TeacherClient, TeacherRequestError, topk_rows
from asyncgrpo_cli.samples import TeacherTopK
from asyncgrpo_cli.server.launch import EmbeddedServerProcess
from tests.helpers.fake_server import DROP, VOCAB, FakeVllmServer

NAME = "tiny"
NAMES = ("code", "default", "math")
PROMPT = [
    1,
    456,
    201,
    59,
    281,
    261,
    271,
    2,
    201,
    1,
    313,
    201,
    54,
    74,
    71,
    415,
    434,
    528,
    16,
    2,
    201,
    1,
    504,
    201,
]
"""A ChatML prompt of the tiny tokenizer (system, user, assistant header)."""


class FakeTeacher(FakeVllmServer):
    """The stdlib fake (``tests/helpers/fake_server.py``) answering scoring requests as vLLM shapes them: entry 0
    null, then the actual token at rank 1 (log-prob -0.5) and ids after it at ranks 2..N. A request over
    ``max_logprobs`` gets vLLM's 400. ``decode`` fills ``decoded_token`` (the student tokenizer, in the probe
    tests). It reports no ``/server_info``: a vLLM teacher without dev mode."""

    def __init__(
        self, *, max_logprobs: int = 20, decode: Callable[[int], str] = str, model: str = "fake", **kw
    ):
        super().__init__(model=model, **kw)
        self.max_logprobs = max_logprobs
        self.decode = decode

    def _complete(self, req):
        if self.completion_delay_s:
            threading.Event().wait(self.completion_delay_s)
        n = req.get("prompt_logprobs")
        if n is None:
            return super()._complete(req)
        if n > self.max_logprobs:
            message = (
                f"Requested prompt logprobs of {n}, which is greater than max allowed: {self.max_logprobs}"
            )
            return 400, {"error": {"message": message, "type": "BadRequestError", "code": 400}}
        prompt = [int(t) for t in req["prompt"]]
        entries = [None] + [self._entry(t, n) for t in prompt[1:]]
        choice = {"index": 0, "text": "", "prompt_logprobs": entries, "finish_reason": "length"}
        return 200, {"id": "cmpl-fake", "object": "text_completion", "model": self.model, "choices": [choice]}

    def _entry(self, token: int, n: int) -> dict:
        ids = [token] + [(token + r) % VOCAB for r in range(1, n)]
        return {
            str(t): {"logprob": -0.5 - r, "rank": r + 1, "decoded_token": self.decode(t)}
            for r, t in enumerate(ids)
        }


def run_score(base_url: str, token_ids, start, *, top_k=5, timeout=60.0, max_retries=0, model=NAME):
    """Score once with a fresh client; (the scores, the client after closing)."""

    async def go():
        c = TeacherClient("default", 1, NAMES, base_url, model, top_k, timeout, max_retries)
        try:
            return await c.score(token_ids, start), c
        finally:
            await c.close()

    return asyncio.run(go())


def free_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- against the embedded server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def teacher(tiny_model_dir, tmp_path_factory):
    cfg = EmbeddedServerConfig(port=0, max_model_len=256, max_num_seqs=4, num_threads=1)
    proc = EmbeddedServerProcess(
        tiny_model_dir,
        cfg,
        served_model_name=NAME,
        log_path=tmp_path_factory.mktemp("teacher") / "server.log",
        startup_timeout=120,
    )
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir, one_torch_thread):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def ref_logprobs(model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row t is the T=1 next-token distribution after ids[: t + 1]."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().log_softmax(-1)


@pytest.fixture(scope="module")
def sequence(reference) -> list[int]:
    """PROMPT + 12 completion tokens: the reference's argmax at even steps (inside any top-K), far-down tokens
    at odd ones (outside it)."""
    ids = list(PROMPT)
    for step in range(12):
        row = ref_logprobs(reference, ids)[-1]
        ids.append(int(row.argmax()) if step % 2 == 0 else int(row.argsort()[step * 10]))
    return ids


@pytest.mark.parametrize("top_k", [1, 8])
def test_scores_equal_a_transformers_forward(teacher, reference, sequence, top_k):
    start = len(PROMPT)
    scores, client = run_score(teacher.base_url, sequence, start, top_k=top_k)
    n = len(sequence) - start
    assert isinstance(scores, TeacherTopK)
    assert scores.ids.shape == scores.logprobs.shape == (n, top_k + 1)
    assert scores.ids.dtype == np.int64 and scores.logprobs.dtype == np.float32
    assert scores.teacher.tolist() == [1] * n and scores.teacher_names == NAMES
    assert client.retry_count == 0 and 0 < client.last_score_s < 60
    ref = ref_logprobs(reference, sequence)[start - 1 : -1]  # row i predicts sequence[start + i]
    top_values = ref.topk(top_k, dim=-1).values.numpy()
    inside = 0
    for i, token in enumerate(sequence[start:]):
        ids, lps = scores.ids[i], scores.logprobs[i]
        assert np.all(ids[:top_k] >= 0)
        np.testing.assert_allclose(lps[:top_k], ref[i, ids[:top_k]].numpy(), atol=1e-4)
        np.testing.assert_allclose(lps[:top_k], top_values[i], atol=1e-4)  # the top K, in rank order
        assert np.all(np.diff(lps[:top_k]) <= 0)
        if token in ids[:top_k]:
            inside += 1
            assert ids[top_k] == -1 and lps[top_k] == -np.inf
        else:
            assert ids[top_k] == token
            assert abs(lps[top_k] - float(ref[i, token])) < 1e-4
    assert 0 < inside < n  # both cases were seen: the argmax steps, the far-down ones


def test_embedded_cap_is_refused_with_its_message(teacher, sequence):
    with pytest.raises(TeacherRequestError) as err:
        run_score(teacher.base_url, sequence, len(PROMPT), top_k=21, max_retries=3)
    msg = str(err.value)
    assert msg.startswith(f"teacher 'default' ({teacher.base_url}) refused prompt_logprobs=21: ")
    assert "greater than max allowed: 20" in msg
    assert msg.endswith("start it with --max-logprobs -1 or lower teacher.top_k.")


def test_an_empty_completion_asks_nothing():
    scores, client = run_score("http://127.0.0.1:9", [1, 2, 3], 3, top_k=4)  # nothing listens there
    assert scores.ids.shape == (0, 5) and len(scores.teacher) == 0 and client.retry_count == 0


# -- parsing (plain data) ---------------------------------------------------------------------------------------
def entry(*items: tuple[int | str, float, int]) -> dict:
    return {str(t): {"logprob": lp, "rank": r, "decoded_token": "x"} for t, lp, r in items}


def test_parse_orders_by_rank_and_breaks_ties_by_logprob_then_id():
    tied = entry((9, -1.2, 2), (4, -1.1, 2), (6, -0.3, 1), (5, -1.1, 2))
    ids, lps = topk_rows([None, tied, tied, tied], [0, 4, 9, 3], 1, 3)
    assert ids[:, :3].tolist() == [[6, 4, 5]] * 3
    np.testing.assert_allclose(lps[0, :3], [-0.3, -1.1, -1.1])
    assert ids[0, 3] == -1  # realized 4: inside the top 3
    assert ids[1, 3] == 9 and lps[1, 3] == pytest.approx(-1.2)  # realized 9: cut by the tie, so column K
    assert ids[2, 3] == -1 and lps[2, 3] == -np.inf  # realized 3: not reported at all


def test_parse_realized_token_inside_and_outside_the_top_k():
    # vLLM's shape: the actual token first, then the top N; a top-N token keeps its top-N rank
    outside = entry((77, -6.0, 40), (10, -0.1, 1), (11, -0.2, 2))
    inside = entry((11, -0.2, 2), (10, -0.1, 1))
    ids, lps = topk_rows([None, outside, inside], [0, 77, 11], 1, 2)
    assert ids.tolist() == [[10, 11, 77], [10, 11, -1]]
    np.testing.assert_allclose(lps[0], [-0.1, -0.2, -6.0])


def test_parse_clamp_padding_missing_entries_and_id_keys():
    clamped = entry((3, -9999.0, 5), (8, -0.5, 1))
    short = {"token_id:12": {"logprob": -0.1, "rank": 1}}
    ids, lps = topk_rows([None, clamped, None, short], [5, 3, 7, 12], 0, 3)
    assert ids.tolist() == [[-1, -1, -1, -1], [8, -1, -1, 3], [-1, -1, -1, -1], [12, -1, -1, -1]]
    assert lps[1, 3] == -np.inf and lps[1, 0] == pytest.approx(-0.5)
    assert np.all(lps[ids == -1] == -np.inf)
    with pytest.raises(ValueError, match="3 prompt_logprobs entries for 4 tokens"):
        topk_rows([None, clamped, None], [5, 3, 7, 12], 1, 3)


# -- faults (a stdlib fake teacher) -----------------------------------------------------------------------------
@pytest.mark.parametrize("status", [503, DROP])
def test_5xx_and_dropped_connections_are_retried_and_counted(status):
    tokens = [5, 6, 7, 8]
    with FakeTeacher() as srv:
        srv.fail(ROUTE, times=2, status=status)
        scores, client = run_score(srv.base_url, tokens, 2, top_k=3, timeout=10, max_retries=2)
        assert srv.requests[ROUTE] == 3
    assert client.retry_count == 2
    assert client.last_score_s >= 1.5  # the two backoffs (at least 0.5 s and 1 s) are in it
    assert scores.ids.tolist() == [[7, 8, 9, -1], [8, 9, 10, -1]]


def test_a_hang_times_out_within_the_bound():
    timeout, retries = 1.0, 1
    with FakeTeacher(completion_delay_s=30) as srv:
        t0 = time.monotonic()
        with pytest.raises(TeacherRequestError) as err:
            run_score(srv.base_url, [5, 6, 7], 1, timeout=timeout, max_retries=retries)
        elapsed = time.monotonic() - t0
    assert elapsed < (retries + 1) * timeout + 1.0 + 2.0  # two attempts, one backoff (<= 1 s), slack
    msg = str(err.value)
    assert f"teacher 'default' ({srv.base_url}) failed 2 scoring attempts" in msg
    assert "TimeoutError after 1s" in msg or "ReadTimeout after 1s" in msg
    assert "teacher.timeout (1s) / teacher.max_retries (1)" in msg


def test_a_4xx_is_not_retried_and_carries_the_message():
    with FakeTeacher() as srv:
        srv.fail(ROUTE, times=1, status=400)
        with pytest.raises(TeacherRequestError, match=r"refused the scoring request \(HTTP 400\): injected"):
            run_score(srv.base_url, [5, 6, 7], 1, max_retries=5)
        assert srv.requests[ROUTE] == 1
        with pytest.raises(TeacherRequestError) as err:
            run_score(srv.base_url, [5, 6, 7], 1, top_k=32, max_retries=5)
        assert srv.requests[ROUTE] == 2
    assert str(err.value) == (
        f"teacher 'default' ({srv.base_url}) refused prompt_logprobs=32: Requested prompt logprobs of 32, which "
        "is greater than max allowed: 20: start it with --max-logprobs -1 or lower teacher.top_k."
    )


def test_an_answer_without_prompt_logprobs_names_the_teacher():
    with FakeVllmServer() as srv:  # the plain fake: completions without prompt_logprobs
        with pytest.raises(TeacherRequestError) as err:
            run_score(srv.base_url, [5, 6, 7], 1, max_retries=3)
        assert srv.requests[ROUTE] == 1
    msg = str(err.value)
    assert msg.startswith(f"teacher 'default' ({srv.base_url}) answered a scoring request with no usable ")
    assert msg.endswith("is teacher.servers.default a vLLM server?")


def test_an_unreachable_teacher_fails_within_the_timeout():
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(TeacherRequestError) as err:
        run_score(url, [5, 6, 7], 1, timeout=2.0, max_retries=0)
    assert time.monotonic() - t0 < 2.0 + 2.0
    msg = str(err.value)
    assert msg.startswith(f"teacher 'default' ({url}) could not be reached for 2s (")
    assert "fix teacher.servers.default, or raise teacher.timeout" in msg
