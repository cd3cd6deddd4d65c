"""The harness fixes from review (commit a779d75): the group's LoRA adapter name on a harness's requests, a 4xx
of the policy server refused to the agent while a 5xx stops the run at once, vocabulary-checked completion
prompts, answers whose client hung up not recorded, template errors and reserved ``chat_template_kwargs`` as 400s,
the JSON 404 of unknown routes, the harness's proxy environment, ``rollout.harness.sampling_mismatch=ignore``,
strict-JSON rows, ``max_completion_tokens: null``, replies that parse alike, the scorer's unscored rollouts, and
``harness/sampling_s``.

Boundary: the proxy as the rollout process builds it (``build_harness`` in ``tests/helpers/harness_policy.py``'s
``ProxyRig``: the tiny tokenizer with the ChatML training template, the Hermes parser, a real
``CompletionClient`` with ``max_retries=0``) in front of a scripted ``FakeVllmServer`` that also keeps the JSON
body of every ``/v1/completions`` request it answered (``BodyRecordingFake``: what the policy server was asked,
model name and sampler settings included). Requests come over real HTTP from the ``openai`` client, ``httpx``, or
real harness processes started by a real ``HarnessRunner`` on the proxy's event loop
(``tests/helpers/harness_agents.py``, and ``PERSISTENT_AGENT`` below: a stdlib agent that retries a refused
request). The scorer and ``row_json`` are called directly. Nothing is mocked.

Rules: every refusal is checked by status, ``param`` / ``code`` and the proxy's counters, and by what did (not)
reach the fake; every harness run is bounded (``asyncio.wait_for``) and the processes it started are gone after.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from openai import OpenAI

from asyncgrpo_cli.config.harness import HarnessConfig
from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.model.tiny import build_tiny_tokenizer
from asyncgrpo_cli.rollout.client import ServerRequestError
from asyncgrpo_cli.rollout.harness import openai_api as api
from asyncgrpo_cli.rollout.harness.runner import HarnessRunner, row_json
from asyncgrpo_cli.rollout.harness.trace import trace_rollout
from asyncgrpo_cli.rollout.rewards import RewardFunction
from asyncgrpo_cli.rollout.scorers import ScorerContext
from asyncgrpo_cli.rollout.scorers.grpo import GroupScorer
from asyncgrpo_cli.rollout.sequences import rollout_to_sequences
from asyncgrpo_cli.rollout.served_name import start_group
from asyncgrpo_cli.samples import Rollout, RolloutGroup, TurnRecord
from tests.helpers.fake_server import FakeVllmServer
from tests.helpers.harness_policy import (
    MAX_COMPLETION_LENGTH,
    SERVED_MODEL,
    TEMPERATURE,
    ProxyRig,
    Replies,
    gone,
    training_tokenizer,
)

AGENTS = str(Path(__file__).parent / "helpers" / "harness_agents.py")
QUESTION = [{"role": "user", "content": "What is 1 plus 2?"}]
ANSWER = "It is 3."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
GRACE_S = 0.5
SLACK_S = 6.0
"""What a harness run may take beyond its own work (a Python start on a loaded 2-core machine)."""

PERSISTENT_AGENT = r"""
import json, os, sys, time, urllib.error, urllib.request

row = json.loads(sys.stdin.read())
log = open(os.environ["AGENT_LOG"], "a")
log.write(json.dumps({"pid": os.getpid()}) + "\n")
log.flush()
deadline = time.monotonic() + 60
while True:
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps(
            {"model": os.environ["ASYNCGRPO_MODEL"], "messages": [{"role": "user", "content": row["prompt"]}]}
        ).encode(),
        headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"], "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            status, answer = response.status, json.load(response)
    except urllib.error.HTTPError as e:
        status, answer = e.code, json.loads(e.read() or b"{}")
    log.write(json.dumps({"status": status, "code": (answer.get("error") or {}).get("code")}) + "\n")
    log.flush()
    if status == 200 or time.monotonic() > deadline:
        break
    time.sleep(float(os.environ["AGENT_RETRY_S"]))
