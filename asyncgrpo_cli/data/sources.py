"""Dataset plugins and prompt preparation.

A dataset plugin is ``load(cfg: DataConfig) -> datasets.Dataset`` with a prompt column. ``prepare_dataset``
checks the prompt column, normalizes string prompts to one user message, and adds the optional system prompt,
so the rollout process only ever sees conversational prompts.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

from asyncgrpo_cli import registry
from asyncgrpo_cli.config.schema import DataConfig
from asyncgrpo_cli.errors import UserError

log = logging.getLogger(__name__)

_LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def load_hf(cfg: DataConfig):
    """A Hugging Face dataset: a hub id, a directory saved with ``save_to_disk``, or local data files."""
    import datasets

    if not cfg.path:
        raise UserError(
            "data.path is required with data.source=hf: give a hub id (e.g. trl-lib/DeepMath-103K) "
            "or a local .jsonl/.json/.parquet/.csv file or directory."
        )
    path = Path(cfg.path).expanduser()
    try:
        if path.is_dir() and (path / "dataset_info.json").is_file():
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[cfg.split]
        elif path.is_file():
            fmt = _LOCAL_FORMATS.get(path.suffix)
            if fmt is None:
                raise UserError(
                    f"data.path {cfg.path!r}: unsupported file type {path.suffix!r}; "
                    f"use one of {', '.join(_LOCAL_FORMATS)}."
                )
            if _is_empty_file(path):
                raise _empty(cfg, "is an empty file")
            ds = datasets.load_dataset(fmt, data_files=str(path), split="train")
        else:
            ds = datasets.load_dataset(cfg.path, cfg.name, split=cfg.split)
    except UserError:
        raise
    except StopIteration as e:  # the json builder on empty data files (a directory of them)
        raise _empty(cfg, "holds only empty data files") from e
    except Exception as e:  # the datasets library raises many types; the user needs the key and the cause
        if path.exists() and "corresponds to no data" in str(
            e
        ):  # e.g. a .json holding [] or a bare csv header
            raise _empty(cfg, "holds no rows") from e
        raise UserError(
            f"data.path {cfg.path!r} (split {cfg.split!r}) could not be loaded: {type(e).__name__}: {e}"
        ) from e
    if cfg.num_examples is not None and cfg.num_examples < len(ds):
        log.warning(
            "data.num_examples=%d keeps only the first %d of the %d rows of data.path %r (a recipe may set it: "
            "+recipe=tiny does); set data.num_examples=null to train on every row.",
            cfg.num_examples,
            cfg.num_examples,
            len(ds),
            cfg.path,
        )
        ds = ds.select(range(cfg.num_examples))
    return ds


def _is_empty_file(path: Path) -> bool:
    """No bytes, or (a text format) nothing but whitespace."""
    size = path.stat().st_size
    if size == 0 or path.suffix not in (".json", ".jsonl", ".csv"):
        return size == 0
    with path.open("rb") as f:
        return not any(chunk.strip() for chunk in iter(lambda: f.read(1 << 16), b""))


def _empty(cfg: DataConfig, what: str) -> UserError:
    return UserError(
        f"data.path {cfg.path!r} {what}: the dataset is empty. Put prompts in it (a {cfg.prompt_column!r} "
        "column), or point data.path at another file."
    )


_TINY_WORDS = ["one", "two", "three", "four", "five", "apples", "numbers", "count", "letters", "words"]


def load_tiny_task(cfg: DataConfig):
    """Toy prompts for the tiny random model: the ``digits`` reward gives every group a spread of rewards."""
    import datasets

    rng = random.Random(cfg.seed)
    n = cfg.num_examples or 64
    rows = []
    for i in range(n):
        words = " ".join(rng.choice(_TINY_WORDS) for _ in range(rng.randint(2, 6)))
        rows.append(
            {"prompt": [{"role": "user", "content": f"write numbers about {words} {i}"}], "task_id": i}
        )
    return datasets.Dataset.from_list(rows)


ENVIRONMENT_ROWS = 1024


def load_environment_rows(cfg: DataConfig):
    """``data.source=environment``: rows without a prompt (``num_examples`` of them, default 1024), for
    environments whose ``reset`` returns the task. The stream cycles over them, so ``trainer.max_steps`` sets the
    run's length; ``data.columns`` may add constant columns (``environment`` to route)."""
    import datasets

    n = cfg.num_examples or ENVIRONMENT_ROWS
    return datasets.Dataset.from_dict({"prompt": [[] for _ in range(n)], "episode": list(range(n))})


def load_dataset_for(cfg: DataConfig):
    loader = registry.resolve("dataset", cfg.source)
    return loader(cfg)


