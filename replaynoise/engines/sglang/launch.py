"""What starts SGLang for the engine and checks it once started: each of its processes imports this package's SGLang
plugin first, a batch goes to it with its cache salts, and what it made of the settings and of the request seeds is
checked before any request of the run (docs/sglang.md)."""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from replaynoise.engines.recipes import EngineError
from replaynoise.engines.sglang import plugin
from replaynoise.engines.sglang.plugin import SEEDED

log = logging.getLogger(__name__)

#: the module SGLang's processes import first (``children_import_plugin``): it hooks their sampling where asked
PLUGIN = plugin.__name__


class SaltedEngine:
    """``sglang.Engine`` with a cache salt per request: ``Engine.generate`` does not pass ``extra_key`` on, so a batch
    goes to its tokenizer manager as the ``GenerateReqInput`` that ``Engine.generate`` itself builds, salts added."""

    def __init__(self, engine: Any, request_type: type) -> None:
        self.engine, self.request_type = engine, request_type

    def generate(self, *, extra_key: list[str], **fields: Any) -> list[dict]:
        """A batch's results in order, as ``Engine.generate`` returns them (``fields``: its arguments)."""
        request = self.request_type(extra_key=extra_key, **fields)
        generator = self.engine.tokenizer_manager.generate_request(request, None)
        return self.engine.loop.run_until_complete(generator.__anext__())

    def flush_cache(self) -> Any:
        return self.engine.flush_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()


#: the seeded-sampling check's request: free-running (no stop, a high temperature), so that two draws from SGLang's
#: one generator, or from two seeds, would differ somewhere in 32 tokens, and two draws from one seed agree; top-p
#: below 1, as the runs', takes the sampler path they take
PROBE = {"temperature": 1.5, "top_p": 0.95, "max_new_tokens": 32, "ignore_eos": True}
PROBE_SEEDS = (20260606, 20260606, 7)


def check_seeded(engine: Any, prompt_ids: list[int]) -> None:
    """Each request must sample from its own seed, or a rollout cannot be regenerated and passes share no random
    numbers. One request drawn three times alone, under three salts (so each computes the same prefill): twice from
    one seed, which must give the same tokens (with stock kernels this fails when this package's SGLang plugin did
    not load in SGLang's scheduler), and once from another, which must not (a seed that never reached the sampler)."""
    drawn = [
        engine.generate(
            input_ids=[prompt_ids], extra_key=[f"seed-check:{i}"], sampling_params=[{**PROBE, "sampling_seed": seed}]
        )[0]["output_ids"]
        for i, seed in enumerate(PROBE_SEEDS)
    ]
    if drawn[0] == drawn[1] == drawn[2]:
        raise EngineError(
            "SGLang drew the same tokens for one request under two seeds: the request seeds do not reach its sampler "
            "(a sampler that ignores them, or one seed for every request)"
        )
    if drawn[0] != drawn[1]:
        raise EngineError(
            "SGLang drew different tokens for one request and seed twice: its sampler ignores the request seeds. "
            f"With stock kernels they come from replaynoise's SGLang plugin ({PLUGIN}, with {SEEDED}=1), which "
            "SGLang's spawned processes import first: check that SGLang still starts them by spawn and that nothing "
            "else sets their main module; or use kernels: invariant (SGLang's deterministic mode seeds by itself)"
        )


@contextmanager
def children_import_plugin() -> Iterator[None]:
    """While SGLang starts its processes: each imports this package's SGLang plugin as its main module.

    SGLang starts its scheduler with multiprocessing's spawn, whose child first runs the parent's ``__main__`` again:
    a Snakemake script (a file without a ``__main__`` guard) would build a second engine there. A main module that
    names an importable spec is imported by that name instead, so naming the plugin module makes each child import
    it, which registers its hook there (``plugin.py``) whether or not replaynoise is installed in the environment (its
    entry point is not, under ``--use-conda``). The main module's own spec is restored once the processes run."""
    main = sys.modules["__main__"]
    saved = main.__spec__  # None for a script run as a file; the module's own for ``python -m``
    main.__spec__ = importlib.util.find_spec(PLUGIN)
    try:
        yield
    finally:
        main.__spec__ = saved


#: what SGLang resolves by GPU and model where the settings leave it open, and which decides a pass's kernels and
#: batches: logged at every build, since SGLang's own server_args line does not reach the job's log (``logging_kept``)
#: and one campaign's runs on different cards can differ by what it chose
RESOLVED = (
    "attention_backend",
    "prefill_attention_backend",
    "decode_attention_backend",
    "chunked_prefill_size",
    "max_prefill_tokens",
    "max_running_requests",
    "schedule_policy",
    "mem_fraction_static",
)


#: the settings that decide which kernels and batch sizes a pass runs, so its bits (the regime probe, one at a time
#: on one card: docs/mechanism.md), each under the name a run's fingerprint records it by: a run either passes it to
#: SGLang from its configuration or logs what SGLang resolved
NUMERIC = {
    "attention_backend": "attention_backend",
    "disable_cuda_graph": "disable_cuda_graph",
    "enable_deterministic_inference": "enable_deterministic_inference",
    "cuda_graph_max_bs_decode": "cuda_graph_max_bs_decode",
    "max_total_tokens": "kv_pool_tokens",
    "max_running_requests": "max_running_requests",
    "chunked_prefill_size": "chunked_prefill_size",
}


