"""Multi-turn agent rollouts: tool calls, tools, environments, chat templates, the episode loop.

Everything here runs in the spawned, CPU-only rollout process (no torch), except ``startup`` (the trainer
process, before the spawn):

- ``tool_calls``: reads the calls out of a sampled reply (the Hermes / Qwen3 ``<tool_call>`` format);
- ``tools``: ``rollout.tools`` as callable, schema-carrying ``Tool`` objects, and one turn's calls run in order;
- ``environments``: ``rollout.environment_factory`` resolved, routed per row, pooled; ``reset`` / ``get_reward``;
- ``templates``: the shipped prefix-preserving training templates (ChatML, Qwen3) and the prefix check;
- ``episode``: the tool loop, ``AsyncRolloutLoop.generate_one``'s default (turns, limits, metrics);
- ``startup``: the checks ``AsyncRolloutLoop.prepare`` runs, and the chat template choice.

A turn's tokens become samples in ``rollout/sequences.py`` (extend or fork); environment rewards are a reward
source of ``rollout/scorers/grpo.py``.
"""
