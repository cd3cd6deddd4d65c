"""``trainer.compile`` (``train/compile.py``): ``auto`` resolves to on for CUDA and off for CPU, true / false still
compose from YAML and the Hydra CLI, ``asyncgrpo check`` shows the resolution, the row length is dynamic from
the first call, compile time is measured per step, and (slow) the trainer's step path compiled on CPU compiles
once for rows of every length and trains like eager. The CUDA run of the same path: tests/gpu/test_compile_gpu.py."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from asyncgrpo_cli.config.compose import compose_config
from asyncgrpo_cli.config.plan import plan_lines
from asyncgrpo_cli.config.schema import ModelConfig
from asyncgrpo_cli.config.store import resolved_yaml
from asyncgrpo_cli.config.validate import to_root_config
from asyncgrpo_cli.errors import ConfigError
from asyncgrpo_cli.metrics.reducer import MetricWindow
from asyncgrpo_cli.model.loading import load_policy
from asyncgrpo_cli.train.compile import (
    CompileCost,
    _dynamic_rows,
    compile_enabled,
    compile_meter,
    compile_plan,
    maybe_compile_decoder_layers,
)
from asyncgrpo_cli.train.trainer import Trainer

CPU = torch.device("cpu")


def test_auto_compiles_on_cuda_and_not_on_cpu():
    assert compile_enabled("auto", torch.device("cuda", 1)) is True
    assert compile_enabled("auto", "cuda:0") is True
    assert compile_enabled("auto", CPU) is False
    assert compile_enabled(True, CPU) is True  # forced on
    assert compile_enabled(False, torch.device("cuda")) is False  # forced off
    with pytest.raises(ValueError, match="trainer.compile='yes' must be auto, true or false"):
        compile_enabled("yes", CPU)


@pytest.mark.parametrize(
    "overrides,expected",
    [
        ([], "auto"),
        (["trainer.compile=auto"], "auto"),
        (["trainer.compile=true"], True),
        (["trainer.compile=false"], False),
    ],
)
def test_trainer_compile_composes_and_survives_resolved_yaml(overrides, expected):
    cfg = compose_config(["+recipe=tiny", *overrides])
    assert cfg.trainer.compile == expected and type(cfg.trainer.compile) is type(expected)
    from omegaconf import OmegaConf

    again = to_root_config(OmegaConf.create(resolved_yaml(cfg)))  # resolved.yaml gives the same config back
    assert again.trainer.compile == expected and type(again.trainer.compile) is type(expected)


@pytest.mark.parametrize(
    "value,needle",
    [
        ("'true'", "trainer.compile ('true') must be one of auto, true, false (auto compiles on CUDA, not on CPU); "
         "write trainer.compile=true unquoted"),
        ("aut", "trainer.compile ('aut') must be one of auto, true, false (auto compiles on CUDA, not on CPU); "
         "did you mean 'auto'?"),
        ("1", "trainer.compile (1) must be one of auto, true, false"),
    ],
)  # fmt: skip
def test_a_bad_compile_value_names_the_key(value, needle):
    with pytest.raises(ConfigError) as e:
        compose_config(["+recipe=tiny", f"trainer.compile={value}"])
    assert needle in str(e.value)


@pytest.mark.parametrize(
    "compile_,device,needle",
    [
        ("auto", "auto", "on if the trainer finds a CUDA device at start, off on CPU"),
        ("auto", "cuda", "on: torch.compile of each decoder layer"),
        ("auto", "cpu", "off: the decoder layers run eagerly (trainer.compile=auto, trainer.device=cpu)"),
        ("true", "cpu", "on CPU inductor builds C++ kernels"),
        ("false", "cuda", "off: the decoder layers run eagerly (trainer.compile=false, trainer.device=cuda)"),
    ],
)
def test_check_shows_what_compile_resolves_to(compile_, device, needle):
    cfg = compose_config(["+recipe=tiny", f"trainer.compile={compile_}", f"trainer.device={device}"])
    line = dict(plan_lines(cfg))["compile"]
    assert needle in line
    assert line == compile_plan(cfg.trainer.compile, device)


def test_auto_leaves_the_layers_eager_on_cpu(tiny_model_dir):
    cfg = ModelConfig(name_or_path=str(tiny_model_dir), attn_implementation="sdpa")
    model = load_policy(str(tiny_model_dir), cfg, CPU)
    assert maybe_compile_decoder_layers(model, "auto", CPU) is False
    assert not any("forward" in vars(layer) for layer in model.model.layers)


def test_the_row_length_is_dynamic_from_the_first_call():
    """A layer-shaped function (hidden [1, T, H], position ids, RoPE cos/sin, a dense mask) compiled through the
    row-length marking compiles one graph for three lengths (dynamo alone: a static graph, then a dynamic one);
    a call without autograd compiles nothing."""
    from torch._dynamo.utils import counters

    def layer(hidden, attention_mask=None, position_ids=None, position_embeddings=None):
        cos, sin = position_embeddings
        scores = (hidden @ hidden.transpose(1, 2)).masked_fill(~attention_mask[0], -1e9).softmax(-1)
        return scores @ (hidden * cos + sin) + position_ids[..., None]

    def inputs(n: int) -> tuple[tuple, dict]:
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        rope = (torch.randn(1, n, 8), torch.randn(1, n, 8))
        pos = torch.arange(n)[None].float()
        return (torch.randn(1, n, 8),), {
            "attention_mask": mask,
            "position_ids": pos,
            "position_embeddings": rope,
        }

    for marked, graphs in ((True, 1), (False, 2)):
        torch._dynamo.reset()
        before = counters["stats"]["unique_graphs"]  # a process-wide count that reset() keeps
        compiled = torch.compile(layer, backend="eager")
        forward = _dynamic_rows(compiled, layer) if marked else compiled
        for n in (5, 9, 13):
            args, kwargs = inputs(n)
            forward(*args, **kwargs)
        assert counters["stats"]["unique_graphs"] - before == graphs, marked
    with torch.no_grad():  # a probe without autograd (the weight-sync check) runs the eager forward
        args, kwargs = inputs(17)
        expected = layer(*args, **kwargs)
        assert torch.equal(_dynamic_rows(compiled, layer)(*args, **kwargs), expected)
    assert counters["stats"]["unique_graphs"] - before == 2


def test_compile_meter_measures_compiles_and_survives_dynamo_reset():
    meter = compile_meter()
    torch._dynamo.reset()  # clears dynamo's callbacks: take() registers them again
    meter.take()
    f = torch.compile(lambda x: x * 2 + 1, backend="eager")
    f(torch.ones(3))
    seconds, count, breaks = meter.take()
    assert count == 1 and seconds > 0 and breaks == ()
    f(torch.ones(3))  # cached: nothing compiles
    assert meter.take() == (0.0, 0, ())


def test_compile_meter_reports_each_new_graph_break_once_and_not_a_disabled_function():
    meter = compile_meter()
    torch._dynamo.reset()
    meter.take()
    skipped = torch.compiler.disable(lambda x: x + 1)

    def broken(x):
        x = x * 2
        torch._dynamo.graph_break()
        return skipped(x) * 3

    f = torch.compile(broken, backend="eager")
    f(torch.ones(3))
    _, count, breaks = meter.take()
    assert count >= 1 and len(breaks) == 1 and "graph_break" in breaks[0], breaks
    torch._dynamo.reset()
    f(torch.ones(3))  # compiles again, breaks for the same reasons: nothing new to report
    assert meter.take().graph_breaks == ()


def test_a_step_that_compiled_is_logged_and_every_step_records_its_compile_time(caplog):
    costs = iter(
        [CompileCost(12.5, 3), CompileCost(0.0, 0), CompileCost(0.0, 0, ("HOP: Unsafe side effect",))]
    )
    trainer = SimpleNamespace(
        window=MetricWindow(),
        _compile_meter=SimpleNamespace(take=lambda: next(costs)),
        cfg=SimpleNamespace(trainer=SimpleNamespace(compile="auto")),
        p=SimpleNamespace(state=SimpleNamespace(step=1)),
    )
    with caplog.at_level(logging.INFO, logger="asyncgrpo_cli.train.trainer"):
        Trainer._record_compile(trainer, 14.0)
        trainer.p.state.step = 2
        Trainer._record_compile(trainer, 0.5)
        trainer.p.state.step = 3
        Trainer._record_compile(trainer, 0.5)
    assert [r.getMessage() for r in caplog.records] == [
        "trainer.compile=auto: step 1 took 14.0 s, 12.5 s of it compiling (3 compile(s))",
        "trainer.compile: step 3: torch.compile broke a graph (HOP: Unsafe side effect); the code around the "
        "break runs eagerly. Run with TORCH_LOGS=graph_breaks to see where.",
    ]
    assert caplog.records[1].levelno == logging.WARNING
    reduced = trainer.window.reduce()
    # summed per window
    assert reduced["perf/compile_total_s"] == 12.5 and reduced["perf/compiles_total"] == 3


@pytest.mark.slow
def test_the_compiled_step_path_compiles_once_for_rows_of_every_length_and_trains_like_eager():
    """trainer.compile=true on CPU (inductor's C++ kernels, ~40 s on 2 cores): the first step compiles, rows of
    five more lengths compile nothing, and the losses match the eager run's."""
    from tests.helpers.compiled_steps import run_steps

    eager = run_steps(CPU, False)
    compiled = run_steps(CPU, True)
    assert len(set(compiled.lengths)) == len(compiled.lengths), compiled.lengths
    assert compiled.lengths == eager.lengths
    assert eager.graphs == [0] * len(eager.graphs)
    assert compiled.graphs[0] > 0 and compiled.graphs == [compiled.graphs[0]] * len(compiled.graphs)
    seconds, count = compiled.compiles[0]
    assert count > 0 and 0 < seconds <= compiled.step_s[0]
    assert compiled.compiles[1:] == [(0.0, 0)] * (len(compiled.lengths) - 1)
    # whole layers compiled: with the kernels package installed (transformers >= 5.25 requires it) the attention
    # modules' kernel-routing side effect broke every checkpointed layer's graph, and all of it ran eagerly
    assert compiled.graph_breaks == []
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-4, abs=1e-5)
    assert compiled.grad_norms == pytest.approx(eager.grad_norms, rel=1e-4)
    assert all(loss != 0 for loss in eager.losses) and all(g > 0 for g in eager.grad_norms)
