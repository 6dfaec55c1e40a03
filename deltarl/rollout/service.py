"""The rollout core: one vLLM engine generating the scheduler's groups, refit between steps.

The logic of ``deltarl rollout`` with no socket (the process module, deltarl/daemons/rollout.py,
gives it the scheduler as an ``Ask`` and runs it on the daemon runtime). Its loop, one engine
call at a time (so a weight update can only happen between engine steps, never during one):

    the apply agent's store holds a newer active version?
      -> update the engine from it (the worker extension reads the store under a reader lease)
         and check the digest of what the engine loaded against the manifest's model digest:
         the engine, not just the buffer, is proven bit-exact
    room for more groups (not paused, not draining, no ``sync_to`` pending)?  -> GetWork
    groups in flight?  -> one engine step; each finished group -> encoded (deltarl.rl.samples),
                          put on the scheduler's samples endpoint, then SubmitGroup by digest
    nothing to do -> wait a little

The round trips to the scheduler run beside the engine step, not between steps: the GetWork
goes out as the step starts (the groups it brings are added on the engine thread after that
step), and each finished group's submit is a task of its own that the next steps do not wait
for; a submit that waits on the reward service no longer holds the engine. Measured on two
tiny-model engines sharing one CPU (``deltarl up --model tiny --task long_tail --rollouts 2``):
in series, the rounds that stepped spent a fifth of their time on GetWork (most of it
answered "not now" by the lag gate) and over a third outside the step; beside it, ``sync``
trained 1.09-1.30x the tokens per second in two pairs of runs (``least_requests``
0.97-1.06x: on one shared core the CPU, not the waiting, bounds it).

A heartbeat task reports health (version, groups in flight, queue depth, tokens/s, the groups
held) every ``heartbeat_s``, and at once after each refit (the scheduler's answer names the
groups the new version dooms, to be stopped); the scheduler requeues the groups of an
instance that misses them, and of a restarted one (``session`` is new at every start).
Draining stops GetWork and lets the groups in flight finish; what is unfinished when the
daemon stops is handed back (a heartbeat that holds nothing) so the scheduler requeues it at
once.

Invariant: ``engine_version`` is the version whose weights every token generated since the
last update came from; the engine tags each token with it (``token_versions``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from deltarl.config import ConfigError
from deltarl.engine.daemon import DaemonContext, DaemonCore, PauseGate
from deltarl.engine.weight_store import LeaseRevoked, WeightStore
from deltarl.ops import metrics
from deltarl.reward.protocol import REWARD_UNAVAILABLE
from deltarl.rl.protocol import Beat, GetWork, Heartbeat, SubmitGroup, Work
from deltarl.rl.samples import Group, Sample, SampleError, encode_group
from deltarl.transport.blobs import BlobError
from deltarl.transport.messages import Command, Error, Ok, Reply

if TYPE_CHECKING:
    from deltarl.config.rl import RolloutConfig

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 5.0
REWARD_UNAVAILABLE_WAIT_S = 1.0
HAND_BACK_TIMEOUT_S = 2.0
MAX_REFITS = 4096

Ask = Callable[[Command, float], Awaitable[Reply]]
"""A request to the scheduler with a timeout in seconds: its reply, or TimeoutError or
ConnectionError (ControlClient.request is one)."""

PutBlob = Callable[[bytes, float], Awaitable[str]]
"""A put on the scheduler's samples endpoint with a timeout in seconds: the blob's digest, or
TimeoutError or ConnectionError (not answered), or BlobError (refused); BlobClient.put is one."""


def _differing(load: dict[str, Any]) -> str:
    """The tensors a load's report names as held otherwise than the committed digests say, as
    a clause for a message ("" when it names none)."""
    names, count = load.get("differ") or [], int(load.get("differ_count") or 0)
    if not count:
        return ""
    more = f" and {count - len(names)} more" if count > len(names) else ""
    return f" (tensors that differ: {', '.join(names)}{more})"


@dataclass
class StepTally:
    """Sums over the engine steps this daemon ran. With a cost model's terms they give what
    those steps alone should have taken (``CostModel.steps_s``); ``round_s`` is what the
    daemon's rounds around them took: the step, the round trips to the scheduler, and every
    process sharing the engine's CPUs; not refits, nor waits with nothing to step. Their
    ratio is the daemon's overhead as a cost model sees it (``deltarl bench schedule
    --real``)."""

    count: int = 0
    seqs: int = 0  # sequences each step ran, summed
    context_tokens: int = 0  # their context (prompt and tokens so far), summed
    round_s: float = 0.0

    def add(self, seqs: int, context_tokens: int, round_s: float) -> None:
        self.count += 1
        self.seqs += seqs
        self.context_tokens += context_tokens
        self.round_s += round_s


class RolloutService(DaemonCore):
    """The rollout loop and its state; the process module adds the sockets."""

    daemon: ClassVar[str] = "rollout"
    pause_text: ClassVar[str] = "paused: groups in flight finish, no new work is taken"

    def __init__(
        self,
        config: RolloutConfig,
        scheduler: Ask,
        context: DaemonContext,
        put_samples: PutBlob | None = None,
    ) -> None:
        self.config = config
        self.context = context
        self.session = secrets.token_hex(8)
        self.scheduler = scheduler
        self.put_samples = put_samples
        self.gate = PauseGate()
        self.draining = False
        self._emptied = asyncio.Event()  # set whenever no group is in flight or submitting
        self.engine: Any = None  # deltarl.rollout.engine.VllmEngine once started
        self.store: WeightStore | None = None
        self.engine_version: int | None = None
        self.in_flight: dict[str, float] = {}  # group id -> when it was added
        self.prompt_ids: dict[str, int] = {}  # group id -> its prompt, until submitted
        self.submitting: set[str] = set()  # finished, submit not yet answered
        self.queued = 0  # requests in the engine not yet producing tokens (after the last step)
        self.sync_to: int | None = None
        self.activity = "starting"
        self.generated_tokens = 0
        self.progress: dict[str, list[int]] = {}  # group -> [oldest token version, tokens]
        self.aborted_groups = 0  # requeued by the scheduler as doomed, and stopped here
        self.aborted_tokens = 0  # the tokens they had generated
        self.prompt_tokens = 0  # prompt tokens of the finished samples
        self.cached_prompt_tokens = 0  # of which the prefix cache served
        self.submitted_groups = 0
        self.reward_waits = 0  # submits answered reward_unavailable, to be tried again
        self.refused_groups = 0
        # Every engine update, in order (the last MAX_REFITS: a daemon runs for weeks).
        self.refits: deque[dict[str, Any]] = deque(maxlen=MAX_REFITS)
        self.verified = 0
        self.mismatches = 0
        self.unverified: str | None = None  # why the engine's weights are not proven, if so
        self._rate: deque[tuple[float, int]] = deque(maxlen=64)  # (time, tokens) per step
        # Every engine call (start, add, step, load, close) runs on this one thread, in order:
        # vLLM is not thread-safe, and a step still running when the daemon is cancelled must
        # end before close() tears the engine down.
        self._engine_thread = ThreadPoolExecutor(1, thread_name_prefix="vllm-engine")
        self.refit_errors = 0
        self.revoked_loads = 0  # loads the apply agent revoked: this engine fell behind
        self.busy_s = 0.0  # seconds in engine steps: seed 000's busy time of an instance
        self.steps = StepTally()
        # Set by a refit: the next heartbeat goes at once, not up to heartbeat_s later. A new
        # version is when the scheduler finds groups doomed (their oldest token now over the
        # bound), and each step they run on until it answers is wasted.
        self._beat_now = asyncio.Event()
        self._submits: set[asyncio.Task[None]] = set()  # running beside the engine's steps
        self._submit_failure: BaseException | None = None  # a submit task's bug, re-raised
        self.failed_groups = 0
        self._last_digest: str | None = None  # what the engine reported at its last load

    # -- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        self.store = await self._open_store()
        version = await self._first_version()
        self.activity = "starting the engine"
        self.engine = await self._call(self._make_engine)
        await self._refit(version)
        heartbeat = asyncio.create_task(self._heartbeats(), name="rollout:heartbeat")
        try:
            while True:
                await self._one_round()
        finally:
            heartbeat.cancel()

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
        """``fn(*args, **kwargs)`` on the engine thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._engine_thread, partial(fn, *args, **kwargs))

    def _make_engine(self) -> Any:  # noqa: ANN401 - VllmEngine, imported lazily (vLLM is heavy)
        from deltarl.rl.tiny_model import ensure_default_model  # noqa: PLC0415
        from deltarl.rollout.engine import VllmEngine, VllmEngineConfig  # noqa: PLC0415

        model_dir = self.config.model_dir or ensure_default_model()
        try:
            engine_config = VllmEngineConfig(
                model=Path(model_dir), **{"chat": self.config.chat, **self.config.engine}
            )
        except (TypeError, ValueError) as e:
            raise ConfigError(f"[daemons.{self.config.instance}].engine: {e}") from None
        engine = VllmEngine(engine_config)
        engine.start()
        return engine

    async def _one_round(self) -> None:
        if self._submit_failure is not None:
            raise self._submit_failure  # a bug in a submit task stops the daemon, as inline
        assert self.store is not None  # set in run()
        active = self.store.active_version
        if active is not None and active != self.engine_version:
            await self._refit(active)
            self._beat_now.set()
            if self.engine_version is None:
                # What the engine holds is unknown (a failed or revoked load): not one step
                # on it, not even for the groups in flight; the next round loads again.
                return
        started = time.monotonic()  # the round's own time, after any refit
        waiting_for_sync = self.sync_to is not None and (self.engine_version or 0) < self.sync_to
        room = self.config.max_running_groups - len(self.in_flight)
        taking = not self.gate.paused and not self.draining and self.unverified is None
        asking = taking and not waiting_for_sync and room > 0
        if asking and not self.in_flight:
            await self._get_work(room)  # nothing to step meanwhile
            asking = False
        if self.in_flight:
            self.activity = f"generating ({len(self.in_flight)} groups)"
            step = self._call(self._step)
            if asking:  # beside the step (module docstring)
                (finished, self.queued, busy, load), _ = await asyncio.gather(
                    step, self._get_work(room)
                )
            else:
                finished, self.queued, busy, load = await step
            self.busy_s += busy
            tokens = sum(len(s["token_ids"]) for g in finished for s in g.samples)
            self.generated_tokens += tokens
            metrics.ROLLOUT_BUSY_SECONDS.inc(busy)
            metrics.ROLLOUT_TOKENS.labels("completion").inc(tokens)
            for group in finished:
                # Prefill the prefix cache saved: prompt tokens taken from cached blocks
                # (the version-salted cache of the engine: within one weight version only).
                prompt = sum(len(x["prompt_token_ids"]) for x in group.samples)
                cached = sum(group.cached_tokens)
                self.prompt_tokens += prompt
                self.cached_prompt_tokens += cached
                metrics.ROLLOUT_TOKENS.labels("prompt").inc(prompt)
                metrics.ROLLOUT_TOKENS.labels("prompt_cached").inc(cached)
            self._rate.append((time.monotonic(), tokens))
            for group in finished:
                self._submit_beside(group.group_id, group.samples)
            round_s = time.monotonic() - started
            self.steps.add(*load, round_s)
            metrics.ROLLOUT_ROUND_SECONDS.inc(round_s)
            return
        if self.unverified is not None:
            self.activity = f"not generating, weights unverified ({self.unverified})"
        elif self.draining:
            self.activity = "drained"
        elif self.gate.paused:
            self.activity = "paused"
        else:
            self.activity = f"waiting for version {self.sync_to}" if waiting_for_sync else "idle"
        await asyncio.sleep(self.config.idle_s)

    def _step(self) -> tuple[list[Any], int, float, tuple[int, int]]:
        """One engine step and, read on the same thread: the requests still waiting, each
        running group's progress (for the heartbeat: ``Heartbeat.progress``), the step's
        seconds (the busy time: the step alone, not the hand-off to this thread), and the
        sequences and context it ran (``StepTally``)."""
        load = self.engine.occupancy()
        started = time.monotonic()
        finished = self.engine.step()
        busy = time.monotonic() - started
        self.progress = {g: [v, n] for g, (v, n) in self.engine.progress().items() if v is not None}
        return finished, self.engine.queued_requests(), busy, load

    async def _abort(self, group_ids: list[str]) -> None:
        """The scheduler requeued these groups (they can no longer ship within its lag bound):
        stop generating them. One that finished meanwhile is being submitted: that submit is
        refused as stale, and nothing else happens."""
        held = [g for g in group_ids if g in self.in_flight]
        if self.engine is None or not held:
            return
        for gid in held:
            tokens = await self._call(self.engine.abort_group, gid)
            self.in_flight.pop(gid, None)
            self.progress.pop(gid, None)
            self.aborted_groups += 1
            self.aborted_tokens += int(tokens)
        logger.info("aborted %d groups the scheduler requeued as doomed", len(held))

    async def _get_work(self, room: int) -> None:
        reply = await self._ask(
            GetWork(self.config.instance, self.session, room, self.engine_version)
        )
        if not isinstance(reply, Work):
            return
        self.sync_to = reply.sync_to
        for g in reply.groups:
            group_id = str(g["group_id"])
            if group_id in self.in_flight:
                continue  # the scheduler re-issued a group we hold (our lease outlived it)
            sampling = dict(g.get("sampling") or {})
            if g.get("eval"):
                # A held-out evaluation: the policy's greedy answer, whatever else was asked.
                sampling["temperature"] = 0.0
            try:
                await self._call(
                    self.engine.add_group, group_id, str(g["prompt"]), int(g["n"]), sampling
                )
            except Exception:
                # Not added: the scheduler sees the group missing from our heartbeats (or its
                # lease expire) and requeues it, counted; this daemon keeps serving the rest.
                self.failed_groups += 1
                logger.exception("group %s not generated", group_id)
                continue
            self.in_flight[group_id] = time.monotonic()
            self.prompt_ids[group_id] = int(g["prompt_id"])
        if not reply.groups and reply.wait_s > 0 and not self.in_flight:
            await asyncio.sleep(min(reply.wait_s, 1.0))

    def _submit_beside(self, group_id: str, samples: list[dict[str, Any]]) -> None:
        """Submit a finished group in a task of its own, beside the engine's next steps; it
        counts as submitting from now (so the next round does not step for it)."""
        prompt_id = self._hand_in(group_id)
        task = asyncio.create_task(
            self._send(group_id, prompt_id, samples), name=f"rollout:submit {group_id}"
        )
        self._submits.add(task)
        task.add_done_callback(self._submit_done)

    def _submit_done(self, task: asyncio.Task[None]) -> None:
        self._submits.discard(task)
        if not task.cancelled() and task.exception() is not None and self._submit_failure is None:
            self._submit_failure = task.exception()

    def _hand_in(self, group_id: str) -> int | None:
        """The group moves from in flight to submitting; its prompt id."""
        # Still held (listed in heartbeats) until the scheduler answers: a group whose submit
        # is on its way must not look abandoned and be requeued.
        self.submitting.add(group_id)
        self.in_flight.pop(group_id, None)
        return self.prompt_ids.pop(group_id, None)

    async def _send(
        self, group_id: str, prompt_id: int | None, samples: list[dict[str, Any]]
    ) -> None:
        try:
            data = self._encode(group_id, prompt_id, samples)
            if data is not None:
                await self._submit_until_answered(group_id, data)
        finally:
            self.submitting.discard(group_id)
            if not self.in_flight and not self.submitting:
                self._emptied.set()  # a drain waits for this

    def _encode(
        self, group_id: str, prompt_id: int | None, samples: list[dict[str, Any]]
    ) -> bytes | None:
        """The engine's samples as one encoded group; None (counted, logged) if they cannot
        be: the group is then not held any more, and the scheduler requeues it."""
        if prompt_id is None:
            self.failed_groups += 1
            logger.error("group %s did not come from a Work reply: not submitted", group_id)
            return None
        try:
            return encode_group(Group(group_id, prompt_id, tuple(Sample(**s) for s in samples)))
        except (SampleError, TypeError) as e:
            self.failed_groups += 1
            logger.error("group %s cannot be encoded, not submitted: %s", group_id, e)  # noqa: TRY400
            return None

    async def _submit_until_answered(self, group_id: str, data: bytes) -> None:
        # Retried until the scheduler answers: a finished group is never silently lost. If it
        # refuses (the lease expired and the prompt was requeued), the group is dropped here
        # and the scheduler has counted the requeue. The put goes again with every try (the
        # same bytes, the same digest: harmless), so a blob the scheduler swept while it was
        # unreachable is there again when the submit arrives.
        while True:
            try:
                digest = await self._put(data)
            except BlobError as e:
                self.refused_groups += 1
                logger.warning(
                    "group %s (%d bytes) refused by the samples endpoint: %s",
                    group_id,
                    len(data),
                    e,
                )
                return
            reply = None
            if digest is not None:
                reply = await self._ask(
                    SubmitGroup(self.config.instance, self.session, group_id, digest)
                )
            if isinstance(reply, Ok):
                self.submitted_groups += 1
                return
            if isinstance(reply, Error) and reply.code == REWARD_UNAVAILABLE:
                # The scheduler's reward service is out and it kept the group issued to us:
                # submit it again after a pause (the lease bounds how long that may go on).
                self.reward_waits += 1
                await asyncio.sleep(REWARD_UNAVAILABLE_WAIT_S)
                continue
            if isinstance(reply, Error):
                self.refused_groups += 1
                logger.warning("group %s refused by the scheduler: %s", group_id, reply.message)
                return
            await asyncio.sleep(0.5)

    async def _put(self, data: bytes) -> str | None:
        """The digest of ``data`` put on the samples endpoint; None: not answered (try again).
        BlobError: refused (too large), which trying again cannot change."""
        if self.put_samples is None:
            raise RuntimeError("rollout: no samples endpoint to put groups on")
        try:
            return await self.put_samples(data, REQUEST_TIMEOUT_S)
        except (TimeoutError, ConnectionError) as e:
            logger.info("samples endpoint of the scheduler not answering: %s", e)
            return None

    async def _ask(self, command: Any) -> Any:  # noqa: ANN401 - a Command, and its Reply
        try:
            return await self.scheduler(command, REQUEST_TIMEOUT_S)
        except (TimeoutError, ConnectionError) as e:
            logger.info("scheduler at %s not answering: %s", self.config.scheduler, e)
            return None

    # -- weights --------------------------------------------------------------------------

    async def _open_store(self) -> WeightStore:
        self.activity = "waiting for the rollout store"
        deadline = time.monotonic() + self.config.store_wait_s
        while True:
            try:
                return WeightStore.open(
                    self.config.rollout_store, root=self.config.store_root, readonly=True
                )
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)

    async def _first_version(self) -> int:
        assert self.store is not None
        self.activity = "waiting for a first version"
        deadline = time.monotonic() + self.config.store_wait_s
        while (version := self.store.active_version) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no version in {self.config.rollout_store} in time")
            await asyncio.sleep(0.1)
        return version

    async def _refit(self, version: int) -> None:
        """Load ``version`` into the engine (between steps) and prove what it loaded."""
        self.activity = f"loading version {version}"
        root = None if self.config.store_root is None else str(self.config.store_root)
        t0 = time.monotonic()
        # No expected version: the store may flip again before the worker's lease; whatever
        # it leased is what gets loaded, checked and recorded.
        try:
            result = await self._call(
                self.engine.update_weights, self.config.rollout_store, root, None
            )
        except LeaseRevoked as e:
            # Fell behind (I4 in weight_store.py): the apply agent did not wait for this load
            # past its bound. Nothing generates on it; the loop loads the newest version now.
            self.revoked_loads += 1
            self.engine_version = None
            self._last_digest = None
            self.unverified = str(e)
            logger.warning("%s; loading the newest version", e)
            return
        except Exception as e:
            # What the engine holds is unknown now: generate nothing, and load again next
            # round (engine_version None makes the loop retry).
            self.refit_errors += 1
            self.engine_version = None
            self._last_digest = None
            self.unverified = f"loading version {version} failed: {e}"
            logger.exception("%s", self.unverified)
            await asyncio.sleep(1.0)
            return
        seconds = time.monotonic() - t0
        loaded = int(result["version"])  # the store may have flipped again: that one is loaded
        # The manifest's digest, committed with the version and read under the worker's own
        # lease: what the engine's digest must equal. Nobody is asked.
        expected = result.get("manifest_digest")
        if expected is not None and expected != result["digest"]:
            # Once more, every tensor: a partial load builds on what the engine held before.
            logger.error(
                "version %d: the engine's digest %s is not the manifest's %s%s; "
                "loading every tensor again",
                loaded,
                result["digest"],
                expected,
                _differing(result),
            )
            result = await self._call(
                self.engine.update_weights,
                self.config.rollout_store,
                root,
                None,
                only_changed=False,
            )
            seconds = time.monotonic() - t0
            loaded = int(result["version"])  # the store may have flipped meanwhile
            expected = result.get("manifest_digest")
        ok = expected is not None and expected == result["digest"]
        if ok:
            self.verified += 1
            self.unverified = None
        else:
            # Contract 1 inside the engine: no new work on weights that are not proven to be
            # the trainer's. Groups in flight finish (their tokens carry this version); a later
            # version that verifies lifts the hold.
            self.mismatches += 1
            self.unverified = (
                f"version {loaded}: engine digest {result['digest']}, manifest {expected}"
                f"{_differing(result)}"
                if expected is not None
                else f"version {loaded}: no manifest digest was committed with it"
            )
            logger.error("not generating: %s", self.unverified)
        self.engine_version = loaded
        self._last_digest = str(result["digest"])
        # "done": CLOCK_MONOTONIC, which every process on the host shares, so `deltarl up` can
        # measure from the export agent's pick-up (its ``taken_at``) to here.
        self.refits.append(
            {
                "version": loaded,
                "seconds": round(seconds, 6),
                "verified": ok,
                # What the engine loaded, for a check from outside (``deltarl chaos``) against
                # the manifest store, independent of the comparison above.
                "digest": self._last_digest,
                "at": time.time(),
                "done": time.monotonic(),
                # How the worker found the changed layers: "committed" (the tensor digests
                # the apply agent committed with the version), "hashed" or "all".
                "chosen_by": result.get("chosen_by"),
            }
        )
        logger.info(
            "engine at version %d (%.3f s, %s; %s of %s tensors handed over, chosen: %s)",
            loaded,
            seconds,
            "verified" if ok else "NOT VERIFIED",
            result.get("tensors"),
            result.get("total"),
            result.get("chosen_by"),
        )

    # -- health ---------------------------------------------------------------------------

    def tokens_per_s(self) -> float:
        if len(self._rate) < 2:
            return 0.0
        span = self._rate[-1][0] - self._rate[0][0]
        return 0.0 if span <= 0 else sum(n for _, n in list(self._rate)[1:]) / span

    async def _heartbeats(self) -> None:
        while True:
            # ``held`` is complete (reports_held): the scheduler requeues any group issued to
            # this session that is not listed, e.g. one whose Work reply was lost.
            reply = await self._ask(
                Heartbeat(
                    self.config.instance,
                    self.session,
                    self.engine_version,
                    running_groups=len(self.in_flight),
                    queue_depth=self.queued,
                    tokens_per_s=round(self.tokens_per_s(), 3),
                    busy_s=round(self.busy_s, 3),
                    held=[*self.in_flight, *self.submitting],
                    reports_held=True,
                    progress={g: p for g, p in self.progress.items() if g in self.in_flight},
                )
            )
            if isinstance(reply, Beat) and reply.abort:
                await self._abort([str(g) for g in reply.abort])
            self.context.notifier.status(f"{self.activity}; version {self.engine_version}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._beat_now.wait(), self.config.heartbeat_s)
            self._beat_now.clear()

    # -- what the runtime asks -------------------------------------------------------------

    def status_fields(self) -> dict[str, Any]:
        return {
            "engine": None if self.engine is None else self.engine.engine_name,
            "instance": self.config.instance,
            "session": self.session,
            "weight_version": self.engine_version,
            # The digest of what the engine loaded for ``weight_version`` (None until the
            # first load, or after a failed one): both are set together, between engine steps.
            "digest": self._last_digest,
            "running_groups": len(self.in_flight),
            "queue_depth": self.queued,
            "generated_tokens": self.generated_tokens,
            "tokens_per_s": round(self.tokens_per_s(), 3),
            "submitted_groups": self.submitted_groups,
            "reward_waits": self.reward_waits,
            "refused_groups": self.refused_groups,
            "sync_to": self.sync_to,
            "refits": list(self.refits),
            "verified": self.verified,
            "mismatches": self.mismatches,
            "unverified": self.unverified,
            "refit_errors": self.refit_errors,
            "revoked_loads": self.revoked_loads,
            "busy_s": round(self.busy_s, 3),
            "steps": {**asdict(self.steps), "round_s": round(self.steps.round_s, 3)},
            "aborted_groups": self.aborted_groups,
            "aborted_tokens": self.aborted_tokens,
            "prefix_cache": {
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_prompt_tokens,
                "hit_rate": round(self.cached_prompt_tokens / self.prompt_tokens, 4)
                if self.prompt_tokens
                else None,
            },
            "failed_groups": self.failed_groups,
            "detail": self.activity,
        }

    async def drain(self) -> None:
        """No new work; the groups in flight finish generating and are submitted. What is
        still unfinished when the runtime's drain deadline cuts this short is handed back by
        ``close``."""
        self.draining = True
        if self.in_flight or self.submitting:
            self._emptied.clear()
            await self._emptied.wait()

    async def close(self) -> None:
        if self.in_flight or self.submitting:
            await self._hand_back()
        # Handed back: a submit still retrying would deliver what the scheduler now requeues.
        for task in list(self._submits):
            task.cancel()
        await asyncio.gather(*self._submits, return_exceptions=True)
        if self.engine is not None:
            # Queued behind any step still running on the engine thread.
            await self._call(self.engine.close)
        self._engine_thread.shutdown(wait=True)
        if self.store is not None:
            self.store.close()

    async def _hand_back(self) -> None:
        """Tell the scheduler this session holds nothing any more (a heartbeat with an empty
        ``held``), so it requeues our unfinished groups at once instead of when their leases
        run out. A group whose submit is being scored stays the scheduler's (it holds
        groups it is scoring itself), so nothing is trained twice."""
        lost = len(self.in_flight) + len(self.submitting)
        try:
            await self.scheduler(
                Heartbeat(
                    self.config.instance,
                    self.session,
                    self.engine_version,
                    held=[],
                    reports_held=True,
                ),
                HAND_BACK_TIMEOUT_S,
            )
        except (TimeoutError, ConnectionError) as e:
            # Tolerated: the leases run out instead, and the groups are requeued then.
            logger.warning("could not hand back %d groups: %s", lost, e)
        else:
            logger.info("handed %d unfinished groups back to the scheduler", lost)
