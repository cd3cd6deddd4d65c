"""The ``asyncgrpo`` command line. Thin: parses the verb, hands Hydra the rest, never imports torch at startup."""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from pathlib import Path

from asyncgrpo_cli import __version__
from asyncgrpo_cli.errors import RunFailure, UserError
from asyncgrpo_cli.interrupts import Terminated, interruptible, surfaced

USAGE = f"""asyncgrpo {__version__}: asynchronous RL post-training of LLMs (async GRPO, async on-policy distillation),
configured with Hydra.

usage: asyncgrpo VERB [OVERRIDES...]

verbs:
  train     train with async GRPO. `asyncgrpo train` runs the offline quickstart; `+recipe=NAME` picks a recipe,
            `key=value` overrides any knob, `-m` runs a Hydra multirun sweep (a,b,c values).
  distill   async on-policy distillation: the student generates, teacher servers score its tokens, the loss is a
            generalized JSD over their top-k. `asyncgrpo distill` runs the offline distillation quickstart.
  check     compose and validate the config, print the plan; starts nothing. `--explain GROUP` documents a group.
  serve     run the embedded generation server on the configured model (vLLM-compatible API subset).
  plugins   list the registered plugins (rewards, losses, packers, servers, weight sync, rollout loops, ...).
  bench     benchmarks: `asyncgrpo bench trainer-overhead [OVERRIDES]`, `asyncgrpo bench embedded-server`,
            `asyncgrpo bench trainer [KEY=VALUE]` (tokens/s, MFU, memory; torchrun for several GPUs),
            `asyncgrpo bench attention [KEY=VALUE]` (flex attention kernel options on packed rows).

examples:
  asyncgrpo train
  asyncgrpo train +recipe=tiny trainer.max_steps=3
  asyncgrpo train +recipe=deepmath loss.epsilon=0.28 rollout.max_staleness=2
  asyncgrpo train -m +recipe=tiny rollout.max_staleness=0,2 loss.epsilon=0.2,0.28
  asyncgrpo distill
  asyncgrpo distill +recipe=gsm8k_distill loss.beta=0.5 teacher.top_k=32
  asyncgrpo check +recipe=deepmath
  asyncgrpo check --explain sampling
"""

EXIT_USER_ERROR = 2
"""A mistake the user can fix (config, data, checkpoint, server URL, a busy run directory): ``UserError``."""
EXIT_FAILED = 1
"""The run failed otherwise (a crashed process, a reward function that raised, a lost server, a bug)."""
_failures: list[tuple[str, int]] = []
"""(job, exit status) of each failed Hydra job; its message was printed once, when it failed."""


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return
    if argv[0] in ("-V", "--version"):
        print(__version__)
        return
    verb, rest = argv[0], argv[1:]
    handlers = {
        "train": _train,
        "distill": _distill,
        "check": _check,
        "serve": _serve,
        "plugins": _plugins,
        "bench": _bench,
    }
    handler = handlers.get(verb)
    if handler is None:
        _die(f"unknown verb {verb!r}; verbs: {', '.join(handlers)} (asyncgrpo --help)")
    try:
        handler(rest)
    except UserError as e:
        _die(str(e))
    except KeyboardInterrupt:
        _exit_now("interrupted", code=130)
    except Terminated:
        _exit_now("terminated (SIGTERM); the run's processes were stopped", code=143)


