"""Server loss and weight resync: a small protocol between the rollout process and the trainer.

When the generation server dies and comes back, it serves whatever it loaded at start, not the policy being
trained. Generation must hold until the trainer has pushed the current weights again. Both processes share one
``ServerLink`` (a ``multiprocessing`` array ``[state, losses]`` under its lock):

==========  =====================================================================================================
state       meaning
==========  =====================================================================================================
``OK``      generation runs.
``LOST``    a request could not connect or its connection dropped (or a trainer push did). No group starts and
            every request (first send or retry) waits; the rollout process probes ``/health``.
``RESYNC``  the server answers again but lost the pushed weights: the trainer must push them; generation waits.
==========  =====================================================================================================

Transitions: anything -> ``LOST`` on a connection failure (rollout client or trainer push; ``losses`` counts
them). ``LOST`` -> ``OK`` when ``/health`` answers and ``GET /weight_info`` still reports a version the trainer
pushed (a network blip: the weights survived). ``LOST`` -> ``RESYNC`` when it reports ``"default"`` (what a
freshly started vLLM or embedded server says) or the route is missing. ``RESYNC`` -> ``OK`` by the trainer after a
push, only if no new loss happened meanwhile (the ``losses`` token), so a second crash during the push is never
cleared by mistake. Every wait is bounded by ``server.timeout``: a request's by the client's retry budget, and
an idle loop's (no request in flight: a trainer push found the loss) by admission (``rollout/admission.py``), which
fails the rollout process once the link has not been OK for that long. A push still owed when training ends (the
rollout process had finished, so nothing watched the server) is made by the trainer itself: it probes the server
(``settle_when_back``) for up to ``server.timeout`` after the final checkpoint, so the server ends on the last version.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import time
from collections.abc import Callable
from typing import Any

import httpx

log = logging.getLogger(__name__)

OK, LOST, RESYNC = 0, 1, 2
STATE_NAMES = {OK: "ok", LOST: "lost", RESYNC: "resync"}
DEFAULT_WEIGHT_VERSION = "default"
"""``GET /weight_info`` of a server that never received a pushed version (vLLM and the embedded server)."""


def new_link_array(ctx: Any = None) -> Any:
    """The shared ``[state, losses]`` array; create it before spawning the rollout process."""
    return (ctx or mp.get_context("spawn")).Array("q", [OK, 0], lock=True)


class ServerLink:
    """Either side's handle on the shared link state; cheap to construct around the shared array."""

    def __init__(self, array: Any = None):
        self.array = array if array is not None else new_link_array()

    @property
    def state(self) -> int:
        return int(self.array[0])

    @property
    def losses(self) -> int:
        return int(self.array[1])

    @property
    def healthy(self) -> bool:
        return self.state == OK

    @property
    def lost(self) -> bool:
        return self.state == LOST

    @property
    def resync_requested(self) -> bool:
        return self.state == RESYNC

    def mark_lost(self) -> bool:
        """A connection to the server failed. True when this call discovered the loss (the state was not LOST)."""
        with self.array.get_lock():
            new = self.array[0] != LOST
            self.array[0] = LOST
            self.array[1] += 1
        return new

    def mark_back(self, weights_kept: bool) -> int | None:
        """The server answers again; returns the new state, or None when the link was not LOST."""
        with self.array.get_lock():
            if self.array[0] != LOST:
                return None
            self.array[0] = OK if weights_kept else RESYNC
            return int(self.array[0])

    def resync_token(self) -> int | None:
        """Before a resync push: the loss count to hand to ``finish_resync`` (None when no resync is requested)."""
        with self.array.get_lock():
            return int(self.array[1]) if self.array[0] == RESYNC else None

    def finish_resync(self, token: int | None) -> bool:
        """After a successful push: back to OK unless the server was lost again since ``resync_token``."""
        if token is None:
            return False
        with self.array.get_lock():
            if self.array[0] == RESYNC and self.array[1] == token:
                self.array[0] = OK
                return True
            return False

    async def wait_healthy(self, deadline: float, poll_s: float = 0.1) -> bool:
        """Wait (asyncio) until the link is OK or ``time.monotonic()`` passes ``deadline``; True when OK."""
        while not self.healthy:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            await asyncio.sleep(min(poll_s, left))
        return True


class ServerWatch:
    """Rollout side: while the link is LOST, probe the server; once it answers, decide OK or RESYNC."""

    def __init__(self, link: ServerLink, base_url: str, interval_s: float = 0.5, timeout_s: float = 5.0):
        self.link = link
        self.base_url = base_url.rstrip("/")
        self.interval_s = interval_s
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s)
        self.restarts = 0
        """Comebacks that needed a resync (the server had lost the weights)."""

    async def close(self) -> None:
        await self._http.aclose()

    async def run(self) -> None:
        while True:
            if self.link.lost:
                await self.check_once()
            await asyncio.sleep(self.interval_s)

    async def check_once(self) -> int | None:
        """Probe once; returns the link's new state, or None when the server does not answer yet (or not LOST)."""
        try:
            health = await self._http.get("/health")
        except httpx.HTTPError:
            return None
        if health.status_code != 200:
            return None
        kept = await self.weights_kept()
        if kept is None:
            return None
        state = self.link.mark_back(kept)
        if state == RESYNC:
            self.restarts += 1
            log.warning(
                "the server at %s is back without the trained weights (restarted?): holding generation until "
                "the trainer pushes them again",
                self.base_url,
            )
        elif state == OK:
            log.warning(
                "the server at %s answers again and kept its weights; generation resumes", self.base_url
            )
        return state

    async def weights_kept(self) -> bool | None:
        """True when ``/weight_info`` reports a pushed version; False for ``"default"`` or no such route; None when
        the server stopped answering again."""
        try:
            resp = await self._http.get("/weight_info")
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return False
        try:
            version = resp.json().get("weight_version")
        except (ValueError, AttributeError):
            return False
        return version not in (None, "", DEFAULT_WEIGHT_VERSION)


def settle_when_back(
    link: ServerLink,
    base_url: str,
    resync: Callable[[], None],
    settled: Callable[[], bool],
    timeout_s: float,
    poll_s: float = 0.5,
) -> bool:
    """Blocking, for the trainer once training has ended and the rollout process no longer watches the server:
    probe a LOST server (``ServerWatch.check_once``) until it answers, call ``resync`` (the trainer's push when
    the link asks for one) until ``settled()``. False when ``timeout_s`` passes first."""

    async def probe() -> None:
        watch = ServerWatch(link, base_url)
        try:
            await watch.check_once()
        finally:
            await watch.close()

    deadline = time.monotonic() + timeout_s
    while True:
        if link.lost:
            asyncio.run(probe())
        resync()
        if settled():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def server_unreachable(exc: BaseException) -> bool:
    """A control-plane failure that means the server is gone (refused, dropped, timed out), not a refusal."""
    from asyncgrpo_cli.server.control import ServerControlError

    return isinstance(exc, ServerControlError) and isinstance(exc.__cause__, httpx.TransportError)
