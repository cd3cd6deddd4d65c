"""``sync/writer.write_full_state`` (checkpoints' HF model, the disk weight sync): the safetensors shards it
writes hold the state dict, and a write interrupted part-way (Ctrl-C, a failed gather) returns at once instead
of waiting on its writer thread for items that never come (it waited PUT_TIMEOUT_S, 600 s, before)."""

from __future__ import annotations

import itertools
import json
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from asyncgrpo_cli.sync import writer
from asyncgrpo_cli.train.distributed import DistInfo


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def test_the_shards_hold_the_state_dict(model, tmp_path):
    out = tmp_path / "weights"
    writer.write_full_state(model, DistInfo(), out)
    index = json.loads((out / writer.INDEX_NAME).read_text())
    loaded = {}
    for shard in sorted(set(index["weight_map"].values())):
        loaded.update(load_file(str(out / shard)))
    expected = {k: v for k, v in model.state_dict().items() if k not in writer.tied_skip(model)}
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)


def test_an_interrupted_write_returns_at_once(model, tmp_path, monkeypatch):
    full = writer.iter_full_state

    def interrupted(model, info, skip=None):
        yield from itertools.islice(full(model, info, skip), 3)
        raise KeyboardInterrupt  # what a Ctrl-C between two tensors looks like to the producer

    monkeypatch.setattr(writer, "iter_full_state", interrupted)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        writer.write_full_state(model, DistInfo(), tmp_path / "weights")
    assert time.monotonic() - t0 < writer.ABORT_JOIN_S
    assert not (tmp_path / "weights" / writer.INDEX_NAME).exists()  # never published as complete
    assert not [t for t in threading.enumerate() if t.name == "safetensors-writer"]
