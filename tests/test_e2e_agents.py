"""Agent training end to end, the way users run it: ``asyncgrpo train ...`` in a subprocess.

Three runs point at a scripted ``FakeVllmServer`` (``server=vllm server.base_url=...``): the fake reads each prompt
with the tiny tokenizer and answers the first turn with a tool call, the next with a plain answer, so the tool
loop, the environments and their rewards are checked on known replies (its log-probs are made up:
``server.verify_sync=false``). One run is the real path, ``+recipe=tools_tiny`` on the embedded server. A tool
that cannot reach the rollout process (a lambda, a closure) fails at startup naming ``rollout.tools[i]``.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.rollout.client import CompletionClient, SamplingParams, ServerRequestError
from tests.helpers.fake_server import FakeVllmServer, completion_tokens

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
ENVS = "tests.helpers.agent_envs:"
USER = "<|im_start|>user\n"
TOOL = "<|im_start|>tool\n"


def call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def launch(run: Path, *overrides: str, timeout: float) -> subprocess.CompletedProcess:
    """``asyncgrpo train`` in a subprocess (``hydra.run.dir=run``), from the repository root."""
    args = [sys.executable, "-m", "asyncgrpo_cli", "train", "logging.console=plain", f"hydra.run.dir={run}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [*args, *overrides], capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env
    )


def with_rollouts(rows: list[dict]) -> list[dict]:
    """The logging windows in which rollouts finished (a step may train only samples already queued: its row then
    carries no ``rollout/*`` or ``tools/*`` metric); at least one."""
    out = [r for r in rows if "rollout/turns_mean" in r]
    assert out, rows
    return out


def train(run: Path, *overrides: str, timeout: float = 150) -> list[dict]:
    """A run that must succeed in 3 steps; its metrics.jsonl rows."""
    proc = launch(run, *overrides, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    return rows


def against(srv: FakeVllmServer) -> list[str]:
    """Overrides of a tools run served by the fake: only the environment's tools and reward."""
    return [
        "+recipe=tools_tiny",
        "server=vllm",
        f"server.base_url={srv.base_url}",
        "server.verify_sync=false",
        "rollout.tools=[]",
        "rewards.funcs=[]",
        "sampling.max_completion_length=192",  # two scripted calls fit
    ]


class Scripted:
    """The fake's ``reply``: a plain answer after a tool result, else ``first(task_text, k)`` (the k-th first turn);
    non-chat prompts get the fake's default tokens. Records (prompt, output) per request. A reply longer than
    ``max_tokens`` raises (the fake answers 400 and the run fails) instead of being cut into a reply without
    calls."""

    def __init__(self, tok, first):
        self.tok = tok
        self.first = first
        self.eos = tok.eos_token_id
        self.count = itertools.count()
        self.lock = threading.Lock()
        self.log: list[tuple[list[int], list[int]]] = []

    def __call__(self, prompt_ids: list[int], max_tokens: int) -> list[int] | None:
        with self.lock:
            text = self.tok.decode(prompt_ids)
            if USER not in text:
                return None
            task = text.rsplit(USER, 1)[1]
            reply = "Done." if TOOL in task else self.first(task, next(self.count))
            out = self.tok.encode(reply) + [self.eos]
            if (
                len(out) > max_tokens
            ):  # the fake would cut it ("length"): the script is wrong, say so (HTTP 400)
                raise ValueError(
                    f"a scripted reply of {len(out)} tokens does not fit max_tokens={max_tokens}"
                )
            self.log.append((list(prompt_ids), out))
            return out

    def decoded(self) -> list[str]:
        return [self.tok.decode(p) for p, _ in self.log]


def test_the_fake_answers_scripted_replies_through_the_client():
    def reply(prompt_ids, max_tokens):
        if prompt_ids == [9]:
            raise KeyError("no script for [9]")
        return None if prompt_ids == [8] else [5, 6, 2]

    async def ask(srv, prompt, max_tokens):
        client = CompletionClient(srv.base_url, srv.model, timeout=10.0, max_retries=2, max_connections=2)
        try:
            return await client.complete(prompt, SamplingParams(max_tokens=max_tokens, num_logprobs=1), None)
        finally:
            await client.close()

    with FakeVllmServer(reply=reply, eos_token_id=2) as srv:
        stop = asyncio.run(ask(srv, [1], 8))
        assert (stop.output_ids, stop.finish_reason, len(stop.output_log_probs)) == ([5, 6, 2], "stop", 3)
        cut = asyncio.run(ask(srv, [1], 2))
        assert (cut.output_ids, cut.finish_reason) == ([5, 6], "length")
        default = asyncio.run(ask(srv, [8], 4))
        assert (default.output_ids, default.finish_reason) == (completion_tokens([8], 4), "length")
        with pytest.raises(ServerRequestError, match="HTTP 400.*the fake's reply script raised KeyError"):
            asyncio.run(ask(srv, [9], 4))
        assert srv.requests["/v1/completions"] == 4  # the broken script is not retried


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_increment_env_against_a_scripted_server(tok, tmp_path):
    def first(task: str, k: int) -> str:
        target = int(re.search(r"Increment the counter by (\d+)\.", task).group(1))
        return call("increment", step=target + 1 if k % 3 == 0 else target)  # every third one is wrong

    script = Scripted(tok, first)
    with FakeVllmServer(reply=script, eos_token_id=tok.eos_token_id, max_model_len=2048) as srv:
        rows = train(tmp_path / "run", *against(srv))
        assert srv.rpc_calls and srv.weight_version == "v3"  # the weights reached the (fake) server
    for r in with_rollouts(rows):
        assert r["tools/call_frequency"] == 1 and r["tools/failure_frequency"] == 0
        assert r["rollout/turns_mean"] == 2 and r["tools/loop_exhausted_frac"] == 0
        assert r["rollout/fork_frac"] == 0 and r["rollout/samples_per_rollout"] == 1
    for r in rows:
        assert r["batch/trained_tokens_per_step"] > 0
    means = [r["rewards/IncrementEnv/mean"] for r in with_rollouts(rows)]
    assert 0 < sum(means) / len(means) < 1, means
    # One sample per rollout: both replies trained, nothing else.
    later = [TOOL in tok.decode(p).rsplit(USER, 1)[1] for p, _ in script.log]
    firsts = [entry for entry, is_later in zip(script.log, later) if not is_later]
    seconds = [entry for entry, is_later in zip(script.log, later) if is_later]
    assert firsts and seconds
    per_rollout = set()
    for p2, o2 in seconds:  # each later prompt extends a first prompt + its reply, then the tool result
        (p1, o1), *_ = [(p, o) for p, o in firsts if p + o == p2[: len(p) + len(o)]]
        step = json.loads(tok.decode(o1, skip_special_tokens=True).split("\n")[1])["arguments"]["step"]
        assert tok.decode(p2[len(p1) + len(o1) :]).startswith(f"\n{TOOL}{step}<|im_end|>")
        per_rollout.add(len(o1) + len(o2))
    for r in rows:
        assert min(per_rollout) <= r["sample/trained_tokens_mean"] <= max(per_rollout)


def test_each_environment_lists_only_its_own_tools(tok, tmp_path):
    def first(task: str, k: int) -> str:
        if "Write code that prints" in task:
            return call("run_code", code="print(42)" if k % 2 else "print(41)")
        assert "Reach tile 2" in task, task
        return call("move", action="right") * (2 if k % 2 else 1)

    script = Scripted(tok, first)
    with FakeVllmServer(reply=script, eos_token_id=tok.eos_token_id, max_model_len=2048) as srv:
        rows = train(
            tmp_path / "run",
            *against(srv),
            f"rollout.environment_factory={{coding: {ENVS}CodingEnv, game: {ENVS}GameEnv}}",
            "++data.columns={environment: coding}",  # ++: data.columns is an empty dict in the schema
            "data.mix=[{columns: {environment: game}}]",
        )
    prompts = script.decoded()
    game = [p for p in prompts if "Reach tile 2 by calling move." in p]
    coding = [p for p in prompts if "Write code that prints 42." in p]
    assert game and coding and len(game) + len(coding) == len(prompts)
    assert all('"name": "move"' in p and '"name": "run_code"' not in p for p in game)
    assert all('"name": "run_code"' in p and '"name": "move"' not in p for p in coding)
    seen = {k for r in rows for k in r}
    assert {"tools/run_code/call_count", "tools/move/call_count"} <= seen
    for name in ("CodingEnv", "GameEnv"):  # each environment's get_reward scored its own rollouts, half right
        means = [r[f"rewards/{name}/mean"] for r in rows if f"rewards/{name}/mean" in r]
        assert means and 0 < sum(means) / len(means) < 1, (name, means)
    for r in with_rollouts(rows):
        assert r["tools/failure_frequency"] == 0 and r["tools/unknown_name_count"] == 0
        assert r["rollout/turns_mean"] == 2


def test_tools_tiny_on_the_embedded_server(tmp_path):
    rows = train(tmp_path / "run", "+recipe=tools_tiny", timeout=240)
    for r in with_rollouts(rows):
        assert r["env/reset_s"] >= 0 and r["env/reward_s"] >= 0
        assert r["tools/call_frequency"] >= 0 and r["rollout/turns_mean"] >= 1
        assert "rewards/IncrementEnv/mean" in r
    assert all(r["batch/trained_tokens_per_step"] > 0 for r in rows)


@pytest.mark.parametrize("tool", ["lambda_tool", "closure_tool", "nested_tool"])
def test_an_unpicklable_tool_fails_at_startup_with_its_key(tool):
    from asyncgrpo_cli.config.compose import compose_config
    from asyncgrpo_cli.rollout.agent.startup import check_agents

    cfg = compose_config(
        ["+recipe=tools_tiny", f"rollout.tools=[calculator, tests.helpers.agent_tools:{tool}]"]
    )
    with pytest.raises(UserError, match=r"rollout\.tools\[1\] .*cannot be pickled into the rollout process"):
        check_agents(cfg, dataset=None, tokenizer_path="unused: the tools fail first")


def test_train_refuses_a_lambda_tool_before_any_rollout(tmp_path):
    with FakeVllmServer(max_model_len=2048) as srv:
        args = [*against(srv), "rollout.tools=[tests.helpers.agent_tools:lambda_tool]"]
        proc = launch(tmp_path / "run", *args, timeout=120)
        assert srv.requests["/v1/completions"] == 0  # refused before the rollout process started
    assert proc.returncode != 0
    assert (
        "rollout.tools[0] ('tests.helpers.agent_tools:lambda_tool'): a lambda cannot be pickled"
        in proc.stderr
    )


def test_the_reference_curriculum_skips_solved_prompts_through_filter_prompt(tmp_path):
    """Reference p.3 through the hooks: epoch 1 scores every prompt, epoch 2 skips those whose pass rate reached
    the cap; skipped prompts still count as consumed, so the epoch-based run ends."""
    run = tmp_path / "run"
    proc = launch(
        run,
        "+recipe=tiny",
        "rollout.loop=tests.helpers.curriculum:CurriculumRolloutLoop",
        "+rollout.loop_options={pass_rate_cap: 0.5, pass_threshold: 0.99}",
        "rewards.funcs=[tests.helpers.curriculum:even_rows_solved]",
        "trainer.max_steps=-1",
        "trainer.num_train_epochs=2",
        "data.num_examples=16",
        "data.shuffle=false",
        "trainer.save_steps=0",
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    filtered = sum(r.get("rollout/filtered_prompt_count", 0) or 0 for r in rows)
    scored = sum(r.get("rollout/groups_scored_count", 0) or 0 for r in rows)
    # even rows are solved in epoch 1 (pass rate 1 >= 0.5): epoch 2 skips exactly those 8
    assert filtered == 8 and scored == 24, (filtered, scored)
