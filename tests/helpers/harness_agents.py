"""Harness programs for the tests of ``rollout.harness``: one standalone script (standard library only), the
behaviour chosen by its first argument::

    rollout.harness.command=[python, tests/helpers/harness_agents.py, two-turn]

It talks to ``$OPENAI_BASE_URL`` with ``$OPENAI_API_KEY`` and model ``$ASYNCGRPO_MODEL`` (what the runner sets),
reads the dataset row as one JSON object from standard input (to its end: the runner closes it) and builds its
first prompt from the row's ``prompt`` (a string, or a list of messages). Requests carry no ``max_tokens``: the
proxy's default (``sampling.max_completion_length``) applies.

Modes (a "reward line" is the last stdout line ``{"reward": R}`` with ``R = (len(text) % 3) / 2`` of the final
answer's text: 0.0, 0.5 or 1.0, deterministic for a deterministic policy):

- ``two-turn``: chat twice; the second request re-sends the first reply plus the user message
  ``"Check your answer."``; a reward line on the second reply;
- ``completions``: two ``/v1/completions`` requests, the second's prompt is the first's prompt plus its text; a
  reward line on the second text;
- ``hang``: one chat request, then sleeps forever;
- ``stubborn``: ``hang`` that also ignores SIGTERM (only SIGKILL stops it);
- ``crash``: one chat request, then raises (exit status 1, a traceback on stderr);
- ``exit3``: one chat request, then exit status 3;
- ``killed``: one chat request, then kills itself with SIGKILL;
- ``garbage``: one chat request, then prints binary / non-JSON lines last; exit 0;
- ``bad-reward``: one chat request, then the last line ``{"reward": "high"}``; exit 0;
- ``stale``: one chat request, then forks a child in its own process group and exits 0 after a reward line
  ``{"reward": 1.0}``; the child ignores SIGTERM, waits until its parent is gone plus ``STALE_DELAY_S``, then keeps
  sending chat requests with the same token (one ``status`` event per answer) until it is killed;
- ``late``: starts a chat request in a daemon thread, waits ``LATE_WAIT_S`` (the request is at the proxy), prints
  ``{"reward": 1.0}`` and exits 0 without waiting for the answer;
- ``spawn-sleeper``: starts a grandchild ``sleep 1000`` in its process group, prints ``{"reward": 0.5}`` and
  exits 0 (the runner must kill the sleeper);
- ``no-stdin``: never reads standard input; one chat request with a fixed prompt, ``{"reward": 1.0}``, exit 0.

Optional environment (``rollout.harness.env``):

- ``HARNESS_AGENTS_LOG``: a file each process appends JSON lines to: ``{"event": "start", "pid", "pgid", "t",
  "mode", "row", "env"}`` first (``row`` is None for ``no-stdin``; ``env`` the three variables above), ``{"event":
  "child", "pid", "child"}`` for every process it starts, ``{"event": "status", "pid", "code"}`` for every answer the
  ``stale`` child gets, and ``{"event": "end", "pid", "t"}`` just before a normal exit;
- ``HARNESS_AGENTS_HOLD_S``: seconds to sleep before exiting (``two-turn``, ``completions``), e.g. to observe how
  many harnesses run at once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

STALE_DELAY_S = 0.2
"""How long the ``stale`` child waits after its parent exited before its first request."""
LATE_WAIT_S = 0.3
"""How long ``late`` waits after starting its request (long enough for it to reach the proxy)."""
ENV_KEYS = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "ASYNCGRPO_MODEL")


def log(event: str, **fields: object) -> None:
    path = os.environ.get("HARNESS_AGENTS_LOG")
    if not path:
        return
    line = json.dumps({"event": event, "pid": os.getpid(), **fields}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def post(route: str, body: dict) -> tuple[int, dict]:
    """POST ``body`` to the proxy; (status, JSON answer) also for an error status."""
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + route,
        data=json.dumps({"model": os.environ["ASYNCGRPO_MODEL"], **body}).encode(),
        headers={
            "Authorization": "Bearer " + os.environ["OPENAI_API_KEY"],
            "Content-Type": "application/json",
        },
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def chat(messages: list[dict]) -> dict:
    status, answer = post("/chat/completions", {"messages": messages})
    if status != 200:
        raise RuntimeError(f"chat request answered {status}: {answer}")
    return answer["choices"][0]["message"]


def complete(prompt: str) -> str:
    status, answer = post("/completions", {"prompt": prompt})
    if status != 200:
        raise RuntimeError(f"completion request answered {status}: {answer}")
    return answer["choices"][0]["text"]


def first_messages(row: dict) -> list[dict]:
    prompt = row.get("prompt", "Say hello.")
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def reward_line(text: str) -> None:
    print(json.dumps({"reward": (len(text or "") % 3) / 2}), flush=True)


def hold() -> None:
    time.sleep(float(os.environ.get("HARNESS_AGENTS_HOLD_S") or 0))


def sleep_forever() -> None:
    while True:
        time.sleep(3600)


def stale_child(parent: int, messages: list[dict]) -> None:
    """The ``stale`` child: outlive the parent, then keep using its token."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while os.getppid() == parent:
        time.sleep(0.01)
    time.sleep(STALE_DELAY_S)
    while True:
        try:
            status, _ = post("/chat/completions", {"messages": messages})
        except OSError as e:  # the proxy is gone
            status = f"error: {e}"
        log("status", code=status)
        time.sleep(0.05)