print(json.dumps({"reward": 1.0 if status == 200 else 0.0}))
"""
"""Chats until answered 200 (retrying every ``AGENT_RETRY_S`` seconds, for a minute), logging its PID and every
answer's status and error code to ``AGENT_LOG``; a reward line 1.0 once answered."""

STRICT_TEMPLATE = (
    "{%- if reasoning_effort is defined %}"
    "{{- '<|im_start|>system\\nReasoning: ' + reasoning_effort + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}"
    "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""A ChatML template that refuses conversations whose roles do not alternate (as Llama-2's and Mistral's do) and
renders a ``reasoning_effort`` template variable by string concatenation (as gpt-oss's does)."""


class BodyRecordingFake(FakeVllmServer):
    """The scripted fake, keeping the JSON body of every ``/v1/completions`` request it answered."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.bodies: list[dict[str, Any]] = []

    def _complete(self, req: dict[str, Any]) -> tuple[int, Any]:
        with self._lock:
            self.bodies.append(dict(req))
        return super()._complete(req)


@dataclass
class Setup:
    """A started ``ProxyRig`` on a ``BodyRecordingFake``, and the harness runners made on its loop."""

    rig: ProxyRig
    fake: BodyRecordingFake
    runners: list[HarnessRunner] = field(default_factory=list)

    def runner(self, command: list[str], timeout: float = 10.0, env: dict[str, str] | None = None):
        cfg = HarnessConfig(command=command, timeout=timeout, env=env or {}, stop_grace_s=GRACE_S)

        async def make() -> HarnessRunner:  # the proxy is the rig's, already serving
            assert self.rig.proxy is not None
            return HarnessRunner(cfg, self.rig.proxy, self.rig.metrics, 4)

        runner = self.rig.call(make())
        self.runners.append(runner)
        return runner

    def run(self, runner: HarnessRunner, row: dict[str, Any], bound: float) -> tuple[Rollout, float]:
        """``runner.run(row)`` on the proxy's loop; asserts it returned within ``bound`` seconds."""
        t0 = time.monotonic()
        rollout = self.rig.call(asyncio.wait_for(runner.run(row), bound + 5.0), timeout=bound + 10.0)
        elapsed = time.monotonic() - t0
        assert elapsed < bound, f"run took {elapsed:.2f}s (bound {bound}s)"
        return rollout, elapsed

    def client(self, token: str) -> OpenAI:
        return OpenAI(base_url=self.rig.base_url, api_key=token, max_retries=0, timeout=30.0)

    def opened(self):
        trace = self.rig.open()
        return trace, self.client(trace.token)

    def count(self, name: str) -> float:
        return self.rig.counts().get(f"harness/{name}", 0.0)


@pytest.fixture(scope="module")
def tok():
    return training_tokenizer()


@pytest.fixture
def make_setup(tok):
    """``make_setup(reply, tokenizer=tok, mismatch="reject")`` -> a started ``Setup``; all stopped after."""
    setups: list[Setup] = []

    def make(reply: Any, tokenizer: Any = None, mismatch: str = "reject") -> Setup:
        t = tokenizer or tok
        rig = ProxyRig(t, reply)
        rig.fake = fake = BodyRecordingFake(
            reply=reply, eos_token_id=t.eos_token_id, max_model_len=2048, model=SERVED_MODEL
        )
        rig.settings.rollout.harness = HarnessConfig(command=["true"], sampling_mismatch=mismatch)
        setup = Setup(rig, fake)
        setups.append(setup)
        rig.start()
        return setup

    yield make
    for s in setups:
        try:
            for runner in s.runners:
                s.rig.call(runner.close())
        finally:
            s.rig.stop()


def ids_of(tok, text: str) -> list[int]:
    """The ids the fake sends for a scripted text reply (it stopped: eos last)."""
    return tok.encode(text) + [tok.eos_token_id]


def always(tok, text: str = ANSWER):
    """A reply script answering ``text`` to every prompt (for concurrent harnesses)."""
    return lambda prompt_ids, max_tokens: ids_of(tok, text)


def agent_log(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def persistent_agent(tmp_path: Path, retry_s: float) -> tuple[list[str], dict[str, str], Path]:
    script = tmp_path / "persistent_agent.py"
    script.write_text(PERSISTENT_AGENT)
    log = tmp_path / "agent.jsonl"
    return ["python", str(script)], {"AGENT_LOG": str(log), "AGENT_RETRY_S": str(retry_s)}, log


# -- 1. the group's LoRA adapter name ---------------------------------------------------------------------------
def test_harness_requests_ask_for_the_model_name_of_their_group(make_setup, tok):
    s = make_setup(always(tok))
    runner = s.runner(["python", AGENTS, "two-turn"])

    async def group(version: int) -> Rollout:  # as AsyncRolloutLoop._run_group: pin the name, then roll out
        start_group("policy-v{version}", SERVED_MODEL, version, lambda: 9)
        return await runner.run({"prompt": f"Question of group {version}."})

    async def ungrouped() -> Rollout:
        return await runner.run({"prompt": "Question of no group."})

    async def main() -> list[Rollout]:
        return await asyncio.wait_for(asyncio.gather(group(7), group(8), ungrouped()), 60)

    rollouts = s.rig.call(main(), timeout=70)
    assert all(r.unscored is None and len(r.turns) == 2 for r in rollouts)
    asked: Counter[tuple[str, str]] = Counter()
    for body in s.fake.bodies:
        prompt = tok.decode(body["prompt"])
        who = next(w for w in ("group 7", "group 8", "no group") if f"Question of {w}." in prompt)
        asked[who, body["model"]] += 1
    assert asked == {("group 7", "policy-v7"): 2, ("group 8", "policy-v8"): 2, ("no group", SERVED_MODEL): 2}


# -- 2. policy server failures ----------------------------------------------------------------------------------
def test_a_4xx_of_the_policy_server_is_refused_to_the_agent_and_the_rollout_goes_on(make_setup, tok):
    s = make_setup(Replies(tok, [ANSWER]))
    trace, client = s.opened()
    s.fake.fail("/v1/completions", times=1, status=400)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=QUESTION)
    assert e.value.status_code == 400 and e.value.code == "upstream_rejected"
    assert "the policy server refused this request" in e.value.message and "HTTP 400" in e.value.message
    assert trace.server_error is None and trace.turns == []
    r = client.chat.completions.create(model="m", messages=QUESTION)  # the agent goes on
    assert r.choices[0].message.content == ANSWER
    assert [t.output_ids for t in trace.turns] == [ids_of(tok, ANSWER)]
    assert trace.server_error is None and s.count("rejected_request_count") == 1


def test_a_harness_refused_by_the_policy_server_retries_and_is_scored(make_setup, tok, tmp_path):
    s = make_setup(always(tok))
    command, env, log = persistent_agent(tmp_path, retry_s=0.1)
    runner = s.runner(command, env=env)
    s.fake.fail("/v1/completions", times=1, status=400)
    r, _ = s.run(runner, {"prompt": "What is 1 plus 2?"}, bound=SLACK_S)
    answers = [(e["status"], e["code"]) for e in agent_log(log) if "status" in e]
    assert answers == [(400, "upstream_rejected"), (200, None)]
    assert r.unscored is None and r.reward == 1.0
    assert [t.output_ids for t in r.turns] == [ids_of(tok, ANSWER)]
    assert gone(agent_log(log)[0]["pid"])


def test_a_5xx_of_the_policy_server_gives_502_and_records_the_error(make_setup, tok):
    s = make_setup(Replies(tok, [ANSWER]))
    trace, client = s.opened()
    s.fake.fail("/v1/completions", times=1, status=500)
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="m", messages=QUESTION)
    assert e.value.status_code == 502 and e.value.code == "upstream_error"
    assert isinstance(trace.server_error, ServerRequestError) and trace.server_error.status is None
    assert "HTTP 500" in str(trace.server_error) and trace.turns == []


@pytest.mark.parametrize("status", [401, 404])
def test_a_4xx_that_is_the_servers_setup_records_the_error_like_a_5xx(make_setup, tok, status):
    """A 404 (no such model: the served name or the group's adapter is missing) or a 401 is how the server
    was started, not what the agent asked: the run stops, as it would in a tool loop."""
    s = make_setup(Replies(tok, [ANSWER]))
    trace, client = s.opened()
    s.fake.fail("/v1/completions", times=1, status=status)
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="m", messages=QUESTION)
    assert e.value.status_code == 502 and e.value.code == "upstream_error"
    assert isinstance(trace.server_error, ServerRequestError) and trace.server_error.status == status


