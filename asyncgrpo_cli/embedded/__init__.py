"""The embedded generation server: a separate process that answers the subset of vLLM's API the run uses.

Nothing in ``train/ rollout/ sync/ server/`` imports this package: they talk to it over HTTP (and NCCL) exactly
as they talk to vLLM. Its entry is ``python -m asyncgrpo_cli.embedded --config FILE`` (``__main__.py``).
"""