def main() -> int:
    mode = sys.argv[1]
    row = None if mode == "no-stdin" else json.loads(sys.stdin.read())
    log(
        "start",
        pgid=os.getpgrp(),
        t=time.time(),
        mode=mode,
        row=row,
        env={k: os.environ.get(k) for k in ENV_KEYS},
    )
    messages = first_messages(row or {})
    if mode == "two-turn":
        reply = chat(messages)
        final = chat([*messages, reply, {"role": "user", "content": "Check your answer."}])
        hold()
        reward_line(final.get("content") or "")
    elif mode == "completions":
        prompt = "\n".join(m.get("content") or "" for m in messages)
        text = complete(prompt)
        text2 = complete(prompt + text)
        hold()
        reward_line(text2)
    elif mode in ("hang", "stubborn"):
        if mode == "stubborn":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        chat(messages)
        sleep_forever()
    elif mode == "crash":
        chat(messages)
        raise RuntimeError("the agent crashed on purpose")
    elif mode == "exit3":
        chat(messages)
        print("giving up", file=sys.stderr)
        return 3
    elif mode == "killed":
        chat(messages)
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "garbage":
        chat(messages)
        sys.stdout.flush()
        sys.stdout.buffer.write(b'{"reward": 1.0}\n\x00\xff\xfe\x80 binary \x9c\n{not json at all\n')
        sys.stdout.buffer.flush()
    elif mode == "bad-reward":
        chat(messages)
        print(json.dumps({"reward": "high"}))
    elif mode == "stale":
        chat(messages)
        parent = os.getpid()
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            try:
                stale_child(parent, messages)
            finally:
                os._exit(0)
        log("child", child=pid)
        print(json.dumps({"reward": 1.0}))
    elif mode == "late":
        threading.Thread(target=chat, args=(messages,), daemon=True).start()
        time.sleep(LATE_WAIT_S)
        print(json.dumps({"reward": 1.0}))
        log("end", t=time.time())
        sys.stdout.flush()
        os._exit(0)  # the request is still waiting for its answer
    elif mode == "spawn-sleeper":
        sleeper = subprocess.Popen(["sleep", "1000"])
        log("child", child=sleeper.pid)
        print(json.dumps({"reward": 0.5}))
    elif mode == "no-stdin":
        chat([{"role": "user", "content": "Say hello."}])
        print(json.dumps({"reward": 1.0}))
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    log("end", t=time.time())
    return 0


if __name__ == "__main__":
    sys.exit(main())