def test_a_5xx_under_a_harness_stops_the_run_at_once_not_after_its_timeout(make_setup, tok, tmp_path):
    s = make_setup(always(tok))
    command, env, log = persistent_agent(tmp_path, retry_s=30.0)  # it would wait and retry for long
    runner = s.runner(command, timeout=60.0, env=env)
    s.fake.fail("/v1/completions", times=1, status=500)
    t0 = time.monotonic()
    with pytest.raises(ServerRequestError, match="HTTP 500"):
        s.rig.call(asyncio.wait_for(runner.run({"prompt": "What is 1 plus 2?"}), 30), timeout=40)
    assert time.monotonic() - t0 < SLACK_S  # not the 60 s timeout, nor the 30 s retry pause
    assert s.count("rejected_request_count") == 1  # the proxy answered the agent once, with the 502
    entries = agent_log(log)
    # The run kills the agent as soon as the 5xx is recorded: under load that can come before the agent logs
    # the answer it read, so its log holds that answer or nothing, never a retry.
    assert [(e["status"], e["code"]) for e in entries if "status" in e] in ([], [(502, "upstream_error")])
    assert gone(entries[0]["pid"]) and not runner.groups.live
    assert not s.rig.proxy.traces.active


# -- 3. completion prompts hold vocabulary ids ------------------------------------------------------------------
@pytest.mark.parametrize("bad", [1024, 10**9, -1])
def test_a_completion_prompt_outside_the_vocabulary_gets_400_naming_prompt(make_setup, tok, bad):
    s = make_setup(Replies(tok, [[7]]))
    assert len(tok) == 1024
    _, client = s.opened()
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m", prompt=[5, 6, bad])
    assert e.value.param == "prompt" and f"token id {bad}" in e.value.message
    assert "[0, 1024)" in e.value.message
    assert s.fake.bodies == [] and s.count("rejected_request_count") == 1
    r = client.completions.create(model="m", prompt=[5, 6, 1023], max_tokens=1)  # the last id is in
    assert r.choices[0].finish_reason == "length" and len(s.fake.bodies) == 1


