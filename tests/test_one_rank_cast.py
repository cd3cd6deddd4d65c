"""FSDP2 on one rank with ``trainer.one_rank_cast=foreach`` (``train/one_rank_cast.py``) against FSDP2's own
per-parameter casts: the same gradients and weights, bit for bit, over steps of two micro-batches (with and
without resharding after forward, with gradient checkpointing, after an unshard by hand), every unshard the
foreach cast's; the groups it cannot serve keep torch's path."""

from __future__ import annotations

import logging
import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from asyncgrpo_cli.config.compose import compose_config
from asyncgrpo_cli.config.schema import LossConfig, ModelConfig, PackingConfig
from asyncgrpo_cli.errors import ConfigError
from asyncgrpo_cli.model.loading import load_policy
from asyncgrpo_cli.packing.sequence import SequencePacker
from asyncgrpo_cli.train import one_rank_cast
from asyncgrpo_cli.train.distributed import DistInfo, destroy_distributed, shard_model
from asyncgrpo_cli.train.losses import ClippedLoss
from asyncgrpo_cli.train.step import forward_backward


def _torch_unshards(monkeypatch) -> list[int]:
    """Counts the calls into torch's own ``wait_for_unshard`` that find an unshard pending (the work it does)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    calls, torchs = [0], FSDPParamGroup.wait_for_unshard

    def counted(self):
        calls[0] += bool(self._all_gather_result)
        return torchs(self)

    monkeypatch.setattr(FSDPParamGroup, "wait_for_unshard", counted)
    return calls


def _train(
    model_dir, device, way: str, reshard: bool, checkpointing: bool, unshard: str | None, steps: int = 3
):
    """Per step the gradients after two micro-batches, then the weights; and how many groups got the cast.
    ``unshard``: the model unsharded by hand before the first forward (``sync`` or ``async``, as a weight gather
    would), else by FSDP2's hooks alone."""
    from asyncgrpo_cli.bench.trainer_overhead import synthetic_groups

    torch.manual_seed(0)
    cfg = ModelConfig(
        name_or_path=str(model_dir),
        dtype="float32",
        gradient_checkpointing=checkpointing,
        attn_implementation="sdpa",
    )
    try:
        model = shard_model(
            load_policy(str(model_dir), cfg, device), DistInfo(), device, "bfloat16", False, reshard, way
        )
        patched = sum("wait_for_unshard" in vars(g) for g in one_rank_cast._param_groups(model))
        if unshard == "sync":
            model.unshard()
        elif unshard == "async":
            model.unshard(async_op=True).wait()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        packer, loss_fn = SequencePacker(PackingConfig(kind="sequence")), ClippedLoss(LossConfig())
        vocab, taken = model.config.vocab_size, []
        for step in range(steps):
            for micro in range(2):
                samples = synthetic_groups(
                    np.random.default_rng(2 * step + micro), 2, 2, 8, 16, vocab=vocab, num_topk=0
                )
                for s in samples:
                    s.sampler_logprobs[s.train_mask] = -math.log(vocab)
                forward_backward(
                    model, [samples], sum(s.num_trained for s in samples), packer, loss_fn, device, 1.0
                )
            taken.append([p.grad.to_local().cpu() for p in model.parameters()])
            optimizer.step()
            optimizer.zero_grad()
        taken.append([p.detach().to_local().cpu() for p in model.parameters()])
    finally:
        destroy_distributed()
    return taken, patched


def _assert_bit_identical(monkeypatch, model_dir, device, reshard, checkpointing=False, unshard=None):
    torch_unshards = _torch_unshards(monkeypatch)
    ours, patched = _train(model_dir, device, "foreach", reshard, checkpointing, unshard)
    assert torch_unshards == [0]  # every unshard was the foreach cast's ...
    torchs, unpatched = _train(model_dir, device, "torch", reshard, checkpointing, unshard)
    assert torch_unshards[0] > 0  # ... and torch's way was taken when asked for
    assert (patched, unpatched) == (3, 0)  # two decoder layers and the root
    for step, (a, b) in enumerate(zip(ours, torchs)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"differs at {step}"


@pytest.mark.parametrize(
    "reshard,checkpointing,unshard",
    [
        (True, False, None),
        (False, False, None),
        (True, True, None),
        (True, False, "sync"),
        (False, False, "async"),
    ],
    ids=["reshard_after_forward", "kept_for_backward", "checkpointing", "unshard", "unshard_async"],
)
def test_the_foreach_cast_trains_bit_for_bit_as_fsdp2s_own(
    monkeypatch, tiny_model_dir, reshard, checkpointing, unshard
):
    _assert_bit_identical(monkeypatch, tiny_model_dir, torch.device("cpu"), reshard, checkpointing, unshard)


@pytest.mark.gpu
def test_the_foreach_cast_trains_bit_for_bit_as_fsdp2s_own_on_cuda(monkeypatch, tiny_model_dir):
    _assert_bit_identical(monkeypatch, tiny_model_dir, torch.device("cuda", 0), True)


def test_a_group_without_what_the_cast_uses_keeps_torchs_path(caplog):
    incomplete = SimpleNamespace(fsdp_params=[], mesh_info=None, device=None, device_handle=None)
    assert one_rank_cast._unsupported(incomplete) == "FSDPParamGroup has no wait_for_unshard"
    model = torch.nn.Linear(2, 2)
    model._get_fsdp_state = lambda: SimpleNamespace(_fsdp_param_group=incomplete)
    try:
        from asyncgrpo_cli.train.distributed import _single_process_group

        _single_process_group(torch.device("cpu"))
        with caplog.at_level(logging.WARNING, logger=one_rank_cast.__name__):
            assert one_rank_cast.use_foreach_cast(model) == 0
    finally:
        destroy_distributed()
    assert "stays torch's" in caplog.text and "no wait_for_unshard" in caplog.text
    assert "wait_for_unshard" not in vars(incomplete)


def test_without_a_one_rank_process_group_nothing_changes():
    assert not torch.distributed.is_initialized()
    assert one_rank_cast.use_foreach_cast(torch.nn.Linear(2, 2)) == 0


def test_the_key_takes_foreach_or_torch():
    assert compose_config(["+recipe=tiny"]).trainer.one_rank_cast == "foreach"
    assert compose_config(["+recipe=tiny", "trainer.one_rank_cast=torch"]).trainer.one_rank_cast == "torch"
    with pytest.raises(ConfigError, match=re.escape("trainer.one_rank_cast")):
        compose_config(["+recipe=tiny", "trainer.one_rank_cast=fast"])
