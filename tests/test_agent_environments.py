"""Environments of agent rollouts (``rollout/agent/environments.py``): loading and routing, ``reset`` arguments and
the task it returns, the instance pool, environment tools, ``get_reward`` and its place among GRPO's reward sources.

No tokenizer, no server: ``run_in_environment`` gets a ``generate`` that stands in for the tool loop. The
environments live in ``tests/helpers/agent_envs.py``.
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from asyncgrpo_cli.environments.counter import IncrementEnv
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.rollout.agent.environments import (
    EnvironmentPool,
    load_environments,
    reset_kwargs,
    run_in_environment,
    with_task,
)
from asyncgrpo_cli.rollout.agent.tool_calls import ToolCall
from asyncgrpo_cli.rollout.agent.tools import load_tools, run_tool_calls, tool_from_callable
from asyncgrpo_cli.rollout.rewards import RewardFunction
from asyncgrpo_cli.rollout.scorers import ScorerContext
from asyncgrpo_cli.rollout.scorers.grpo import GroupScorer, environment_sources, group_advantages
from asyncgrpo_cli.samples import Rollout, RolloutGroup, TrainingSequence
from tests.helpers import agent_envs

E = "tests.helpers.agent_envs:"
KEY = "rollout.environment_factory"
nan = math.nan


@pytest.fixture(scope="module")
def executor():
    with ThreadPoolExecutor(max_workers=4, thread_name_prefix="tool") as pool:
        yield pool


def one(name: str):
    envs = load_environments(E + name)
    return envs, next(iter(envs.kinds.values()))


class Recorder:
    """A ``generate`` standing in for the tool loop: records the messages and tools of each rollout; ``calls``
    are run against the rollout's tools first (as the model would call them)."""

    def __init__(self, calls=(), gate: asyncio.Event | None = None, fail: bool = False):
        self.calls = [ToolCall(name, args) for name, args in calls]
        self.gate = gate
        self.fail = fail
        self.seen: list[tuple[list[dict], list]] = []

    async def __call__(self, messages, tools):
        self.seen.append((messages, tools))
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise RuntimeError("the tool loop broke")
        await run_tool_calls(self.calls, {t.name: t for t in tools}, None, None, None)
        return Rollout(completion=[{"role": "assistant", "content": "ok"}], completion_ids=[1], turns=[])

    def instance(self, i: int = -1):
        """The environment instance the i-th rollout ran in (its tools are bound methods)."""
        return next(t.fn.__self__ for t in self.seen[i][1] if hasattr(t.fn, "__self__"))


def run(pool, kind, gen, row=None, prompt=(), base_tools=(), metrics=None):
    return run_in_environment(
        pool,
        kind,
        row or {},
        list(prompt),
        list(base_tools),
        gen,
        MetricWindow() if metrics is None else metrics,
    )


# -- loading and routing ---------------------------------------------------------------------------------------
def test_one_factory_is_not_routed():
    envs, kind = one("GameEnv")
    assert envs and not envs.routed and list(envs.kinds) == ["GameEnv"]
    assert kind.factory is agent_envs.GameEnv and kind.key == KEY and kind.has_reward
    assert envs.kind_for({"environment": "anything"}) is kind  # a single environment ignores the column
    inc = load_environments("increment")  # a registered name
    assert inc.kinds["IncrementEnv"].factory is IncrementEnv
    fn = load_environments(E + "make_game").kinds["make_game"]  # a factory function
    assert fn.class_name == "make_game" and isinstance(fn.factory(), agent_envs.GameEnv)
    assert not load_environments(None) and not load_environments({})


def test_a_mapping_routes_rows_by_the_environment_column():
    envs = load_environments({"coding": E + "CodingEnv", "game": E + "GameEnv"})
    assert envs.routed and sorted(envs.kinds) == ["coding", "game"]
    game = envs.kind_for({"environment": "game", "episode": 3})
    assert game.factory is agent_envs.GameEnv and game.key == f"{KEY}.game" and game.class_name == "GameEnv"
    with pytest.raises(UserError, match=r"'environment' is 'chess', not one of .*coding, game"):
        envs.kind_for({"environment": "chess"})