# -- 4. a client that hung up -----------------------------------------------------------------------------------
def test_an_answer_whose_client_hung_up_is_not_recorded(make_setup, tok):
    s = make_setup(Replies(tok, ["Too late.", ANSWER]))
    trace, client = s.opened()
    s.fake.completion_delay_s = 1.5
    with pytest.raises(httpx.ReadTimeout):  # it hangs up while the policy server samples
        httpx.post(
            s.rig.base_url + "/chat/completions",
            json={"messages": QUESTION},
            headers={"Authorization": f"Bearer {trace.token}"},
            timeout=httpx.Timeout(10.0, read=0.5),
        )
    deadline = time.monotonic() + 10
    while s.count("disconnected_request_count") == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert s.count("disconnected_request_count") == 1
    assert len(s.fake.bodies) == 1 and trace.turns == []  # sampled, but nobody got it: not in the trace
    assert s.count("rejected_request_count") == 0 and trace.server_error is None
    s.fake.completion_delay_s = 0.0
    r = client.chat.completions.create(model="m", messages=QUESTION)  # its retry is the turn
    assert r.choices[0].message.content == ANSWER
    assert [t.output_ids for t in trace.turns] == [ids_of(tok, ANSWER)]
    assert len(trace_rollout(trace).turns) == 1


