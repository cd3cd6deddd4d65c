"""Async on-policy distillation (``asyncgrpo distill``): the teacher client, the teacher probe, the JSD loss and
the rollout loop that scores each student completion with its row's teacher.

Everything else (rollout process, staleness pacing, planner, FSDP2 trainer, weight sync, checkpoints, metrics) is
the machinery ``asyncgrpo train`` uses; the distillation config group (``conf/distill.yaml``) picks these parts.
"""