def _die(message: str, code: int = 2) -> None:
    print(f"asyncgrpo: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _exit_now(message: str, code: int) -> None:
    """Ctrl-C or SIGTERM: the run's ``finally`` has stopped everything it started; end the process without the
    interpreter's teardown of torch and friends (3 s of a Ctrl-C on a busy 2-core machine)."""
    import atexit

    print(f"asyncgrpo: error: {message}", file=sys.stderr)
    try:
        atexit._run_exitfuncs()  # what a normal exit runs first (logging, multiprocessing's semaphores, ...)
    except BaseException:  # noqa: BLE001 - a second Ctrl-C here must not keep the process alive
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


# ---------------------------------------------------------------------------------------------------- train
def _train(args: list[str]) -> None:
    _run_jobs(args, "grpo")


def _distill(args: list[str]) -> None:
    _run_jobs(args, "distill")


def _run_jobs(args: list[str], algorithm: str) -> None:
    """``train`` (grpo) and ``distill``: the same jobs, each verb composing its own primary config."""
    from asyncgrpo_cli.config.compose import (
        PRIMARY_CONFIGS,
        VERBS,
        algorithm_of,
        precheck,
        with_default_recipe,
    )
    from asyncgrpo_cli.config.store import register_schemas
    from asyncgrpo_cli.paths import conf_dir

    verb = VERBS[algorithm]

    if any(a in ("-h", "--help") for a in args):
        print(USAGE)
        print(
            "Hydra options: --cfg job (print the composed config), --info, -m/--multirun, hydra.run.dir=DIR"
        )
        return
    precheck(args)
    algorithm_of(args, algorithm)  # a recipe of the other verb: say which verb runs it
    args = with_default_recipe(args, algorithm)
    register_schemas()
    _quiet_libraries()
    args = _torchrun_run_dir(args)
    import hydra

    saved = sys.argv
    sys.argv = [f"asyncgrpo {verb}", *args]
    _stacks_on_sigusr1()
    try:
        main_fn = hydra.main(
            config_path=str(conf_dir()), config_name=PRIMARY_CONFIGS[algorithm], version_base=None
        )
        with interruptible():
            main_fn(_train_job)()
    finally:
        sys.argv = saved
    if _failures:
        codes = {code for _, code in _failures}
        code = EXIT_USER_ERROR if codes == {EXIT_USER_ERROR} else EXIT_FAILED
        if len(_failures) == 1 and not _multirun(args):
            raise SystemExit(code)  # its one message is out already
        _die(f"{len(_failures)} job(s) failed: {', '.join(job for job, _ in _failures)}", code=code)


def _stacks_on_sigusr1() -> None:
    """``kill -USR1 PID`` prints the Python stack of every thread of a run to stderr and the run goes on: where
    a run that seems stuck is waiting (faulthandler writes from the signal handler, so a thread blocked in C
    code is shown too)."""
    import faulthandler

    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


def _multirun(args: list[str]) -> bool:
    return "-m" in args or "--multirun" in args


def _torchrun_run_dir(args: list[str]) -> list[str]:
    """Under torchrun every rank runs Hydra: give them one run dir (rank 0's is used in any case)."""
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or any(a.startswith("hydra.run.dir=") for a in args):
        return args
    if "-m" in args or "--multirun" in args:
        raise UserError(
            "Hydra multirun sweeps cannot run under torchrun: launch one torchrun per configuration."
        )
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT", "dist")
    return [*args, f"hydra.run.dir=outputs/${{now:%Y-%m-%d}}/torchrun-{run_id}"]


def _quiet_libraries() -> None:
    """Keep the console for the run's own view: no per-request HTTP logs, no download/shard progress bars."""
    import os

    # Trainer, server and rollout process share the cores: spinning OpenMP workers collapse throughput when
    # another process holds a core (measured: 9.5 vs 120 tok/s on 2 cores). torch is not imported yet here.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def _train_job(dcfg) -> None:
    """One Hydra job: validate, write resolved.yaml, train. Failures are recorded so a sweep's other jobs run."""
    from hydra.core.hydra_config import HydraConfig

    from asyncgrpo_cli.config.store import write_resolved
    from asyncgrpo_cli.config.validate import to_root_config

    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    label = f"job {hc.job.num}" if hc.mode is not None and str(hc.mode).endswith("MULTIRUN") else "run"
    log = logging.getLogger("asyncgrpo")
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)  # Hydra's logging setup resets levels
    from asyncgrpo_cli.metrics.console import route_terminal_logging

    route_terminal_logging()  # on a terminal, log lines print through rich, above the live view
    import os

    main_rank = int(os.environ.get("RANK", "0")) == 0
    if not main_rank:
        logging.getLogger().setLevel(logging.WARNING)  # one rank speaks
    from contextlib import nullcontext

    from asyncgrpo_cli.train.lock import run_dir_lock

    try:
        # an interrupt that C++ code reported as an error (torch's writers) stops the run and a sweep as itself
        with surfaced():
            cfg = to_root_config(dcfg)
            run_dir.mkdir(parents=True, exist_ok=True)
            with run_dir_lock(run_dir) if main_rank else nullcontext():  # one training per run directory
                if main_rank:
                    write_resolved(cfg, run_dir / "resolved.yaml")
                from asyncgrpo_cli.train.run import run_train

                state = run_train(cfg, run_dir)
        log.info("finished: %d steps, model version %d, run dir %s", state.step, state.model_version, run_dir)
    except UserError as e:
        _job_failed(label, run_dir, str(e), EXIT_USER_ERROR)
    except Exception as e:  # a bug or a failed process: one line here, the traceback in error.log
        _job_failed(
            label, run_dir, str(e) if isinstance(e, RunFailure) else f"{type(e).__name__}: {e}", EXIT_FAILED
        )