# -- 5. template errors and reserved template kwargs ------------------------------------------------------------
@pytest.fixture
def strict_setup(make_setup):
    strict = build_tiny_tokenizer()
    strict.chat_template = STRICT_TEMPLATE
    return strict, make_setup(Replies(strict, [ANSWER, ANSWER]), tokenizer=strict)


def test_a_template_error_on_the_messages_is_a_400_naming_messages(strict_setup):
    _, s = strict_setup
    trace, client = s.opened()
    twice = [*QUESTION, {"role": "user", "content": "Please answer."}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=twice)
    assert e.value.param == "messages" and "the chat template cannot render these messages" in e.value.message
    assert "Conversation roles must alternate" in e.value.message
    assert s.fake.bodies == [] and s.count("rejected_request_count") == 1
    r = client.chat.completions.create(model="m", messages=QUESTION)  # the proxy still serves
    assert r.choices[0].message.content == ANSWER and len(trace.turns) == 1


def test_template_kwargs_the_template_cannot_render_are_a_400_not_a_500(strict_setup):
    strict, s = strict_setup
    trace, client = s.opened()
    with pytest.raises(openai.BadRequestError) as e:  # the template concatenates it to a string
        client.chat.completions.create(
            model="m", messages=QUESTION, extra_body={"chat_template_kwargs": {"reasoning_effort": 3}}
        )
    assert e.value.param == "messages" and "the chat template cannot render" in e.value.message
    assert "TypeError" in e.value.message and s.fake.bodies == []
    client.chat.completions.create(  # a template variable it can render goes through
        model="m", messages=QUESTION, extra_body={"chat_template_kwargs": {"reasoning_effort": "high"}}
    )
    assert "Reasoning: high" in strict.decode(trace.turns[0].prompt_ids)


@pytest.mark.parametrize(
    "key",
    ["chat_template", "add_generation_prompt", "tools", "messages", "tokenize", "truncation", "max_length"],
)
def test_reserved_chat_template_kwargs_are_refused_by_name(make_setup, tok, key):
    s = make_setup(Replies(tok, []))
    _, client = s.opened()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m",
            messages=QUESTION,
            extra_body={"chat_template_kwargs": {key: "x", "enable_thinking": False}},
        )
    assert e.value.param == f"chat_template_kwargs.{key}"
    assert f"chat_template_kwargs.{key} is the proxy's to set" in e.value.message
    assert s.fake.bodies == [] and s.count("rejected_request_count") == 1


# -- 6. unknown routes ------------------------------------------------------------------------------------------
def test_the_responses_api_gets_a_json_404_pointing_to_chat_completions(make_setup, tok):
    s = make_setup(Replies(tok, []))
    _, client = s.opened()
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="m", input="What is 1 plus 2?")
    err = e.value
    assert err.status_code == 404 and err.code == "unknown_route"
    assert err.response.headers["content-type"] == "application/json"
    assert "POST /v1/responses is not served" in err.message and "chat completions" in err.message
    assert "POST /v1/chat/completions" in err.message
    other = httpx.get(
        s.rig.base_url + "/embeddings/nothing", timeout=10
    )  # any other path: 404 without the hint
    assert other.status_code == 404 and other.json()["error"]["code"] == "unknown_route"
    assert "GET /v1/embeddings/nothing is not served" in other.json()["error"]["message"]
    assert "Responses API" not in other.json()["error"]["message"]
    assert s.count("rejected_request_count") == 2 and s.fake.bodies == []