def checked_server_args(server_args: Any, settings: dict) -> int:
    """What SGLang made of the settings once built, where it overrides them by GPU: its radix cache must be on (its
    deterministic mode turns it off where it picks flashinfer, on Blackwell for one), its sampler the one that takes
    seeds, and its page size is the one the exact pass's expected hits are computed with (fa4 on SM100 forces 128).
    Returns that page size."""
    if server_args.disable_radix_cache:
        raise EngineError(
            f"SGLang turned its radix cache off (attention backend {server_args.attention_backend!r}, deterministic "
            f"{settings['kernels'] == 'invariant'}): the exact pass could not read the decode-time state; set "
            "sglang.attention_backend to fa3 or triton"
        )
    if server_args.sampling_backend != "pytorch":
        raise EngineError(
            f"SGLang chose the {server_args.sampling_backend!r} sampler, which draws no request from its own seed with "
            "top-p below 1 (its flashinfer sampler refuses seeds); the engine asks for 'pytorch'"
        )
    if server_args.page_size != settings["sglang"]["page_size"]:
        log.warning(
            "SGLang runs with page_size %d, not the %d configured",
            server_args.page_size,
            settings["sglang"]["page_size"],
        )
    log.info(
        "SGLang chose: %s",
        ", ".join(f"{key}={getattr(server_args, key, 'absent')!r}" for key in RESOLVED),
    )
    decode = getattr(getattr(server_args, "cuda_graph_config", None), "decode", None)
    rows = getattr(decode, "max_bs", None)
    if rows is not None and not server_args.disable_cuda_graph:
        # a pass batch above it decodes without graphs (a 1,024-row pass batch against SGLang's default of 256)
        log.info(
            "SGLang captures decode CUDA graphs for batches of up to %d rows (sglang.cuda_graph_max_bs_decode); "
            "larger batches decode without them",
            rows,
        )
    return int(server_args.page_size)


@contextmanager
def logging_kept() -> Iterator[None]:
    """While SGLang builds: the logging in place before stays after. SGLang's ``configure_logger`` calls
    ``logging.basicConfig(level=<its log_level>, force=True)`` in the process that builds it, which closes and
    replaces the root handlers and, at the engine's ``log_level: error``, would silence every later warning of the
    job. The job's handlers are taken off the root while SGLang builds, so that it has none to close, and put back
    after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    for handler in handlers:
        root.removeHandler(handler)
    try:
        yield
    finally:
        for handler in root.handlers[:]:
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)


#: one lock for the machine, whatever TMPDIR a job gets (Slurm and containers often give each job its own) and
#: however CUDA_VISIBLE_DEVICES names its GPU: SGLang builds on one machine take turns, about 30 s each
START_LOCK = Path("/tmp/replaynoise-sglang-start.lock")


@contextmanager
def start_lock(lock_file: Path | None = None) -> Iterator[None]:
    """Held while SGLang builds, one build at a time: SGLang sizes its KV pool from the memory free at its start and
    after its graph capture, so two engines building at once on one GPU would each see the other half-built. An OS
    lock (flock) on a descriptor opened read-only, so that another user's lock file serves too and a dead job releases
    it."""
    fd = os.open(lock_file or START_LOCK, os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def checked_pool(info: dict, settings: dict, page_size: int) -> int:
    """The KV pool SGLang built (``Engine.get_server_info()``), in tokens. Its size decides which requests run
    together, so where ``sglang.max_total_tokens`` fixes it, a smaller pool (SGLang takes the smaller of the key and
    what the free memory holds, with a warning) would change the batches silently: refused. SGLang rounds the key
    down to whole pages of ``page_size`` tokens, which is not a shortfall."""
    if "max_total_num_tokens" not in info:
        raise EngineError("SGLang's server info names no max_total_num_tokens: its KV pool cannot be checked")
    pool = int(info["max_total_num_tokens"])
    s = settings["sglang"]
    asked = s.get("max_total_tokens")
    if asked is not None and pool < asked // page_size * page_size:
        raise EngineError(
            f"SGLang built a KV pool of {pool} tokens, fewer than sglang.max_total_tokens {asked}: the GPU memory "
            f"free at its start (GPU {os.environ.get('CUDA_VISIBLE_DEVICES', 'all')}, shared with other jobs) did "
            f"not hold it at mem_fraction_static {s['mem_fraction_static']}; raise mem_fraction_static or run fewer "
            "jobs on the GPU at once"
        )
    log.info("SGLang's KV pool: %d tokens", pool)
    if asked is None:
        log.warning(
            "SGLang sized its KV pool (%d tokens) from the GPU memory free at this job's start: the requests it "
            "admits together, so the batches and the numbers, then depend on what else ran on the GPU; "
            "sglang.max_total_tokens pins it",
            pool,
        )
    return pool
