"""Multi-turn agent rollouts: tool calls, tools, environments, chat templates, the episode loop.

Everything here runs in the spawned, CPU-only rollout process (no torch). ``tool_calls`` reads the calls out of
a sampled reply, ``tools`` turns ``rollout.tools`` into callable, schema-carrying ``Tool`` objects and runs a
turn's calls.
"""
