"""The rollout engine: vLLM in one process, stepped by the rollout daemon, refit between steps.

``VllmEngine`` drives vLLM's ``LLMEngine`` one step at a time (``add_request`` / ``step``)
instead of a blocking ``generate``: the rollout daemon updates the weights between two steps,
and requests still running keep going under the new version (a partial rollout). Each
generated token records the weight version current at the step that produced it, so the
trainer can bound and correct for policy lag token by token. The KV cache of a request that
crosses an update keeps the entries computed under the old weights: the usual approximation
of asynchronous RL, which the per-token versions make visible.

Prefix cache and versions: every request carries ``cache_salt = "deltarl-v{version}"``.
vLLM mixes the salt into the hash of a prompt's first block, and every later block hash is
chained on it, so a request under version v can only hit blocks computed under version v:
the GRPO samples of one prompt share its cached prefix, and no request ever reads a prefix
computed by older weights. A request that has not produced a token when the weights change
is added again under the new salt (``update_weights``), so its prefill cannot reuse blocks
of the old version either. Salting is chosen over ``reset_prefix_cache()`` because a reset
fails while requests are running (it would have to preempt the partial rollouts), whereas
salted-away blocks simply age out of the free queue like any other cached block.

Single process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor): the engine
core, the worker and its model live in the caller's process, so ``step`` needs no IPC and the
worker extension maps the weight store itself. vLLM may still spawn helper processes on
some platforms, so a program that starts an engine needs an ``if __name__ == "__main__"``
guard. The engine is not thread-safe: one thread calls all of its methods.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from deltarl.engine.leases import LeaseRevoked
from deltarl.rollout import kv_pool_files
from deltarl.rollout.worker_ext import QUALNAME

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.outputs import RequestOutput
    from vllm.v1.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

SALT_PREFIX = "deltarl-v"


@dataclass(frozen=True)
class VllmEngineConfig:
    """What the rollout engine is built with; the vLLM knobs that matter here, and no others."""

    model: Path
    max_model_len: int = 1024
    max_num_seqs: int = 64
    # Prefix caching caches whole blocks only, so small blocks let short RL prompts share
    # their prefix too; vLLM 0.32's CPU attention needs a multiple of 32.
    block_size: int = 32
    # KV cache size, CPU and GPU alike (EngineArgs.kv_cache_memory_bytes); the tiny default
    # model needs about 1 KiB per token, so 256 MiB holds a few hundred thousand tokens.
    kv_cache_bytes: int = 256 * 2**20
    dtype: str = "bfloat16"
    seed: int = 0
    # "processed_logprobs": log-probabilities after temperature and top-p, i.e. of the
    # distribution the tokens were actually drawn from (the behaviour policy). With top_p=1
    # this equals log_softmax(logits / temperature), what the trainer computes.
    logprobs_mode: str = "processed_logprobs"
    # No CUDA graphs or torch.compile: startup in seconds, and no captured graphs that would
    # hold stale weight pointers (reload_weights copies into the same storage anyway).
    enforce_eager: bool = True
    # The weights in the model directory count as this version until the first update.
    initial_version: int = 0
    # Hand vLLM only the layers whose tensors changed since the last load.
    only_changed: bool = True
    # "auto": render each prompt as a one-message user turn with the tokenizer's chat template
    # when the model has one (an instruct model only follows the task's answer form then);
    # True: always (an error without a template); False: the prompt text as it is.
    chat: Literal["auto", True, False] = "auto"
    # Tensor-parallel ranks, each a worker process of vLLM's multiprocessing executor (1: one
    # worker in this process). Each rank loads its own shard of every tensor handed over and
    # proves it through the placement map (worker_ext.py).
    tensor_parallel_size: int = 1
    # A directory every engine sharing the pool reads and writes: prompts' KV blocks pooled
    # across engines, keyed by weight version (kv_pool.py). None: each engine's own cache only.
    kv_pool: str | None = None
    # Versions of the pool an engine keeps when it moves on: its own and the ones before it
    # (kv_pool_files.prune). More than the scheduler's lag bound: an engine further behind
    # the newest one sharing the pool may find its blocks expired.
    kv_pool_keep_versions: int = 3
    engine_args: dict[str, Any] = field(default_factory=dict)
    """Further ``vllm.EngineArgs`` fields, passed through unchanged (over ``cpu_engine_args``
    on CPU), except ``async_scheduling``, which is always off (``SYNC_ENGINE_ARGS``)."""

    def __post_init__(self) -> None:
        if self.chat not in (True, False, "auto"):
            raise ValueError(f'chat must be true, false or "auto", got {self.chat!r}')
        owned = sorted(OWNED_ENGINE_ARGS & set(self.engine_args))
        if owned:
            raise ValueError(
                f"engine_args: {', '.join(owned)} are set by the engine's own knobs (or fixed "
                "by deltarl: the executor, the worker extension that loads from the store); "
                "use the knob (e.g. tensor_parallel_size, max_model_len, dtype) instead"
            )
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be a positive int, got {self.tensor_parallel_size!r}"
            )
        if not isinstance(self.kv_pool_keep_versions, int) or self.kv_pool_keep_versions < 1:
            raise ValueError(
                f"kv_pool_keep_versions must be a positive int, got {self.kv_pool_keep_versions!r}"
            )
        if self.kv_pool is not None and "kv_transfer_config" in self.engine_args:
            raise ValueError(
                "kv_pool and engine_args.kv_transfer_config both choose a KV connector: "
                "give one (kv_pool is the version-keyed pool)"
            )
        for key, value in SYNC_ENGINE_ARGS.items():
            if key in self.engine_args and self.engine_args[key] != value:
                raise ValueError(
                    f"engine_args: {key} = {self.engine_args[key]!r} is refused: with it, a "
                    "refit between two engine steps can land while a batch scheduled before "
                    "it still executes, and that batch's tokens would be tagged with the new "
                    "version"
                )


# vLLM 0.32 turns async scheduling on by default for the single-process executor on GPU (the
# CPU platform forces it off): the scheduler then plans step N+1 while step N executes, so
# `step()` returns with a batch still in flight. A refit between two `step()` calls must
# find no batch running, or tokens computed with the old weights would come back after it and
# be tagged with the new version. Invariant: every token's version is the weights it was
# computed with.
SYNC_ENGINE_ARGS: dict[str, Any] = {"async_scheduling": False}

# vllm.EngineArgs fields the engine sets itself from its own knobs: also in engine_args they
# would be given twice (vLLM would raise a TypeError at start, after the config was accepted).
OWNED_ENGINE_ARGS = frozenset(
    {
        "model",
        "dtype",
        "seed",
        "max_model_len",
        "max_num_seqs",
        "block_size",
        "enable_prefix_caching",
        "kv_cache_memory_bytes",
        "enforce_eager",
        "distributed_executor_backend",
        "tensor_parallel_size",
        "worker_extension_cls",
        "logprobs_mode",
    }
)


CPU_MIN_BATCHED_TOKENS = 8192
CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_rank_cores(ranks: int) -> str:
    """vLLM-CPU binds each tensor-parallel rank's threads to cores, one NUMA node per rank by
    default, and refuses more ranks than nodes. Unless the operator chose a binding (the
    variable ``VLLM_CPU_OMP_THREADS_BIND``), this process's cores are split into ``ranks``
    equal contiguous sets, one per rank ("0|1" for 2 cores, "0-3|4-7" for 8)."""
    if os.environ.get(CPU_BIND_ENV):
        return os.environ[CPU_BIND_ENV]
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // ranks
    if per < 1:
        raise ValueError(f"tensor_parallel_size={ranks} needs at least {ranks} cores here")
    sets = [cores[r * per : (r + 1) * per] for r in range(ranks)]
    binding = "|".join(str(s[0]) if len(s) == 1 else f"{s[0]}-{s[-1]}" for s in sets)
    if any(s != list(range(s[0], s[-1] + 1)) for s in sets):  # not contiguous: list them
        binding = "|".join(",".join(map(str, s)) for s in sets)
    os.environ[CPU_BIND_ENV] = binding
    return binding


def cpu_engine_args(max_model_len: int) -> dict[str, Any]:
    """What vLLM-CPU needs to serve this engine's requests, under any ``engine_args``.

    Every sample here is seeded (``add_group``), and vLLM 0.32's CPU sampler crashes ("CPU
    Generator does not use offset") when a seeded request's prompt is split by chunked
    prefill: so no chunked prefill, and a token budget per step that holds a whole prompt
    (vLLM requires it to be at least ``max_model_len`` without chunking). A property of the
    engine on this platform, not a tuning knob, hence here and not in a daemon's table: the
    tests and benches that build a ``VllmEngine`` directly need it as much as the daemon.
    """
    return {
        "enable_chunked_prefill": False,
        "max_num_batched_tokens": max(CPU_MIN_BATCHED_TOKENS, max_model_len),
    }


def _forced_lengths(group_id: str, lengths: object, n: int, max_tokens: int) -> list[int] | None:
    """``sampling["lengths"]`` checked: None when absent, else exactly ``n`` ints in [1,
    ``max_tokens``]. Checked whole before a request is added, so a bad group queues nothing."""
    if lengths is None:
        return None
    if not isinstance(lengths, list | tuple) or len(lengths) != n:
        got = f"{len(lengths)} values" if isinstance(lengths, list | tuple) else repr(lengths)
        raise ValueError(f"group {group_id!r}: lengths must be a list of n={n} ints, got {got}")
    for i, length in enumerate(lengths):
        # bool is an int to Python, but True as a length is a caller's mistake. ValueError,
        # not TypeError: every bad sampling field of a group is refused alike.
        if not isinstance(length, int) or isinstance(length, bool):
            raise ValueError(  # noqa: TRY004
                f"group {group_id!r}: lengths[{i}] must be an int, got {length!r}"
            )
        if not 1 <= length <= max_tokens:
            raise ValueError(
                f"group {group_id!r}: lengths[{i}] = {length} is outside [1, max_tokens = "
                f"{max_tokens}]"
            )
    return list(lengths)


@dataclass
class FinishedGroup:
    """The ``n`` completions of one prompt: dicts of the fields of ``deltarl.rl.samples.Sample``
    (as plain lists), which the rollout service encodes into one ``Group``."""

    group_id: str
    samples: list[dict[str, Any]]
    cached_tokens: list[int]
    """Prompt tokens each sample took from the prefix cache (not part of the protocol)."""


@dataclass
class _Request:
    group: str
    index: int
    prompt: dict[str, Any] = field(default_factory=dict)
    """The rendered prompt as added (token ids and the cache salt), for a re-add."""
    params: SamplingParams | None = None
    """Its sampling parameters (seed included), for a re-add."""
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    cached_tokens: int = 0


@dataclass
class _Group:
    n: int
    done: dict[int, _Request] = field(default_factory=dict)


@contextlib.contextmanager
def _llvmlite_hidden() -> Iterator[None]:
    """Hide llvmlite's ``ffi.lib`` from every module while vLLM builds its engine.

    vLLM 0.32's CPU worker rebinds its kernel overrides by scanning every attribute of every
    loaded module and calling ``vars(value).get(...)`` on anything with a ``__dict__``.
    llvmlite's ``lib`` answers *any* attribute, ``__dict__`` included, with a function wrapper,
    so the scan crashes (``'_lib_fn_wrapper' object has no attribute 'get'``) in a process that
    has loaded numba's compiler, as a process that also runs the codecs has. The attributes
    are put back as soon as the engine exists; nothing calls into llvmlite meanwhile (numba
    compiles only when a kernel is first called, and the codec kernels are compiled ahead).
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    wrapper = getattr(ffi, "_lib_wrapper", None) if ffi is not None else None
    hidden: list[tuple[Any, str, Any]] = []
    if isinstance(wrapper, type):
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if not isinstance(namespace, dict):
                continue
            for attr, value in list(namespace.items()):
                if isinstance(value, wrapper):
                    hidden.append((module, attr, value))
                    delattr(module, attr)
    try:
        yield
    finally:
        for module, attr, value in hidden:
            setattr(module, attr, value)