@pytest.mark.parametrize(
    "value,message",
    [
        (E + "NoResetEnv", rf"{KEY} \(.*NoResetEnv\) has no reset method"),
        (
            E + "lambda_factory",
            r"cannot be pickled .*built in the rollout process.*not in a function or as a lambda",
        ),
        (E + "LocalEnv", r"cannot be pickled"),
        ("tests.helpers.no_such_module:Env", rf"{KEY}: cannot import module 'tests.helpers.no_such_module'"),
        (E + "NoSuchEnv", r"has no attribute 'NoSuchEnv'"),
        ("incremnt", r"unknown environment 'incremnt'. Did you mean 'increment'\?"),
        ({"game": E + "NoResetEnv"}, rf"{KEY}\.game \(.*NoResetEnv\) has no reset method"),
        ({"game": 3}, rf"{KEY}\.game must be a registered name or module:Class, got 3"),
    ],
)
def test_bad_factories_fail_with_the_key(value, message):
    with pytest.raises(UserError, match=message):
        load_environments(value)


def test_check_rows_needs_the_column_and_known_names():
    routed = load_environments({"coding": E + "CodingEnv", "game": E + "GameEnv"})
    routed.check_rows(["prompt", "environment"], lambda: ["game", "coding", "game"])
    with pytest.raises(UserError, match=r"needs an 'environment' column .*has prompt, episode.*data.columns"):
        routed.check_rows(["prompt", "episode"], lambda: [])
    with pytest.raises(
        UserError, match=r"column names chess, go, which rollout.environment_factory does not"
    ):
        routed.check_rows(["prompt", "environment"], lambda: ["go", "game", "chess"])

    def never():
        raise AssertionError("a single environment reads no column")

    load_environments(E + "GameEnv").check_rows(["prompt"], never)


# -- reset and its task -------------------------------------------------------------------------------------------
def test_reset_gets_the_columns_its_signature_accepts_never_environment():
    row = {"task": "sort", "episode": 3, "environment": "coding", "target": 5}
    assert reset_kwargs(agent_envs.TaskColumnEnv().reset, row) == {"task": "sort"}
    assert reset_kwargs(agent_envs.GameEnv().reset, row) == {}  # start is not a column: its default applies
    assert reset_kwargs(IncrementEnv().reset, row) == {"task": "sort", "episode": 3, "target": 5}  # **kwargs

    def keyword_only(*, target: int, episode: int = 0):
        return None

    assert reset_kwargs(keyword_only, row) == {"target": 5, "episode": 3}


def test_with_task_appends_to_the_last_user_message():
    _, kind = one("GameEnv")
    prompt = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Play."},
    ]
    out = with_task(prompt, "Reach tile 2.", kind)
    assert out[-1] == {"role": "user", "content": "Play.\n\nReach tile 2."} and out[:3] == prompt[:3]
    assert prompt[-1]["content"] == "Play."  # the row's prompt is not changed
    assert with_task(prompt, None, kind) == prompt
    assert with_task([], "Reach tile 2.", kind) == [{"role": "user", "content": "Reach tile 2."}]
    system_only = with_task(prompt[:1], "Go.", kind)
    assert system_only == [prompt[0], {"role": "user", "content": "Go."}]
    assert with_task([{"role": "user", "content": ""}], "Go.", kind) == [{"role": "user", "content": "Go."}]
    with pytest.raises(
        RuntimeError, match=rf"GameEnv.reset \({KEY}\) returned None and the row has no prompt"
    ):
        with_task([], None, kind)
    with pytest.raises(RuntimeError, match=r"returned int; expected str or None"):
        with_task(prompt, 3, kind)


# -- the pool -----------------------------------------------------------------------------------------------------
def test_a_later_rollout_reuses_the_instance_reset_between(executor):
    envs, kind = one("TaskColumnEnv")
    pool = EnvironmentPool(envs, executor)
    gen = Recorder()
    first = asyncio.run(run(pool, kind, gen, {"task": "one"}, [{"role": "user", "content": "Do:"}]))
    second = asyncio.run(run(pool, kind, gen, {"task": "two"}))
    env = gen.instance(0)
    assert gen.instance(1) is env and pool.created == 1 and env.resets == 2
    assert env.reset_thread.startswith("tool")  # reset ran on the tool executor
    assert first.prompt == [{"role": "user", "content": "Do:\n\none"}] and second.prompt == gen.seen[1][0]
    assert second.prompt == [{"role": "user", "content": "two"}]


