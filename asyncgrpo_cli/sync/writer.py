"""Writing the full model as HF safetensors shards with bounded memory, from one or many (FSDP2) ranks.

Every rank gathers full tensors in lockstep on the training thread (``iter_full_state``); rank 0 hands them to a
writer thread through a 2-deep queue and the writer closes a shard file each time the decoder layer changes, so
peak extra memory is about two layers whatever the model size. An index (``model.safetensors.index.json``) maps
every tensor to its shard, as ``from_pretrained``, vLLM's loader and the embedded server expect. A LoRA model
is written with its adapter merged in (``model.lora.merged_items``): a plain model, whatever trains.
"""

from __future__ import annotations

import json
import queue
import re
import threading
from pathlib import Path
from typing import Any

from asyncgrpo_cli.model.loading import checkpoint_name
from asyncgrpo_cli.model.lora import merged_items
from asyncgrpo_cli.train.distributed import DistInfo, iter_full_state

INDEX_NAME = "model.safetensors.index.json"
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_DONE = object()
PUT_TIMEOUT_S = 600.0
ABORT_JOIN_S = 5.0
"""How long an interrupted write (Ctrl-C, an error in the gather) waits for the writer thread to notice."""


def _shard_key(name: str) -> str:
    m = _LAYER.search(name)
    return f"layer{m.group(1)}" if m else "other"


def tied_skip(model: Any) -> set[str]:
    """``lm_head.weight`` is the embedding when embeddings are tied: write it once (vLLM and HF re-tie on load)."""
    return {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()


class _ShardWriter(threading.Thread):
    def __init__(self, out_dir: Path, items: queue.Queue):
        super().__init__(name="safetensors-writer", daemon=True)
        self.out_dir = out_dir
        self.items = items
        self.error: BaseException | None = None
        self.weight_map: dict[str, str] = {}
        self.total_size = 0
        self.aborted = threading.Event()
        """Set when the producer stops early: no more items come, so the writer ends without writing more."""

    def run(self) -> None:
        from safetensors.torch import save_file

        current: dict[str, Any] = {}
        key: str | None = None
        index = 0
        try:
            while not self.aborted.is_set():
                try:
                    item = self.items.get(timeout=0.2)
                except queue.Empty:
                    continue
                name, tensor = (None, None) if item is _DONE else item
                new_key = None if item is _DONE else _shard_key(name)
                if current and (item is _DONE or new_key != key):
                    index += 1
                    fname = f"model-{index:05d}.safetensors"
                    save_file(current, str(self.out_dir / fname), metadata={"format": "pt"})
                    self.weight_map.update({n: fname for n in current})
                    current = {}
                if item is _DONE:
                    return
                key = new_key
                current[name] = tensor
                self.total_size += tensor.numel() * tensor.element_size()
        except BaseException as e:  # surfaced to the training thread
            self.error = e


def write_full_state(model: Any, info: DistInfo, out_dir: Path) -> None:
    """Write the model's full weights into ``out_dir`` (rank 0); every rank must call this (collectives)."""
    skip = tied_skip(model)
    if not info.is_main:
        for _ in iter_full_state(model, info, skip):
            pass
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    items: queue.Queue = queue.Queue(maxsize=2)
    writer = _ShardWriter(out_dir, items)
    writer.start()
    done = False
    try:
        for name, tensor in merged_items(model, iter_full_state(model, info, skip)):  # LoRA: merged weights
            _put(items, (checkpoint_name(model, name), tensor), writer)
        _put(items, _DONE, writer)
        done = True
    finally:
        if (
            not done
        ):  # interrupted (Ctrl-C, a failed gather): the writer must not wait for items that never come
            writer.aborted.set()
        writer.join(PUT_TIMEOUT_S if done else ABORT_JOIN_S)
    if writer.error is not None:
        raise RuntimeError(f"writing weights to {out_dir} failed: {writer.error}") from writer.error
    if writer.is_alive():
        raise TimeoutError(f"writing weights to {out_dir} did not finish within {PUT_TIMEOUT_S:.0f}s")
    index = {"metadata": {"total_size": writer.total_size}, "weight_map": writer.weight_map}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2))


def _put(items: queue.Queue, item: Any, writer: _ShardWriter) -> None:
    waited = 0.0
    while True:
        if writer.error is not None or not writer.is_alive():
            return  # the error is raised after join
        try:
            items.put(item, timeout=1.0)
            return
        except queue.Full:
            waited += 1.0
            if waited > PUT_TIMEOUT_S:
                raise TimeoutError("the safetensors writer stopped taking tensors") from None
