"""Built-in tools and environments for agent training (``rollout.tools``, ``rollout.environment_factory``).

A tool is a plain module-level function with type hints and a Google-style docstring (its schema); an environment
is a class with ``reset(**row_columns) -> str | None``, an optional ``get_reward() -> float`` and public methods
that are its tools. Register a new one in ``asyncgrpo_cli/registry.py`` (kinds ``tool`` / ``environment``);
user code needs no registration: name it by ``module:object``. The machinery that runs them is
``asyncgrpo_cli/rollout/agent/``.
"""