def _job_failed(label: str, run_dir: Path, message: str, code: int) -> None:
    """Print the failure once (``asyncgrpo: error: ...``), keep the traceback in ``RUN_DIR/error.log``, and
    record it so a sweep's other jobs run and the process exits with the documented status."""
    from asyncgrpo_cli.train.lock import RunDirBusyError

    error = sys.exc_info()[1]
    where = ""
    if not isinstance(error, RunDirBusyError):  # that directory belongs to the training that holds it
        details = traceback.format_exc()
        remote = getattr(error, "remote_traceback", "")
        if remote:
            details += f"\n--- rollout process traceback ---\n{remote}"
        rank = int(os.environ.get("RANK", "0"))
        log_path = run_dir / ("error.log" if rank == 0 else f"error-rank{rank}.log")
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            log_path.write_text(f"asyncgrpo: error: {message}\n\n{details}")
            where = f" (traceback: {log_path})" if code != EXIT_USER_ERROR else ""
        except OSError:
            print(details, file=sys.stderr)  # nowhere to keep it
    prefix = f"{label} ({run_dir}): " if label != "run" else ""
    print(f"asyncgrpo: error: {prefix}{message}{where}", file=sys.stderr)
    _failures.append((f"{label} ({run_dir})", code))


# ---------------------------------------------------------------------------------------------------- check
def _check(args: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    from asyncgrpo_cli.config.compose import compose_config
    from asyncgrpo_cli.config.plan import explain_group, plan_lines

    console = Console()
    if "--explain" in args:
        i = args.index("--explain")
        if i + 1 >= len(args):
            raise UserError("--explain needs a group name, e.g. `asyncgrpo check --explain sampling`")
        group = args[i + 1]
        try:
            rows = explain_group(group)
        except KeyError:
            from asyncgrpo_cli.config.store import GROUPS

            raise UserError(f"no config group {group!r}; groups: {', '.join(GROUPS)}") from None
        table = Table(title=f"config group {group}", show_lines=False, expand=True)
        with_choices = any(choices for _, _, choices, _ in rows)
        table.add_column("key", no_wrap=True)
        for col, ratio in (("default", 1), *([("choices", 1)] if with_choices else []), ("meaning", 3)):
            table.add_column(col, overflow="fold", ratio=ratio)
        for key, default, choices, help_text in rows:
            table.add_row(key, default, *([choices] if with_choices else []), help_text)
        console.print(table)
        return
    probe = "--probe-server" in args
    args = [a for a in args if a != "--probe-server"]
    cfg = compose_config(args)
    table = Table(title="asyncgrpo plan (nothing was started)", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("plan", overflow="fold")
    rows = plan_lines(cfg)
    from asyncgrpo_cli.model.layers_plan import linear_attention_line

    linear = linear_attention_line(cfg.model, cfg.trainer.device)  # torch-free: reads config.json if on disk
    if linear is not None:
        at = next((i + 1 for i, (what, _) in enumerate(rows) if what == "model"), len(rows))
        from rich.markup import escape

        rows.insert(at, (linear[0], escape(linear[1])))  # "asyncgrpo[gpu]" is no style tag
    for what, plan in rows:
        table.add_row(what, plan)
    console.print(table)
    if (
        cfg.rollout.has_agents
    ):  # tools and environments resolve, pickle and have schemas (imports transformers)
        from asyncgrpo_cli.rollout.agent.environments import load_environments
        from asyncgrpo_cli.rollout.agent.tools import check_unique, load_tools

        check_unique(load_tools(list(cfg.rollout.tools)))
        load_environments(cfg.rollout.environment_factory)
    if cfg.rollout.harness.enabled:  # the program exists and is executable (what train checks at startup)
        from asyncgrpo_cli.rollout.agent.startup import check_harness_command

        check_harness_command(list(cfg.rollout.harness.command), cfg.rollout.harness.cwd)
    if probe:
        _probe(cfg)
    console.print("[green]config OK[/green]")


def _probe(cfg) -> None:
    """Check the external server against the run's needs (``server/probe.py``); raises UserError with the fix."""
    from asyncgrpo_cli import registry
    from asyncgrpo_cli.server.backends import backend_class
    from asyncgrpo_cli.server.control import ServerControl
    from asyncgrpo_cli.server.probe import probe_server

    for line in registry.resolve("rollout_loop", cfg.rollout.loop).probe(cfg):  # e.g. distillation's teachers
        print(line)
    preview = backend_class(cfg.server).probe_preview(cfg)  # a server that train starts: nothing runs yet
    if preview is not None:
        print(preview)
        return
    control = ServerControl(cfg.server.base_url, cfg.server.timeout)
    try:
        control.wait_ready(cfg.server.startup_timeout)
        r = probe_server(control, cfg)
        print(
            f"server {cfg.server.base_url}: model {r.model_ids[0]!r}, max_model_len {r.max_model_len}, "
            f"vLLM {r.version or '-'}, logprobs mode {r.logprobs_mode or '?'}, max_logprobs {r.max_logprobs}, "
            f"worker extension {'yes' if r.has_extension else 'no'}: every capability the run needs is there"
        )
    finally:
        control.close()


# ---------------------------------------------------------------------------------------------------- serve
def _serve(args: list[str]) -> None:
    from asyncgrpo_cli.config.compose import compose_config
    from asyncgrpo_cli.model.resolve import resolve_model_path

    cfg = compose_config(args)
    emb = cfg.server.embedded
    if emb.port == 0:
        emb.port = 8000
    model_dir = resolve_model_path(cfg.model.name_or_path)
    from asyncgrpo_cli.embedded.app import run_server

    print(f"asyncgrpo: serving {model_dir} on http://{emb.host}:{emb.port} (Ctrl-C stops)", flush=True)
    run_server(model_dir, emb, served_model_name=cfg.model.served_model_name)


# ---------------------------------------------------------------------------------------------------- plugins
def _plugins(args: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    from asyncgrpo_cli import registry

    table = Table(title="asyncgrpo plugins (select by name; user code by 'module:object')")
    for col in ("kind", "name", "config key", "what it does"):
        table.add_column(col, overflow="fold")
    for kind in registry.KINDS:
        for spec in registry.specs(kind):
            table.add_row(kind, spec.name, registry.CONFIG_KEYS[kind], spec.summary)
    Console().print(table)


# ---------------------------------------------------------------------------------------------------- bench
def _bench(args: list[str]) -> None:
    benches = {
        "trainer-overhead": "asyncgrpo_cli.bench.trainer_overhead:main",
        "embedded-server": "asyncgrpo_cli.bench.embedded_server:main",
        "lm-head": "asyncgrpo_cli.bench.lm_head:main",
        "distill-loss": "asyncgrpo_cli.bench.distill_loss:main",
        "packing": "asyncgrpo_cli.bench.packing:main",
        "trainer": "asyncgrpo_cli.bench.trainer:main",
        "attention": "asyncgrpo_cli.bench.attention:main",
        "weight-sync": "asyncgrpo_cli.bench.weight_sync:main",
        "prefix-reuse": "asyncgrpo_cli.bench.prefix_reuse:main",
        "planning": "asyncgrpo_cli.bench.planning:main",
        "transport": "asyncgrpo_cli.bench.transport:main",
        "scatter": "asyncgrpo_cli.bench.scatter:main",
        "optimizer": "asyncgrpo_cli.bench.optimizer:main",
    }
    if not args or args[0] not in benches:
        raise UserError(f"asyncgrpo bench NAME [OVERRIDES]; benchmarks: {', '.join(benches)}")
    from asyncgrpo_cli.registry import _import_target

    _import_target(benches[args[0]], kind="benchmark", where="asyncgrpo bench")(args[1:])


if __name__ == "__main__":
    main()