def _normalize_prompt(prompt: Any, system_prompt: str | None, row: int, column: str) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt
    ):
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    else:
        raise UserError(
            f"data.prompt_column {column!r}: row {row} holds {type(prompt).__name__} "
            f"{str(prompt)[:80]!r}; expected a string or a list of {{role, content}} messages."
        )
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def prepare_dataset(ds, cfg: DataConfig, prompt_optional: bool = False):
    """Check the prompt column and return a dataset whose ``prompt`` column is conversational.

    A string prompt is wrapped as one user message (documented in the README). Other columns are kept: they
    reach reward functions as keyword arguments. ``prompt_optional`` (environments, whose ``reset`` returns the
    task): a dataset without the prompt column gets empty prompts.
    """
    column = cfg.prompt_column
    if column not in ds.column_names and prompt_optional and len(ds):
        ds = ds.add_column("prompt", [[] for _ in range(len(ds))])
        column = "prompt"
    if column not in ds.column_names:
        raise UserError(
            f"data.prompt_column {column!r} is not a column of the dataset (columns: "
            f"{', '.join(ds.column_names)}); set data.prompt_column to the column holding the prompts."
        )
    if len(ds) == 0:
        raise UserError(
            f"the dataset from data.source={cfg.source} (path {cfg.path!r}, split {cfg.split!r}) is empty."
        )
    if column != "prompt":
        if "prompt" in ds.column_names:
            ds = ds.remove_columns("prompt")
        ds = ds.rename_column(column, "prompt")
    system = cfg.system_prompt
    first = ds[0]["prompt"]
    needs_map = bool(system) or isinstance(first, str)
    # Validate a sample of rows eagerly so a bad column fails before any process starts.
    for i in range(min(len(ds), 8)):
        _normalize_prompt(ds[i]["prompt"], system, i, column)
    if needs_map:
        ds = ds.map(
            lambda row, idx: {"prompt": _normalize_prompt(row["prompt"], system, idx, column)},
            with_indices=True,
            desc="formatting prompts",
        )
    return ds


def _with_columns(ds, cfg: DataConfig):
    """``data.columns``: constant columns added to every row (replacing a column of that name)."""
    for name, value in cfg.columns.items():
        if name == "prompt":
            raise UserError(
                "data.columns cannot set 'prompt': name the prompt column with data.prompt_column."
            )
        if name in ds.column_names:
            ds = ds.remove_columns(name)
        ds = ds.add_column(name, [value] * len(ds))
    return ds


def _part(cfg: DataConfig, i: int, entry: Any) -> DataConfig:
    import dataclasses

    if not hasattr(entry, "keys"):
        raise UserError(
            f"data.mix[{i}] is {entry!r}: give a mapping of data keys, e.g. {{path: ..., columns: ...}}."
        )
    fields = {f.name for f in dataclasses.fields(DataConfig)} - {"mix"}
    for key in entry:
        if key not in fields:
            import difflib

            close = difflib.get_close_matches(str(key), sorted(fields), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise UserError(f"data.mix[{i}].{key} is not a data setting{hint}")
    changes = dict(entry)
    changes.setdefault("columns", {})  # a part's constant columns are its own
    return dataclasses.replace(cfg, mix=[], **changes)


def load_prompts(cfg: DataConfig, prompt_optional: bool = False):
    """Load the configured dataset (and every ``data.mix`` part after it), prepare its prompts, add the
    ``data.columns``. With parts, only the columns every part has are kept. ``prompt_optional``: see
    ``prepare_dataset``."""
    parts = [cfg, *(_part(cfg, i, e) for i, e in enumerate(cfg.mix))]
    loaded = [_with_columns(prepare_dataset(load_dataset_for(p), p, prompt_optional), p) for p in parts]
    if len(loaded) == 1:
        return loaded[0]
    import datasets

    shared = [c for c in loaded[0].column_names if all(c in d.column_names for d in loaded[1:])]
    for i, d in enumerate(loaded):
        dropped = [c for c in d.column_names if c not in shared]
        if dropped:
            log.info("data part %d: dropping columns the other parts lack: %s", i, ", ".join(dropped))
    loaded = [d.select_columns(shared) for d in loaded]
    try:
        return datasets.concatenate_datasets(loaded)
    except ValueError as e:
        raise UserError(
            f"data.mix: the parts cannot be concatenated ({e}); give their shared columns one type."
        ) from e


def load_gsm8k(cfg: DataConfig):
    """GSM8K (``openai/gsm8k``, config ``main``, or data.path): ``question`` is the prompt, and the number after
    ``####`` in ``answer`` becomes the ``solution`` column the accuracy reward reads."""
    import dataclasses

    ds = load_hf(dataclasses.replace(cfg, path=cfg.path or "openai/gsm8k", name=cfg.name or "main"))
    for column in ("question", "answer"):
        if column not in ds.column_names:
            raise UserError(
                f"data.source=gsm8k expects GSM8K's 'question' and 'answer' columns; {cfg.path or 'openai/gsm8k'} "
                f"has {', '.join(ds.column_names)}: use data.source=hf with data.prompt_column instead."
            )

    def convert(row):
        return {
            "prompt": row["question"],
            "solution": row["answer"].split("####")[-1].strip().replace(",", ""),
        }

    return ds.map(convert, remove_columns=[c for c in ("question",) if c in ds.column_names], desc="gsm8k")


class PromptOrder:
    """Maps a prompt's position in the run's stream (``prompt_seq``) to a dataset row.

    ``prompt_seq = epoch * n + k``; row = the k-th index of epoch ``epoch``'s permutation (seeded by seed and
    epoch), so the order is reproducible across resumes without storing it.
    """

    def __init__(self, num_rows: int, seed: int, shuffle: bool):
        self.num_rows = num_rows
        self.seed = seed
        self.shuffle = shuffle
        self._cache: dict[int, list[int]] = {}

    def epoch_order(self, epoch: int) -> list[int]:
        order = self._cache.get(epoch)
        if order is None:
            order = list(range(self.num_rows))
            if self.shuffle:
                random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._cache = {epoch: order}
        return order

    def row_index(self, prompt_seq: int) -> tuple[int, int]:
        epoch, k = divmod(prompt_seq, self.num_rows)
        return epoch, self.epoch_order(epoch)[k]