# -- 7. the harness's environment -------------------------------------------------------------------------------
def test_the_environment_bypasses_proxies_for_loopback_and_names_the_base_twice(make_setup, tok, monkeypatch):
    s = make_setup(Replies(tok, []))
    monkeypatch.setenv("NO_PROXY", "corp.example")
    monkeypatch.delenv("no_proxy", raising=False)
    env = s.runner(["true"], env={"no_proxy": "internal.example"}).environment("agrpo-x")
    assert env["NO_PROXY"] == "corp.example,127.0.0.1,localhost"
    assert env["no_proxy"] == "internal.example,127.0.0.1,localhost"
    assert env["OPENAI_API_BASE"] == env["OPENAI_BASE_URL"] == s.rig.base_url
    assert env["OPENAI_API_KEY"] == "agrpo-x"
    monkeypatch.delenv("NO_PROXY")
    env = s.runner(["true"]).environment("agrpo-y")
    assert env["NO_PROXY"] == env["no_proxy"] == "127.0.0.1,localhost"


def test_a_harness_reaches_the_proxy_through_a_dead_http_proxy_setting(make_setup, tok, monkeypatch):
    s = make_setup(always(tok))
    for key in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(key, raising=False)
    dead = {"HTTP_PROXY": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9"}
    # the control: urllib with that setting and no NO_PROXY goes to the dead proxy
    control = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import urllib.request; urllib.request.urlopen({s.rig.base_url + '/models'!r})",
        ],
        env={**os.environ, **dead},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert control.returncode != 0 and "Connection refused" in control.stderr
    runner = s.runner(["python", AGENTS, "two-turn"], env=dead)
    r, _ = s.run(runner, {"prompt": "What is 1 plus 2?"}, bound=SLACK_S)
    assert r.unscored is None and len(r.turns) == 2 and r.reward is not None


# -- 8. rollout.harness.sampling_mismatch -----------------------------------------------------------------------
def test_sampling_mismatch_ignore_samples_with_the_runs_settings_and_counts(make_setup, tok):
    s = make_setup(Replies(tok, [ANSWER, ANSWER]), mismatch="ignore")
    trace, client = s.opened()
    r = client.chat.completions.create(model="m", messages=QUESTION, temperature=0, top_p=0.5)
    assert r.choices[0].message.content == ANSWER
    assert s.count("ignored_field_count") == 2
    c = client.completions.create(model="m", prompt="1 plus 2 is", temperature=0.0, presence_penalty=0.5)
    assert c.choices[0].text == ANSWER and s.count("ignored_field_count") == 4
    for body in s.fake.bodies:  # the policy server sampled both with the run's settings
        assert body["temperature"] == TEMPERATURE and body.get("top_p", 1.0) == 1.0
        assert "presence_penalty" not in body
    assert len(trace.turns) == 2 and s.count("rejected_request_count") == 0
    for fields, param in (
        ({"stop": ["."]}, "stop"),
        ({"n": 2}, "n"),
        ({"logit_bias": {"5": 1}}, "logit_bias"),
    ):
        with pytest.raises(openai.BadRequestError) as e:  # still refused: they change what is sampled
            client.chat.completions.create(model="m", messages=QUESTION, temperature=0, **fields)
        assert e.value.param == param
    assert len(s.fake.bodies) == 2 and s.count("rejected_request_count") == 3


def test_sampling_mismatch_reject_names_the_setting(make_setup, tok):
    s = make_setup(Replies(tok, []))
    _, client = s.opened()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=QUESTION, temperature=0)
    assert e.value.param == "temperature"
    assert "temperature=0 differs from the run's sampling.temperature=1.0" in e.value.message
    assert "rollout.harness.sampling_mismatch=ignore" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=QUESTION, top_p=0.5)
    assert e.value.param == "top_p" and "rollout.harness.sampling_mismatch=ignore" in e.value.message
    assert s.fake.bodies == [] and s.count("ignored_field_count") == 0