class VllmEngine:
    """vLLM stepped one iteration at a time, with weight versions per token."""

    engine_name = "vllm"

    def __init__(self, config: VllmEngineConfig) -> None:
        self.config = config
        self.version = config.initial_version
        self._engine: LLMEngine | None = None
        self._requests: dict[str, _Request] = {}
        self._groups: dict[str, _Group] = {}
        self._in_step = False
        self._torch_threads: int | None = None
        self.start_seconds: float | None = None
        self.warm_up_seconds: float | None = None
        """The first step's one-time cost, paid in ``start`` (``_warm_up``)."""
        self.chat = False
        """Prompts are rendered with the chat template (``config.chat``, decided at start)."""

    # ---- life cycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Build the vLLM engine and load the model (seconds for a tiny model on CPU)."""
        if self._engine is not None:
            raise RuntimeError("the vLLM engine is already started")
        t0 = time.perf_counter()
        # A (re)started engine serves the model directory's weights, whatever an engine
        # closed before had loaded.
        self.version = self.config.initial_version
        # Read by vLLM when the engine is built: without it, the engine core runs in a child
        # process, and step() would pay an IPC round trip and the worker would be remote.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import torch  # noqa: PLC0415
        from vllm import EngineArgs  # noqa: PLC0415 - heavy; only processes that serve load it
        from vllm.v1.engine.llm_engine import LLMEngine  # noqa: PLC0415

        # vLLM's CPU worker lowers torch's thread count for serving; close() gives the
        # process its own setting back.
        self._torch_threads = torch.get_num_threads()
        from vllm.platforms import current_platform  # noqa: PLC0415

        cfg = self.config
        platform_args = cpu_engine_args(cfg.max_model_len) if current_platform.is_cpu() else {}
        if current_platform.is_cpu() and cfg.tensor_parallel_size > 1:
            cpu_rank_cores(cfg.tensor_parallel_size)
        args = EngineArgs(
            model=str(cfg.model),
            dtype=cfg.dtype,
            seed=cfg.seed,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            block_size=cfg.block_size,
            enable_prefix_caching=True,
            kv_cache_memory_bytes=cfg.kv_cache_bytes,
            enforce_eager=cfg.enforce_eager,
            # One rank: its worker in this process. Several: one process each (vLLM's
            # multiprocessing executor; collective_rpc reaches every rank).
            distributed_executor_backend="uni" if cfg.tensor_parallel_size == 1 else "mp",
            tensor_parallel_size=cfg.tensor_parallel_size,
            worker_extension_cls=QUALNAME,
            logprobs_mode=cfg.logprobs_mode,  # type: ignore[arg-type]
            **{**platform_args, **self._pool_args(), **cfg.engine_args, **SYNC_ENGINE_ARGS},
        )
        with _llvmlite_hidden():
            self._engine = LLMEngine.from_engine_args(args, enable_multiprocessing=False)
        self._engine.set_weight_version(str(self.version))
        self._pool_namespace(self._engine)
        try:
            self.chat = self._chat_enabled(self._engine)
        except ValueError:
            self.close()  # a configuration error: leave no engine behind in this process
            raise
        try:
            self.warm_up_seconds = self._warm_up(self._engine)
        except Exception:
            self.close()  # an engine that cannot generate one token serves nothing
            raise
        self.start_seconds = time.perf_counter() - t0
        logger.info(
            "vLLM engine for %s started in %.1f s (%.1f s of it the first step's warm-up)",
            cfg.model,
            self.start_seconds,
            self.warm_up_seconds,
        )

    def _warm_up(self, engine: LLMEngine) -> float:
        """Generate one token of a throw-away request; the seconds it took.

        An engine's first step costs seconds (2.6 s for the tiny model on a CPU core, against
        10-40 ms for every later one): one-time set-up of the forward pass and the sampler
        on first use. Paid in the first group's step, it came when the engine had already
        taken work, and on a shared core it was long enough for the trainer, fed by a peer,
        to move past the lag bound, so every group of that engine was requeued as doomed.
        Paid here, it falls before the engine loads a version and asks for work. The request
        goes straight to vLLM, not through ``add_group``: it is no group, counts no token and
        leaves nothing held. It is salted and pooled under a namespace of its own
        (``kv_pool_files.warm_up_namespace``), removed after it, so neither this engine's
        prefix cache nor a shared KV pool holds its blocks under a weight version.
        """
        from vllm import SamplingParams  # noqa: PLC0415

        started = time.perf_counter()
        request_id = "deltarl-warm-up"
        namespace = kv_pool_files.warm_up_namespace()
        # The path real groups take: sampled at a temperature, with the token's log-probability.
        params = SamplingParams(max_tokens=1, temperature=1.0, seed=0, logprobs=0)
        prompt = {**self._prompt(engine, "warm-up"), "cache_salt": namespace}
        (rendered,) = engine.renderer.render_cmpl([prompt])
        self._set_pool_namespace(engine, namespace)
        try:
            engine.add_request(request_id, dict(rendered), params)
            for _ in range(8):  # one step prefills and samples the one token; a few to be sure
                if not engine.has_unfinished_requests():
                    break
                engine.step()
            if engine.has_unfinished_requests():
                engine.abort_request([request_id])
                raise RuntimeError("vLLM did not finish a one-token warm-up request in 8 steps")
        finally:
            self._set_pool_namespace(engine, self.cache_salt)
            if self.config.kv_pool is not None:
                kv_pool_files.remove([Path(self.config.kv_pool) / namespace])
        return time.perf_counter() - started

    def _set_pool_namespace(self, engine: LLMEngine, namespace: str) -> None:
        """The KV pool's namespace in the engine core's connector and every worker's."""
        if self.config.kv_pool is None:
            return
        from deltarl.rollout.kv_pool import set_namespace  # noqa: PLC0415 - imports vLLM

        set_namespace(namespace)
        engine.collective_rpc("deltarl_kv_namespace", args=(namespace,))

    def close(self) -> None:
        """Shut the engine down and free its model and KV cache; in-flight groups are lost.

        Idempotent, and meant for the thread that steps the engine (between steps, with
        requests in flight or not); ``start`` may then build a new engine in this process.
        """
        if self._in_step:
            raise RuntimeError("VllmEngine.close called inside a step: only between steps")
        engine, self._engine = self._engine, None
        self._requests.clear()
        self._groups.clear()
        if engine is None:
            return
        # Each teardown runs even if an earlier one fails, so a later start() finds no
        # distributed group or thread setting left over.
        try:
            engine.engine_core.shutdown()
        finally:
            # The uni executor set up a one-rank torch.distributed group in this process;
            # without tearing it down, a later engine in this process cannot build its own.
            from vllm.distributed.parallel_state import (  # noqa: PLC0415
                destroy_distributed_environment,
                destroy_model_parallel,
            )

            try:
                destroy_model_parallel()
                destroy_distributed_environment()
            finally:
                if self._torch_threads is not None:
                    import torch  # noqa: PLC0415

                    torch.set_num_threads(self._torch_threads)

    def __enter__(self) -> VllmEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- generation ---------------------------------------------------------------------

    @property
    def cache_salt(self) -> str:
        """The prefix-cache salt of requests added now: one namespace per weight version."""
        return f"{SALT_PREFIX}{self.version}"

    @property
    def running_groups(self) -> int:
        return len(self._groups)

    def queued_requests(self) -> int:
        """Requests added that have not produced a token yet (waiting, or in prefill)."""
        return sum(1 for r in self._requests.values() if not r.token_ids)

    def has_work(self) -> bool:
        return bool(self._requests)

    def occupancy(self) -> tuple[int, int]:
        """The sequences the next step runs and their context tokens (prompt and tokens so
        far; a request not yet prefilled counts none): what a decode step's cost depends on
        (``deltarl.sim.schedule_model.CostModel``)."""
        reqs = self._requests.values()
        return len(reqs), sum(len(r.prompt_token_ids) + len(r.token_ids) for r in reqs)

    def add_group(self, group_id: str, prompt: str, n: int, sampling: dict[str, Any]) -> None:
        """Queue ``n`` samples of ``prompt``; they come back together from ``step``.

        ``sampling``: ``temperature``, ``top_p``, ``max_tokens``, ``seed`` (sample i draws with
        seed + i, so a group is reproducible and its samples differ), and optionally
        ``lengths``: n ints in [1, max_tokens], sample i then generating exactly ``lengths[i]``
        tokens (EOS is sampled as any token, not a stop; fewer only if ``max_model_len`` cuts
        the sample), for a task that fixes its completion lengths
        (``deltarl.rl.task.ShapedLengths``). A bad ``lengths`` is refused with ValueError
        before any sample is queued.
        """
        from vllm import SamplingParams  # noqa: PLC0415
        from vllm.sampling_params import RequestOutputKind  # noqa: PLC0415

        engine = self._require()
        if group_id in self._groups:
            raise ValueError(f"group {group_id!r} is already running")
        if n < 1:
            raise ValueError(f"group {group_id!r}: n must be at least 1, got {n}")
        unknown = set(sampling) - {"temperature", "top_p", "max_tokens", "seed", "lengths"}
        if unknown:
            raise ValueError(f"group {group_id!r}: unknown sampling fields {sorted(unknown)}")
        seed = sampling.get("seed")
        max_tokens = int(sampling.get("max_tokens", 64))
        lengths = _forced_lengths(group_id, sampling.get("lengths"), n, max_tokens)
        # Tokenised once per group; the salt travels inside the rendered prompt.
        (rendered,) = engine.renderer.render_cmpl([self._prompt(engine, prompt)])
        self._groups[group_id] = _Group(n)
        for i in range(n):
            # A forced length L: max_tokens ends the sample at L, and ignore_eos keeps the
            # model's EOS (and the generation config's other end tokens) from ending it
            # sooner: they are sampled as ordinary tokens. Not min_tokens: it masks those
            # tokens out of the logits, so the reported log-probabilities would be of a
            # renormalised distribution, not the model's one the trainer recomputes.
            params = SamplingParams(
                n=1,
                temperature=float(sampling.get("temperature", 1.0)),
                top_p=float(sampling.get("top_p", 1.0)),
                max_tokens=max_tokens if lengths is None else lengths[i],
                ignore_eos=lengths is not None,
                seed=None if seed is None else int(seed) + i,
                logprobs=0,  # the sampled token's own log-probability, no alternatives
                # Only the tokens new since the last step: each step's tokens get that
                # step's version without diffing cumulative outputs.
                output_kind=RequestOutputKind.DELTA,
            )
            # One request per sample rather than n>1: each sample is addressed by its own id
            # and seed, and with the shared salt they still share the cached prompt.
            request_id = f"{group_id}#{i}"
            self._requests[request_id] = _Request(group_id, i, dict(rendered), params)
            engine.add_request(request_id, dict(rendered), params)

    def progress(self) -> dict[str, tuple[int | None, int]]:
        """Each running group's oldest token version (None: no token yet) and its tokens so
        far: what decides whether it can still ship within a lag bound."""
        reqs: dict[str, list[_Request]] = {
            g: list(v.done.values()) for g, v in self._groups.items()
        }
        for req in self._requests.values():
            reqs[req.group].append(req)
        out: dict[str, tuple[int | None, int]] = {}
        for gid, rs in reqs.items():
            versions = [min(r.token_versions) for r in rs if r.token_versions]
            out[gid] = (min(versions) if versions else None, sum(len(r.token_ids) for r in rs))
        return out

    def abort_group(self, group_id: str) -> int:
        """Stop generating ``group_id`` (its samples still running are aborted in vLLM, the
        finished ones forgotten); the tokens it had generated. 0 for an unknown group."""
        group = self._groups.pop(group_id, None)
        if group is None:
            return 0
        ids = [rid for rid, req in self._requests.items() if req.group == group_id]
        tokens = sum(len(r.token_ids) for r in group.done.values())
        tokens += sum(len(self._requests[rid].token_ids) for rid in ids)
        for rid in ids:
            del self._requests[rid]
        if ids:
            self._require().abort_request(ids)
        return tokens

    def _chat_enabled(self, engine: LLMEngine) -> bool:
        """Whether prompts go through the chat template (``VllmEngineConfig.chat``)."""
        has_template = getattr(engine.get_tokenizer(), "chat_template", None) is not None
        if self.config.chat is True and not has_template:
            raise ValueError(
                f"chat = true, but the tokenizer of {self.config.model} has no chat template"
            )
        return has_template if self.config.chat == "auto" else bool(self.config.chat)

    def _prompt(self, engine: LLMEngine, prompt: str) -> dict[str, Any]:
        """The request's prompt: the text, or the token ids of the text as the user's one
        message of a chat with the assistant's turn opened (tokenised by the template, so its
        special tokens are not added twice). Either way vLLM reports the tokens it served as
        the sample's ``prompt_token_ids``, which the trainer trains on."""
        if not self.chat:
            return {"prompt": prompt, "cache_salt": self.cache_salt}
        ids = engine.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, Mapping):  # transformers 5 answers a BatchEncoding
            ids = ids["input_ids"]
        return {"prompt_token_ids": [int(t) for t in ids], "cache_salt": self.cache_salt}

    def step(self) -> list[FinishedGroup]:
        """Run one engine iteration; the groups whose samples all finished in it."""
        engine = self._require()
        if self._in_step:
            raise RuntimeError("VllmEngine.step is not reentrant")
        self._in_step = True
        try:
            outputs = engine.step()
            return self._collect(outputs)
        finally:
            self._in_step = False

    def _collect(self, outputs: list[Any]) -> list[FinishedGroup]:
        finished: list[FinishedGroup] = []
        for out in outputs:
            req = self._requests.get(out.request_id)
            if req is None:  # not ours (a request aborted meanwhile)
                continue
            self._absorb(req, out)
            if req.finish_reason is None:
                continue
            del self._requests[out.request_id]
            group = self._groups[req.group]
            group.done[req.index] = req
            if len(group.done) == group.n:
                del self._groups[req.group]
                finished.append(_finish(req.group, group))
        return finished

    def _absorb(self, req: _Request, out: RequestOutput) -> None:
        if not req.prompt_token_ids and out.prompt_token_ids:
            req.prompt_token_ids = list(out.prompt_token_ids)
            req.cached_tokens = int(out.num_cached_tokens or 0)
        comp = out.outputs[0]
        new = list(comp.token_ids)
        if new:
            if comp.logprobs is None or len(comp.logprobs) != len(new):
                raise RuntimeError(
                    f"request {out.request_id}: vLLM returned {len(new)} tokens but "
                    f"{0 if comp.logprobs is None else len(comp.logprobs)} logprob entries"
                )
            req.token_ids += new
            req.logprobs += [
                float(pos[tok].logprob) for tok, pos in zip(new, comp.logprobs, strict=True)
            ]
            # Updates happen only between steps, so every token of this step's output was
            # produced by the weights loaded now.
            req.token_versions += [self.version] * len(new)
        req.text.append(comp.text)
        if out.finished:
            req.finish_reason = str(comp.finish_reason or "stop")

    # ---- weights ------------------------------------------------------------------------

    def update_weights(
        self,
        store_name: str,
        root: Path | str | None = None,
        version: int | None = None,
        *,
        only_changed: bool | None = None,
    ) -> dict[str, Any]:
        """Load the weight store's active version (which must be ``version`` if given).

        Only between steps. Requests in flight continue under the new weights; requests added
        from now on use the new version's prefix-cache namespace. Returns the worker's report:
        ``version``, ``digest`` (model digest of the tensors handed to vLLM, as the store's and
        the manifest's), ``tensors`` handed over, ``total``, and timings.
        """
        engine = self._require()
        if self._in_step:
            raise RuntimeError("update_weights called inside a step: only between steps")
        changed = self.config.only_changed if only_changed is None else only_changed
        t0 = time.perf_counter()
        reports = engine.collective_rpc(
            "deltarl_load_version",
            args=(store_name, None if root is None else str(root), version, changed),
        )
        if any(r.get("revoked") for r in reports):
            # A worker's load outlasted the apply agent's lease bound (I4 in weight_store.py).
            raise LeaseRevoked(
                f"the lease on version {reports[0]['version']} was revoked while loading it: "
                f"this engine fell behind the apply agent's lease bound, the load is discarded"
            )
        digests = {r["digest"] for r in reports}
        versions = {r["version"] for r in reports}
        if len(digests) != 1 or len(versions) != 1:
            # Tensor-parallel workers lease separately; the pointer moved between them.
            raise RuntimeError(f"workers loaded different weights: {reports}")
        report = dict(reports[0])
        # Every rank read back its own shards: the figure is theirs together.
        report["readback_tensors"] = sum(int(r["readback_tensors"]) for r in reports)
        report["ranks"] = len(reports)
        self.version = int(report["version"])
        engine.set_weight_version(str(self.version))
        self._pool_namespace(engine)
        report["resalted_requests"] = self._resalt(engine)
        report["rpc_seconds"] = time.perf_counter() - t0
        logger.info(
            "weights now at version %d (%d/%d tensors, %.3f s)",
            self.version,
            report["tensors"],
            report["total"],
            report["rpc_seconds"],
        )
        return report

    def _pool_args(self) -> dict[str, Any]:
        if self.config.kv_pool is None:
            return {}
        from deltarl.rollout.kv_pool import kv_transfer_config  # noqa: PLC0415 - imports vLLM

        return {"kv_transfer_config": kv_transfer_config(self.config.kv_pool)}

    def _pool_namespace(self, engine: LLMEngine) -> None:
        """The KV pool's keys follow the weights: this version's salt in the engine core's
        connector (this process) and in every worker's."""
        if self.config.kv_pool is None:
            return
        self._set_pool_namespace(engine, self.cache_salt)
        # Older versions expire: renamed away now (no lookup can find them after this), their
        # files removed by a thread, off the refit path.
        trash = kv_pool_files.prune(
            self.config.kv_pool, self.cache_salt, self.config.kv_pool_keep_versions
        )
        if trash:
            logger.info("KV pool: %d expired directories removed", len(trash))
            threading.Thread(
                target=kv_pool_files.remove, args=(trash,), name="kv-pool-expiry", daemon=True
            ).start()

    def _resalt(self, engine: LLMEngine) -> int:
        """Move every request without a token yet into the current version's cache namespace.

        Such a request was added under an older version's salt, so its prefill could hit
        prompt blocks computed by older weights although it generates under the new ones.
        It is aborted and added again, same prompt tokens, sampling parameters and seed,
        with the new salt. vLLM's abort frees any blocks of a prefill already under way.
        """
        salt = self.cache_salt
        stale = [
            rid
            for rid, r in self._requests.items()
            if not r.token_ids and r.prompt.get("cache_salt") != salt
        ]
        if not stale:
            return 0
        engine.abort_request(stale)
        for rid in stale:
            old = self._requests[rid]
            req = _Request(old.group, old.index, {**old.prompt, "cache_salt": salt}, old.params)
            self._requests[rid] = req
            assert old.params is not None  # set by add_group
            engine.add_request(rid, dict(req.prompt), old.params.clone())
        logger.info("re-added %d waiting requests under cache salt %s", len(stale), salt)
        return len(stale)

    def _require(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("the vLLM engine is not started (call start())")
        return self._engine


def _finish(group_id: str, group: _Group) -> FinishedGroup:
    reqs = [group.done[i] for i in range(group.n)]
    samples = [
        {
            "prompt_token_ids": r.prompt_token_ids,
            "token_ids": r.token_ids,
            "logprobs": r.logprobs,
            "token_versions": r.token_versions,
            "text": "".join(r.text),
            "finish_reason": r.finish_reason or "stop",
        }
        for r in reqs
    ]
    return FinishedGroup(group_id, samples, [r.cached_tokens for r in reqs])