def test_concurrent_rollouts_get_their_own_instances(executor):
    envs, kind = one("GameEnv")
    pool = EnvironmentPool(envs, executor)

    async def two_at_once():
        gate = asyncio.Event()
        gen = Recorder(gate=gate)
        tasks = [asyncio.create_task(run(pool, kind, gen)) for _ in range(2)]
        while len(gen.seen) < 2:
            await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(*tasks)
        return gen

    gen = asyncio.run(two_at_once())
    assert gen.instance(0) is not gen.instance(1) and pool.created == 2
    later = Recorder()
    asyncio.run(run(pool, kind, later))
    assert later.instance() in (gen.instance(0), gen.instance(1)) and pool.created == 2


def test_an_instance_that_raised_is_not_reused(executor):
    envs, kind = one("FlakyResetEnv")  # an instance's first reset raises, a reused one's would not
    pool = EnvironmentPool(envs, executor)
    for created in (1, 2):
        with pytest.raises(
            RuntimeError, match=rf"FlakyResetEnv.reset \({KEY}\) raised RuntimeError: cold start"
        ):
            asyncio.run(run(pool, kind, Recorder()))
        assert pool.created == created  # a fresh instance each time: the failed one was dropped
    envs, kind = one("RaisingRewardEnv")
    pool = EnvironmentPool(envs, executor)
    with pytest.raises(RuntimeError, match=r"RaisingRewardEnv.get_reward \(.*\) raised ZeroDivisionError"):
        asyncio.run(run(pool, kind, Recorder()))
    envs, kind = one("GameEnv")
    pool = EnvironmentPool(envs, executor)
    with pytest.raises(RuntimeError, match="the tool loop broke"):
        asyncio.run(run(pool, kind, Recorder(fail=True)))
    asyncio.run(run(pool, kind, Recorder()))
    assert pool.created == 2


def test_only_public_methods_are_tools():
    envs, kind = one("ManyMembersEnv")
    pool = EnvironmentPool(envs, None)
    a, b = agent_envs.ManyMembersEnv(), agent_envs.ManyMembersEnv()
    tools = pool.tools(a, kind)
    assert [t.name for t in tools] == ["async_look", "look"]  # not reset, get_reward, _helper, score, label
    assert [t.is_async for t in tools] == [True, False]
    assert (
        tools[1].schema["function"]["parameters"]["properties"]["direction"]["description"]
        == "Where to look."
    )
    assert tools[1].key == f"{KEY} (ManyMembersEnv.look)" and tools[1].fn.__self__ is a
    again = pool.tools(b, kind)
    assert again[1].fn.__self__ is b and again[1].schema is tools[1].schema  # schemas built once per class


def test_get_reward_sync_and_async_and_the_env_timings(executor):
    envs, kind = one("AsyncRewardEnv")
    metrics = MetricWindow()
    gen = Recorder(calls=[("ping", {}), ("ping", {})])
    rollout = asyncio.run(run(EnvironmentPool(envs, executor), kind, gen, metrics=metrics))
    assert rollout.env_reward == ("AsyncRewardEnv", 2.0)
    assert rollout.prompt == [{"role": "user", "content": "Ping as often as you like."}]
    envs, kind = one("CodingEnv")
    gen = Recorder(calls=[("run_code", {"code": "print(7)"})])
    rollout = asyncio.run(run(EnvironmentPool(envs, executor), kind, gen, {"target": 7}, metrics=metrics))
    assert rollout.env_reward == ("CodingEnv", 1.0)
    out = metrics.reduce()
    assert out["env/reset_s"] >= 0 and out["env/reward_s"] >= 0
    envs, kind = one("NoRewardEnv")
    prompt = [{"role": "user", "content": "Hi"}]
    rollout = asyncio.run(run(EnvironmentPool(envs, executor), kind, Recorder(), prompt=prompt))
    assert rollout.env_reward == ("NoRewardEnv", None)
    metrics = MetricWindow()
    envs, kind = one("TaskColumnEnv")
    rollout = asyncio.run(
        run(EnvironmentPool(envs, executor), kind, Recorder(), {"task": "t"}, metrics=metrics)
    )
    assert rollout.env_reward is None and "env/reward_s" not in metrics.reduce()