# -- 9. rows as strict JSON -------------------------------------------------------------------------------------
def test_row_json_is_strict_json_with_null_for_nan_and_infinities():
    row = {
        "prompt": "two plus two is",
        "nan": float("nan"),
        "inf": math.inf,
        "np_nan": np.float32("nan"),
        "np_ninf": np.float64("-inf"),
        "weights": np.array([0.5, np.nan, np.inf], dtype=np.float32),
        "grid": np.array([[1, 2], [3, 4]], dtype=np.int64),
        "count": np.int64(4),
        "flag": np.bool_(True),
        "nested": {"scores": [1.0, float("nan"), (2, math.inf)], 3: {"deep": np.float16(1.5)}},
        "when": datetime.date(2026, 12, 1),
        "other": Path("/data/x"),
    }

    def refuse(name: str) -> Any:
        raise ValueError(f"not strict JSON: {name}")

    line = row_json(row)
    assert line.endswith("\n") and line.count("\n") == 1
    assert json.loads(line, parse_constant=refuse) == {
        "prompt": "two plus two is",
        "nan": None,
        "inf": None,
        "np_nan": None,
        "np_ninf": None,
        "weights": [0.5, None, None],
        "grid": [[1, 2], [3, 4]],
        "count": 4,
        "flag": True,
        "nested": {"scores": [1.0, None, [2, None]], "3": {"deep": 1.5}},
        "when": "2026-12-01",
        "other": "/data/x",
    }


