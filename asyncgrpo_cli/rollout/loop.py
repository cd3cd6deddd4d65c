"""``AsyncRolloutLoop``: generates and scores rollouts inside the spawned rollout process. Default = GRPO.

The loop generates; it neither decides when a group may start nor what a group is worth:

- *admission* (``rollout/admission.py``) lets a group start while the server link is healthy, the in-flight
  rollouts fit the adaptive cap and the trainer's token allowance permits; a server lost for longer than
  ``server.timeout`` fails the process there;
- *scoring* (``rollout/scorers/``, picked by ``scorer_name``, default ``grpo``) turns a finished group into
  stamped samples or a drop.

Per prompt: ``filter_prompt`` decides whether to generate; ``generate_one`` runs ``num_generations`` times
(the multi-turn tool loop of ``rollout/agent/episode.py``, calling ``generate_one_turn`` per sampling request; one
turn when the rollout has no tools; inside an environment instance when ``rollout.environment_factory`` is set,
``rollout/agent/environments.py``; or, with ``rollout.harness.command``, one run of the agent program
against the recording proxy, ``rollout/harness/``); once the whole group has finished it waits on the
score queue, the scorer scores it (calling ``compute_advantages``), and its samples go on the rollout queue, or a
``PromptResolved`` marker when it yields none. ``setup`` / ``close`` create and release resources on the loop's
event loop (``close`` also runs on failure).

Subclass it and select it with ``rollout.loop=my_module:MyLoop``; ``rollout.loop_options`` reaches the hooks as
``self.options``. Subclasses must be importable at module level (the process is spawned).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncgrpo_cli import registry
from asyncgrpo_cli.data.sources import PromptOrder
from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.rollout.admission import Admission
from asyncgrpo_cli.rollout.agent.environments import EnvironmentPool, load_environments, run_in_environment
from asyncgrpo_cli.rollout.agent.episode import EpisodeLimits, ToolLoop
from asyncgrpo_cli.rollout.agent.tool_calls import tool_call_parser
from asyncgrpo_cli.rollout.agent.tools import Tool, load_tools
from asyncgrpo_cli.rollout.client import CompletionClient, SamplingParams
from asyncgrpo_cli.rollout.concurrency import ConcurrencyController, MetricsPoller
from asyncgrpo_cli.rollout.generation_metrics import record_completions, record_rollout, record_sampling_mask
from asyncgrpo_cli.rollout.resync import ServerLink, ServerWatch
from asyncgrpo_cli.rollout.rewards import RewardFunction
from asyncgrpo_cli.rollout.scorers import ScoredGroup, ScorerContext
from asyncgrpo_cli.rollout.sequences import rollout_to_sequences
from asyncgrpo_cli.rollout.served_name import start_group
from asyncgrpo_cli.rollout.settings import RolloutSettings
from asyncgrpo_cli.sample_batch import SampleBatch
from asyncgrpo_cli.samples import PromptResolved, Rollout, RolloutDone, RolloutGroup, TurnRecord

if TYPE_CHECKING:
    from asyncgrpo_cli.rollout.harness.runner import HarnessRunner

log = logging.getLogger(__name__)

METRICS_INTERVAL_S = 1.0
HEARTBEAT_INTERVAL_S = 1.0
_CURRENT_ROW: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("asyncgrpo_current_row")
"""The dataset row of the group a rollout task belongs to (set per group; rollout tasks inherit it)."""


class AsyncRolloutLoop:
    scorer_name: str = "grpo"
    """The scorer (registry kind ``scorer``: a registered name or ``module:Class``); a subclass sets its own."""

    def __init__(
        self,
        settings: RolloutSettings,
        dataset: Any,
        reward_funcs: list[RewardFunction],
        tokenizer: Any,
        shared: Any,
    ):
        self.settings = settings
        self.config = settings
        self.options: dict[str, Any] = dict(settings.rollout.loop_options)
        self.dataset = dataset
        self.reward_funcs = reward_funcs
        self.tokenizer = tokenizer
        self.shared = shared
        self.eos_token_ids = _eos_ids(tokenizer)
        self.metrics = MetricWindow()
        self.order = PromptOrder(len(dataset), settings.data_seed, settings.shuffle)
        self._rng = random.Random((settings.sampling.seed + 1) * 7919 + settings.seed_offset)
        self._executor = ThreadPoolExecutor(
            max_workers=max(4, settings.rollout.max_concurrent_rollouts // 4), thread_name_prefix="rollout"
        )
        self._next_group_id = 0
        self._generated_tokens = 0
        self._last_report = time.monotonic()
        self.concurrency = ConcurrencyController(
            settings.rollout.max_concurrent_rollouts, adaptive=settings.rollout.adaptive_concurrency
        )
        if not settings.rollout.metrics_poll_interval_s > 0:
            raise ValueError(
                f"rollout.metrics_poll_interval_s must be > 0, got {settings.rollout.metrics_poll_interval_s}"
            )
        link = getattr(shared, "server_link", None)
        self.link = ServerLink(link) if link is not None else ServerLink()
        self.admission = Admission(
            self.link,
            self.concurrency,
            shared,
            self.metrics,
            settings.sampling.num_generations,
            settings.base_url,
            settings.server_timeout,
        )
        self.allowance = self.admission.allowance
        scorer_cls = registry.resolve("scorer", self.scorer_name)
        self.scorer = scorer_cls(ScorerContext(reward_funcs, self.metrics, self._executor, settings))
        self.client: CompletionClient | None = None
        self._warned_no_mask = False
        self.score_queue: asyncio.Queue[RolloutGroup] | None = None
        self._init_agents(settings, tokenizer)

    def _init_agents(self, settings: RolloutSettings, tokenizer: Any) -> None:
        r = settings.rollout
        if settings.prepared.get(
            "chat_template"
        ):  # the training template ``prepare`` chose for the tool loop
            tokenizer.chat_template = settings.prepared["chat_template"]
        self.tools: list[Tool] = load_tools(list(r.tools))
        """``rollout.tools``: offered to every rollout (an environment adds its own)."""
        self.environments = load_environments(r.environment_factory)
        self._tool_executor = (
            ThreadPoolExecutor(max_workers=max(1, r.max_concurrent_rollouts), thread_name_prefix="tool")
            if r.has_agents
            else None
        )  # sync tools, reset and get_reward: a slow one delays only its own rollout
        self.env_pool = EnvironmentPool(self.environments, self._tool_executor)
        limits = EpisodeLimits(
            max_model_len=settings.max_model_len,
            max_completion_length=settings.sampling.max_completion_length,
            sampling_mask=settings.sampling_mask,
            max_tool_calling_iterations=r.max_tool_calling_iterations,
            tool_timeout_s=r.tool_timeout_s,
            record_tool_metrics=r.has_agents,
        )
        decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        parser = tool_call_parser(r.tool_call_format)
        self.tool_loop = ToolLoop(limits, parser, decode, self.metrics, self._tool_executor)
        self.harness: HarnessRunner | None = None
        """``rollout.harness``: every rollout runs the agent program against the recording proxy instead."""
        if r.harness.enabled:
            from asyncgrpo_cli.rollout.harness.runner import build_harness

            self.harness = build_harness(
                settings, tokenizer, self.metrics, self.render, self.generate_one_turn
            )

    # ------------------------------------------------------------------ hooks
    @classmethod
    def prepare(
        cls, cfg: Any, run_dir: Any, stack: Any, dataset: Any, tokenizer_path: str, max_model_len: int
    ) -> dict[str, Any]:
        """Runs once in the trainer process (rank 0) before the rollout process is spawned, after the generation
        server started: start and check what the loop needs besides that server (the distillation loop starts
        and probes its teachers), registering cleanups on ``stack`` (an ``ExitStack``). The returned picklable
        dict reaches the loop as ``self.settings.prepared``. ``cfg`` is the ``RootConfig``; ``max_model_len``
        the generation server's. The default loop checks its tools and environments here (importable, picklable,
        the dataset's routing column) and picks the chat template of the tool loop (``chat_template``)."""
        if not cfg.rollout.renders_tools:
            return {}
        from asyncgrpo_cli.rollout.agent.startup import check_agents

        return {"chat_template": check_agents(cfg, dataset, tokenizer_path)}

    @classmethod
    def probe(cls, cfg: Any) -> list[str]:
        """``asyncgrpo check --probe-server``: check the loop's own servers (not the generation server); one line
        per server checked. Raises ``UserError`` with the fix."""
        return []

    async def setup(self) -> None:
        """Create resources other hooks need; runs on the loop's event loop before the first prompt."""

    async def close(self) -> None:
        """Release what ``setup`` created; runs when the loop stops, including on failure."""

    def filter_prompt(self, row_index: int, row: dict[str, Any], epoch: int) -> bool:
        """Return False to skip the prompt for this epoch (it still counts as consumed)."""
        return True

    async def generate_one(
        self, prompt: list[dict[str, str]], tools: list[Tool], group_id: int = 0
    ) -> Rollout:
        """One complete rollout: the multi-turn tool loop over ``tools`` (the trainer's plus the rollout's
        environment's; one turn when there are none). Overrides must record every sampling request in
        ``Rollout.turns``."""
        return await self.tool_loop.run(prompt, tools, self.render, self.generate_one_turn)

    async def generate_one_turn(self, prompt_ids: list[int], max_tokens: int | None = None) -> TurnRecord:
        """One sampling request with the configured sampling settings; ``max_tokens`` (a later turn near
        ``max_model_len``) lowers ``sampling.max_completion_length``."""
        s = self.settings.sampling
        params = SamplingParams(
            max_tokens=s.max_completion_length if max_tokens is None else max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            min_p=s.min_p,
            repetition_penalty=s.repetition_penalty,
            num_logprobs=self.settings.num_topk,
        )
        seed = self._rng.getrandbits(62) if s.seed_per_request else None
        assert self.client is not None, "generate_one_turn called before the loop started"
        if self.settings.sampling_mask:
            turn = await self.client.generate(prompt_ids, params, seed, s.max_mask_candidates)
            self._record_sampling_mask(turn)
        else:
            turn = await self.client.complete(prompt_ids, params, seed)
        self._generated_tokens += len(turn.output_ids)
        return turn

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """One advantage per rollout, in ``group.rewards`` order; by default the scorer's (GRPO:
        group-normalized, 0 for unscored)."""
        return self.scorer.advantages(group)

    def _record_sampling_mask(self, turn: TurnRecord) -> None:
        record_sampling_mask(self.metrics, turn)
        if turn.output_sampling_mask is None and turn.output_ids and not self._warned_no_mask:
            self._warned_no_mask = True
            log.warning(
                "%s answered without sampling masks although sampling.top_k/top_p/min_p truncate: these "
                "tokens keep biased importance ratios (is the server started with --return-sampling-mask?)",
                self.settings.base_url,
            )

    # ------------------------------------------------------------------ helpers for hooks
    @property
    def current_row(self) -> dict[str, Any]:
        """The dataset row (all its columns) of the group the calling rollout belongs to; valid inside
        ``generate_one`` and what it awaits."""
        try:
            return _CURRENT_ROW.get()
        except LookupError:
            raise RuntimeError("current_row is only set inside a group's rollouts (generate_one)") from None

    def render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> list[int]:
        """Token ids of the conversation through the chat template, with the generation prompt (and the tool
        schemas, when the rollout has tools); ``template_kwargs`` go over ``model.chat_template_kwargs``."""
        extra = {"tools": tools} if tools else {}
        kwargs = {**self.settings.chat_template_kwargs, **template_kwargs}
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, **extra, **kwargs
        )
        ids = out["input_ids"] if hasattr(out, "keys") else out
        return [int(t) for t in ids]

    # ------------------------------------------------------------------ main loop
    async def run(self) -> None:
        self.score_queue = asyncio.Queue(maxsize=self.settings.rollout.score_queue_maxsize)
        self.client = CompletionClient(
            self.settings.base_url,
            self.settings.served_model,
            self.settings.server_timeout,
            self.settings.max_retries,
            max_connections=self.settings.rollout.max_concurrent_rollouts,
            retry_budget_s=self.settings.server_timeout,
            link=self.link,
        )
        poller = MetricsPoller(
            self.settings.base_url,
            self.concurrency,
            self.metrics,
            self.settings.max_model_len,
            interval_s=self.settings.rollout.metrics_poll_interval_s,
        )
        watch = ServerWatch(self.link, self.settings.base_url)
        hb = asyncio.create_task(self._heartbeat())
        watcher = asyncio.create_task(watch.run())
        score_task: asyncio.Task | None = None
        try:
            await poller.start()
            if self.harness is not None:
                await self.harness.start()
            await self.setup()
            score_task = asyncio.create_task(self._score_loop())
            num = await self._generate_loop(score_task)
            await self._join_scorer(score_task)
            if not self._stopping():
                self.shared.rollout_buffer.put(RolloutDone(num_prompts=num))
        finally:
            for task in (score_task, hb, watcher):
                if task is not None:
                    task.cancel()
            self._report(force=True)
            try:
                await self.close()
            finally:
                if self.harness is not None:
                    await self.harness.close()
                await poller.close()
                await watch.close()
                await self.client.close()
                self._executor.shutdown(wait=False, cancel_futures=True)
                if self._tool_executor is not None:
                    self._tool_executor.shutdown(wait=False, cancel_futures=True)

    def _stopping(self) -> bool:
        return self.shared.stop_event.is_set()

    async def _heartbeat(self) -> None:
        while True:
            self.shared.heartbeat.value = time.time()
            self._report()
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    def _prompt_stream(self) -> Iterator[tuple[int, int, int]]:
        skip = set(self.settings.skip_prompt_seqs)
        seq = self.settings.dataset_start_index
        total = self.settings.total_prompts
        while total is None or seq < total:
            if seq not in skip:
                epoch, idx = self.order.row_index(seq)
                yield seq, epoch, idx
            seq += 1

    async def _generate_loop(self, scorer: asyncio.Task) -> int:
        """Start groups while slots and the token allowance permit; returns the prompts consumed."""
        groups: set[asyncio.Task] = set()
        consumed = 0
        accepted_in_epoch: dict[int, int] = {}
        pending = None
        stream = self._prompt_stream()
        while not self._stopping():
            if scorer.done():
                scorer.result()  # re-raise a scoring failure here
            if pending is None:
                pending = next(stream, None)
                if pending is None:
                    break
                seq, epoch, idx = pending
                self._check_epoch_rejections(accepted_in_epoch, epoch)
                row = self.dataset[idx]
                if not self.filter_prompt(idx, row, epoch):
                    self.shared.rollout_buffer.put(PromptResolved(seq, "filtered"))
                    self.metrics.add("rollout/filtered_prompt_count", 1)
                    consumed += 1
                    pending = None
                    continue
                accepted_in_epoch[epoch] = accepted_in_epoch.get(epoch, 0) + 1
            if self.admission.may_start():
                seq, epoch, idx = pending
                group_id = self._next_group_id
                self._next_group_id += 1
                self.admission.start(group_id)
                groups.add(asyncio.create_task(self._run_group(group_id, seq, epoch, idx, self.dataset[idx])))
                consumed += 1
                pending = None
                continue
            done, groups = await _wait_some(groups, timeout=0.05)
            for task in done:
                task.result()
        while groups and not self._stopping():
            done, groups = await _wait_some(groups, timeout=0.2)
            for task in done:
                task.result()
            if scorer.done():
                scorer.result()
        return consumed

    def _check_epoch_rejections(self, accepted: dict[int, int], epoch: int) -> None:
        prev = epoch - 1
        if prev >= 0 and prev in accepted and accepted[prev] == 0:
            raise RuntimeError(
                f"filter_prompt rejected every prompt of epoch {prev}: no batch could ever reach the trainer"
            )
        accepted.setdefault(epoch, 0)

    async def _run_group(
        self, group_id: int, seq: int, epoch: int, row_index: int, row: dict[str, Any]
    ) -> None:
        G = self.settings.sampling.num_generations
        version = int(self.shared.model_version.value)
        start_group(
            self.settings.versioned_model,
            self.settings.served_model,
            version,
            lambda: int(self.shared.model_version.value),
        )  # LoRA sync: this version's adapter name
        prompt = row["prompt"]
        _CURRENT_ROW.set(row)  # this task's context: the rollout tasks gather creates copy it
        try:
            rollouts = await asyncio.gather(*(self._timed_rollout(prompt, group_id, row) for _ in range(G)))
        finally:
            self.admission.generated()
        seqs = []
        for r in rollouts:
            samples, stats = rollout_to_sequences(r, self.settings.num_topk)
            seqs.append(samples)
            record_rollout(self.metrics, r, len(samples), stats.drift_tokens)
        extra = {k: [v] * G for k, v in row.items() if k != "prompt"}
        group = RolloutGroup(
            prompts=[r.prompt or prompt for r in rollouts],
            reward_kwargs=extra,
            completions=[r.completion for r in rollouts],
            completions_ids=[r.completion_ids for r in rollouts],
            completions_sequences=seqs,
            model_version=version,
            group_id=group_id,
            row_index=row_index,
            rollout_rewards=[r.reward for r in rollouts],
            prompt_seq=seq,
            epoch=epoch,
            rollouts=list(rollouts),
        )
        t0 = time.monotonic()
        group.queued_at = t0
        await self.score_queue.put(group)
        self.metrics.add("rollout/score_block_s", time.monotonic() - t0)

    async def _timed_rollout(
        self, prompt: list[dict[str, str]], group_id: int, row: dict[str, Any]
    ) -> Rollout:
        t0 = time.monotonic()
        if self.harness is not None:
            rollout = await self.harness.run(row)
        elif self.environments:
            rollout = await run_in_environment(
                self.env_pool,
                self.environments.kind_for(row),
                row,
                prompt,
                self.tools,
                lambda messages, tools: self.generate_one(messages, tools, group_id),
                self.metrics,
            )
        else:
            rollout = await self.generate_one(prompt, self.tools, group_id)
        self.metrics.add("rollout/duration_s", time.monotonic() - t0)
        self.concurrency.on_rollout_finished()
        return rollout

    async def _join_scorer(self, scorer: asyncio.Task) -> None:
        while not self.score_queue.empty() or self.admission.allowance.in_flight_groups:
            if scorer.done():
                scorer.result()
                return
            if self._stopping():
                return
            await asyncio.sleep(0.02)

    async def _score_loop(self) -> None:
        while True:
            group = await self.score_queue.get()
            try:
                await self._score_group(group)
            finally:
                self.score_queue.task_done()

    async def _score_group(self, group: RolloutGroup) -> None:
        self.metrics.add("rollout/score_wait_s", time.monotonic() - group.queued_at)
        scored: ScoredGroup = await self.scorer.score(group, self.compute_advantages)
        record_completions(self.metrics, group)
        now = time.time()
        for s in scored.samples:
            s.enqueued_at = now
        if scored.samples:  # one message for the group (``sample_batch.py``: ~3x less trainer CPU)
            self.shared.samples_put.value += len(scored.samples)
            self.shared.rollout_buffer.put(SampleBatch(scored.samples))
        tokens = sum(len(s) for s in scored.samples)
        if tokens == 0:
            self.shared.rollout_buffer.put(
                PromptResolved(group.prompt_seq, scored.drop_reason or "no_samples")
            )
        rollout_tokens = [sum(len(s) for s in seqs) for seqs in group.completions_sequences]
        self.admission.finish(group.group_id, rollout_tokens, tokens)
        self._report(force=True)  # the group's metrics reach the trainer with (not after) its samples

    def _report(self, force: bool = False) -> None:
        now = time.monotonic()
        elapsed = now - self._last_report
        if not force and elapsed < METRICS_INTERVAL_S:
            return
        self._last_report = now
        m = self.metrics
        m.add_rate("rollout/generated_tokens_per_s", self._generated_tokens, elapsed)
        self._generated_tokens = 0
        m.set_gauge("rollout/concurrency", self.admission.in_flight)
        m.set_gauge("rollout/concurrency_cap", self.concurrency.cap)
        if self.score_queue is not None:
            m.set_gauge("rollout/score_queue_size", self.score_queue.qsize())
        if self.client is not None and self.client.retry_count:
            m.add("rollout/vllm_retry_count", self.client.retry_count)
            self.client.retry_count = 0
        if self.client is not None and self.client.lost_count:
            m.add("rollout/server_lost_count", self.client.lost_count)
            self.client.lost_count = 0
        payload = m.take_payload()
        try:
            self.shared.metrics_queue.put_nowait(payload)
        except Exception:  # a full metrics queue must never stall generation
            pass


async def _wait_some(tasks: set[asyncio.Task], timeout: float) -> tuple[set[asyncio.Task], set[asyncio.Task]]:
    if not tasks:
        await asyncio.sleep(timeout)
        return set(), tasks
    done, pending = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    return done, pending


def _eos_ids(tokenizer: Any) -> list[int]:
    eos = tokenizer.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])
