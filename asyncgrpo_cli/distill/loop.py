"""The distillation rollout loop: the student generates one completion per prompt, the row's teacher scores it.

Deviations from the GRPO loop (``rollout/loop.py``), each a hook:

1. ``prepare`` (trainer process, before the spawn): checks that every row routes to a known teacher
   (``teacher.id_column`` under MOPD), starts the embedded teachers, probes every teacher (same tokenizer as the
   student, enough ``--max-logprobs`` and ``max_model_len``) and hands their endpoints to the loop;
2. ``generate_one``: after the sampling request, a teacher-forced scoring request to the row's teacher
   (``prompt_logprobs=teacher.top_k``, ``distill/teacher.py``) on the critical path of the rollout, so
   ``rollout/duration_s`` is the generate+score round trip; ``rollout/score_s`` and ``teacher_score_s/<id>``
   time the scoring call; the scores ride on ``Rollout.extras[TEACHER_TOPK]``;
3. the ``distill`` scorer (``rollout/scorers/distill.py``) turns them into each sample's ``teacher_topk`` extra;
   there is no group baseline (``sampling.num_generations`` is 1 in the distillation config).

Retries of scoring requests count in ``rollout/vllm_retry_count`` with the student's (logged as
``rollout/vllm_retry_total`` under the distillation metric names).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from asyncgrpo_cli.distill.servers import TeacherEndpoint, probe_external_teachers, start_teachers
from asyncgrpo_cli.errors import UserError
from asyncgrpo_cli.rollout.loop import AsyncRolloutLoop
from asyncgrpo_cli.samples import TEACHER_TOPK, Rollout

log = logging.getLogger(__name__)


def route_rows(dataset: Any, ids: tuple[str, ...], column: str) -> None:
    """MOPD: every row must name a known teacher in ``column`` (no silent fallback). One teacher: nothing to do."""
    if len(ids) < 2:
        return
    if column not in dataset.column_names:
        raise UserError(
            f"teacher.servers names {len(ids)} teachers ({', '.join(ids)}) but the dataset has no "
            f"{column!r} column (teacher.id_column) to route its rows: add it to every row (data.columns="
            f"{{{column}: {ids[0]}}} sets one for a whole dataset, data.mix for several), or keep one teacher."
        )
    known = set(ids)
    for i, value in enumerate(dataset[column]):
        if value not in known:
            raise UserError(
                f"row {i} of the dataset has {column}={value!r}, which is not a teacher in teacher.servers "
                f"(known ids: {', '.join(ids)}): fix the row's {column!r} column or add that teacher."
            )


class DistillLoop(AsyncRolloutLoop):
    scorer_name = "distill"

    @classmethod
    def prepare(
        cls, cfg: Any, run_dir: Any, stack: Any, dataset: Any, tokenizer_path: str, max_model_len: int
    ) -> dict[str, Any]:
        from asyncgrpo_cli.config.teacher import teacher_ids, teacher_servers

        ids = teacher_ids(cfg.teacher)
        route_rows(dataset, ids, cfg.teacher.id_column)
        servers = teacher_servers(cfg.teacher)
        endpoints = start_teachers(cfg, servers, run_dir, stack, tokenizer_path, dataset, max_model_len)
        return {"teachers": endpoints, "teacher_ids": ids, "teacher_config": cfg.teacher}

    @classmethod
    def probe(cls, cfg: Any) -> list[str]:
        return probe_external_teachers(cfg)

    async def setup(self) -> None:
        from asyncgrpo_cli.distill.teacher import TeacherClient

        t = self.settings.prepared
        names = tuple(t["teacher_ids"])
        tc = t["teacher_config"]  # TeacherConfig
        self.teachers = {
            e.id: TeacherClient(
                e.id,
                e.index,
                names,
                e.base_url,
                e.model,
                tc.top_k,
                tc.timeout,
                tc.max_retries,
                max_connections=self.settings.rollout.max_concurrent_rollouts,
            )
            for e in t["teachers"]
        }
        self._id_column = tc.id_column

    async def close(self) -> None:
        for client in getattr(self, "teachers", {}).values():
            await client.close()

    def teacher_for(self, row: dict[str, Any]) -> str:
        """The id of the teacher that scores ``row`` (its ``teacher.id_column`` under MOPD)."""
        if len(self.teachers) == 1:
            return next(iter(self.teachers))
        return str(row[self._id_column])

    async def generate_one(
        self, prompt: list[dict[str, str]], tools: list[Any], group_id: int = 0
    ) -> Rollout:
        rollout = await super().generate_one(prompt, tools, group_id)
        turn = rollout.turns[0]
        tid = self.teacher_for(self.current_row)
        t0 = time.monotonic()
        scores = await self.teachers[tid].score(
            list(turn.prompt_ids) + list(turn.output_ids), len(turn.prompt_ids)
        )
        elapsed = time.monotonic() - t0
        self.metrics.add("rollout/score_s", elapsed)
        self.metrics.add(f"teacher_score_s/{tid}", elapsed)
        rollout.extras[TEACHER_TOPK] = scores
        return rollout

    def _report(self, force: bool = False) -> None:
        retries = 0
        for client in getattr(self, "teachers", {}).values():
            retries += client.retry_count
            client.retry_count = 0
        if retries:
            self.metrics.add("rollout/vllm_retry_count", retries)
        super()._report(force)


__all__ = ["DistillLoop", "TeacherEndpoint", "route_rows"]