# -- 10. max_completion_tokens: null ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields, asked",
    [
        ({"max_completion_tokens": None, "max_tokens": 5}, 5),
        ({"max_completion_tokens": 3, "max_tokens": 5}, 3),
        ({"max_completion_tokens": None, "max_tokens": None}, MAX_COMPLETION_LENGTH),
    ],
)
def test_a_null_max_completion_tokens_leaves_max_tokens_in_charge(make_setup, tok, fields, asked):
    replies = Replies(tok, ["one two three four five six seven eight nine ten"])
    s = make_setup(replies)
    trace = s.rig.open()
    answer = httpx.post(
        s.rig.base_url + "/chat/completions",
        json={"model": "m", "messages": QUESTION, **fields},
        headers={"Authorization": f"Bearer {trace.token}"},
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    assert [n for _, n in replies.requests] == [asked] and s.fake.bodies[0]["max_tokens"] == asked
    if asked < MAX_COMPLETION_LENGTH:
        assert answer.json()["usage"]["completion_tokens"] == asked
        assert answer.json()["choices"][0]["finish_reason"] == "length"


# -- 11. replies that parse alike -------------------------------------------------------------------------------
def test_two_replies_that_parse_alike_are_each_rendered_as_their_own_sampled_text(make_setup, tok):
    first = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    second = '<tool_call>\n{"arguments": {"b": 2, "a": 1}, "name": "add"}\n</tool_call>'  # the same call
    s = make_setup(Replies(tok, [first, second, ANSWER]))
    trace, client = s.opened()
    messages: list[dict[str, Any]] = list(QUESTION)
    for _ in range(2):
        reply = client.chat.completions.create(model="m", messages=messages, tools=TOOLS).choices[0].message
        assert reply.tool_calls and reply.tool_calls[0].function.name == "add"
        resent = reply.model_dump(exclude_none=True)
        call_id = resent["tool_calls"][0]["id"]
        messages += [resent, {"role": "tool", "tool_call_id": call_id, "content": "3"}]
    assert api.reply_key(messages[1]) == api.reply_key(messages[3])  # one key, two sampled texts
    assert trace.replies[api.reply_key(messages[1])] == [first, second]
    final = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    assert final.choices[0].message.content == ANSWER
    t1, t2, t3 = trace.turns
    assert t2.prompt_ids[: len(t1.prompt_ids) + len(t1.output_ids)] == t1.prompt_ids + t1.output_ids
    assert t3.prompt_ids[: len(t2.prompt_ids) + len(t2.output_ids)] == t2.prompt_ids + t2.output_ids
    text = tok.decode(t3.prompt_ids)
    assert text.index(first) < text.index(second)  # each in its own place
    samples, _ = rollout_to_sequences(trace_rollout(trace), num_topk=0)
    assert len(samples) == 1


# -- 12. the scorer and unscored rollouts -----------------------------------------------------------------------
def test_reward_functions_see_only_the_scored_rollouts():
    calls: list[int] = []

    def answer_matches(completions, solution, **kwargs):
        """Reads each completion's last message: raises on an empty completion."""
        assert len(solution) == len(completions)
        calls.append(len(completions))
        return [float(c[-1]["content"] == s) for c, s in zip(completions, solution)]

    def group(completions: list[list[dict[str, str]]], unscored: list[str | None]) -> RolloutGroup:
        rollouts = [
            Rollout(
                completion=c,
                completion_ids=[10 + i] if c else [],
                turns=[TurnRecord(prompt_ids=[1, 2], output_ids=[10 + i], output_log_probs=[-0.5])]
                if c
                else [],
                unscored=u,
            )
            for i, (c, u) in enumerate(zip(completions, unscored))
        ]
        return RolloutGroup(
            prompts=[[{"role": "user", "content": "1 plus 2?"}]] * len(rollouts),
            reward_kwargs={"solution": ["3", "3", "3", "3"][: len(rollouts)]},
            completions=[r.completion for r in rollouts],
            completions_ids=[r.completion_ids for r in rollouts],
            completions_sequences=[rollout_to_sequences(r, num_topk=0)[0] for r in rollouts],
            model_version=1,
            group_id=1,
            row_index=0,
            rollout_rewards=[None] * len(rollouts),
            rollouts=rollouts,
        )

    scorer = GroupScorer(
        ScorerContext([RewardFunction("answer_matches", answer_matches, False)], MetricWindow(), None, None)
    )
    said = [[{"role": "assistant", "content": x}] for x in ("3", "4", "3")]
    g = group([said[0], [], said[1], said[2]], [None, "exited with status 1", None, None])
    scored = asyncio.run(scorer.score(g))
    assert calls == [3]  # once, with the three scored rollouts
    np.testing.assert_allclose(g.rewards, [1.0, np.nan, 0.0, 1.0])
    assert scored.drop_reason is None and len(scored.samples) == 3
    calls.clear()
    everyone_failed = group([[], []], ["timeout", "timeout"])
    assert asyncio.run(scorer.score(everyone_failed)).drop_reason == "zero_std"
    assert calls == []  # not called at all


# -- 13. harness/sampling_s -------------------------------------------------------------------------------------
def test_sampling_s_is_logged_per_rollout(make_setup, tok):
    s = make_setup(always(tok))
    s.fake.completion_delay_s = 0.25
    talker = s.runner(["python", AGENTS, "two-turn"])
    silent = s.runner(["true"])
    s.run(talker, {"prompt": "What is 1 plus 2?"}, bound=SLACK_S)
    s.run(silent, {"prompt": "What is 1 plus 2?"}, bound=SLACK_S)

    async def items() -> dict[str, list[float]]:
        return s.rig.metrics.to_payload()["items"]

    logged = s.rig.call(items())
    (talked, quiet), (d_talked, _) = logged["harness/sampling_s"], logged["harness/duration_s"]
    assert 2 * 0.25 <= talked < d_talked  # its two requests waited on the server, within its run
    assert quiet == 0.0