def test_each_rollout_sees_only_its_environments_tools(executor):
    envs = load_environments({"coding": E + "CodingEnv", "game": E + "GameEnv"})
    pool = EnvironmentPool(envs, executor)
    base = load_tools(["tests.helpers.agent_tools:multiply"])
    gen = Recorder()
    for name in ("game", "coding", "game", "coding"):
        row = {"environment": name}
        asyncio.run(run(pool, envs.kind_for(row), gen, row, base_tools=base))
    names = [[t.schema["function"]["name"] for t in tools] for _, tools in gen.seen]
    assert names == [["multiply", "move"], ["multiply", "run_code"]] * 2
    assert isinstance(gen.instance(1), agent_envs.CodingEnv) and pool.created == 2
    clash = [tool_from_callable(agent_envs.GameEnv().move, "rollout.tools[0]")]
    row = {"environment": "game"}
    with pytest.raises(
        UserError, match=r"rollout.tools\[0\] and .*GameEnv.move\) both define a tool named 'move'"
    ):
        asyncio.run(run(pool, envs.kind_for(row), Recorder(), row, base_tools=clash))


# -- environment rewards in GRPO scoring --------------------------------------------------------------------------
def _group(env_rewards, func_values):
    rollouts = [
        Rollout(
            completion=[{"role": "assistant", "content": str(i)}], completion_ids=[i], turns=[], env_reward=e
        )
        for i, e in enumerate(env_rewards)
    ]

    def bonus(completions, **kwargs):
        return list(func_values)

    group = RolloutGroup(
        prompts=[[{"role": "user", "content": "q"}]] * len(rollouts),
        reward_kwargs={},
        completions=[r.completion for r in rollouts],
        completions_ids=[r.completion_ids for r in rollouts],
        completions_sequences=[
            [TrainingSequence(np.arange(3), np.array([0, 1, 1], bool), np.zeros(3, np.float32))]
            for _ in rollouts
        ],
        model_version=0,
        group_id=0,
        row_index=0,
        rollout_rewards=[None] * len(rollouts),
        rollouts=rollouts,
    )
    return group, [RewardFunction("bonus", bonus, False)]


def test_get_reward_is_one_more_source_summed_with_weight_one():
    env = [("CodingEnv", 1.0), ("CodingEnv", 0.0), ("GameEnv", 1.0), ("CodingEnv", None), None]
    group, funcs = _group(env, [0.5, 0.5, 0.25, 0.0, None])
    names, sources = environment_sources(group)
    assert names == ["CodingEnv", "GameEnv"]
    np.testing.assert_array_equal(sources, [[1.0, 0.0, nan, nan, nan], [nan, nan, 1.0, nan, nan]])
    metrics = MetricWindow()
    scored = asyncio.run(GroupScorer(ScorerContext(funcs, metrics, None, settings=None)).score(group))
    # None (get_reward, or the function) leaves that source out; nothing scored the last rollout at all.
    np.testing.assert_array_equal(group.rewards, [1.5, 0.5, 1.25, 0.0, nan])
    adv = group_advantages(group.rewards)
    assert [s.advantage for s in scored.samples] == pytest.approx(list(adv)) and adv[-1] == 0.0
    out = metrics.reduce()
    assert out["rewards/CodingEnv/mean"] == pytest.approx(0.5) and out["rewards/GameEnv/mean"] == 1.0
    assert out["rewards/bonus/mean"] == pytest.approx(1.25 / 4)
    assert out["reward"] == pytest.approx(3.25 / 4)
    assert scored.samples[0].reward_func_group_std["CodingEnv"] == pytest.approx(0.5)


def test_a_group_scored_only_by_environments_keeps_its_signal():
    group, _ = _group([("GameEnv", 1.0), ("GameEnv", 0.0), ("GameEnv", None)], [])
    scored = asyncio.run(GroupScorer(ScorerContext([], MetricWindow(), None, settings=None)).score(group))
    np.testing.assert_array_equal(group.rewards, [1.0, 0.0, nan])
    assert [s.advantage for s in scored.samples] == [1.0, -1.0, 0.0]
