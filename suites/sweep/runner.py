"""The sweep runner: load levels x interleaved rounds x arms, every request recorded as it finishes.

Contract:
- Levels are closed-loop concurrencies (C requests in flight, a semaphore, like vLLM's
  --max-concurrency) or, in open-loop mode, request rates (req/s) with Poisson or gamma arrivals
  (`arrival_offsets`; the same seeded offsets for every arm and round, optionally capped by a
  concurrency limit).
- At each level every engine first runs `warmup` waves of warm-up requests (warmup x C requests at
  concurrency C, so every batch size the level reaches is exercised, e.g. CUDA graph buckets; recorded
  with warmup=True, excluded from every figure), then `rounds` rounds. Within a round the arms run one after another in `schedule` order
  (A B A' | A B A' ...), so drift hits every arm; A' is the noise-floor copy of the baseline arm (the
  same engine, run again) when `noise_floor` is on.
- Every cell (level, arm, round) runs the same prompts. Around each cell the arm's spec counters are
  snapshotted; the delta is stored with the cell, so acceptance can come from counters when the
  engine gives no per-request figures. At c1 (closed loop) the counters are also snapshotted after every
  request (`c1_counters`): a request without spec counts of its own gets the delta around it, labelled
  source "counters-c1" (per request, since nothing else of this sweep is in flight; each snapshot settles
  until the server has published that request, so a late count never lands on its neighbour; from the
  first request that does not settle on, none gets counts, the cell record's `c1_counters` says where);
  the scrape time is taken off the cell's duration (`scrape_s`).
- Every cell records the client's own load (`client`: `client_load`): the event-loop thread's CPU over
  the cell, its share of the wall time, the headroom and CPU per chunk; `saturated` when the loop was busy
  >= 90 % of the time (the client, not the engine, may have set the pace).
- Records go to the sink the moment they exist: `sink.request(result, arm, idx, round)` per finished
  request (the result's meta carries level, level_kind, round, warmup, copy_of, prompt_idx) and
  `sink.cell(record)` per finished cell (duration, counters delta; `server_metrics`: the audited /metrics
  families before the cell, once the server reads idle, and after it, once it has published what the cell's
  requests received (suites/metrics_audit.py `settle`, bounded), for the client-side metrics audit; the spec
  counters delta is taken over the same settled span). An interrupt loses only requests still in flight.
- Progress: `progress` is None / False (silent) or an object with `plan(total, work)`, `phase(name, n)` and
  `advance(work=)` (cli/progress.py RunProgress): the runner plans the sweep's requests (warm-up included),
  names each cell as it starts ("c8 round 2/3 spec-on, cell 14/55", its n requests) and advances once per
  finished request. The work, for the ETA, is waves: a request at a level of width C (`SweepConfig.width`)
  is 1/C of one, so the c1 cells at the start do not make the ETA extrapolate c1's pace to c64's requests.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from specbench.harness.adapters.base import EngineAdapter, GenResult, counters_delta

from ..metrics_audit import per_step_stream, settle
from .workload import Workload, output_len_range

NOISE_SUFFIX = "#2"
ENDPOINT_TYPES = ("completions", "chat")


class Sink(Protocol):
    def request(self, res: GenResult, arm: str, idx: int, round: int) -> None: ...

    def cell(self, record: dict) -> None: ...


@dataclass(frozen=True)
class SweepConfig:
    levels: tuple[float, ...] = (1, 8, 16, 32, 64)
    mode: str = "closed"  # "closed": levels are concurrencies; "open": levels are request rates
    max_concurrency: int | None = None  # open loop: cap on requests in flight (None = no cap)
    dataset: str = "gsm8k"
    num_prompts: int | None = None  # prompts per cell, the same at every level
    prompts_per_level: int = 4  # else K x C prompts per cell at level C (K full waves); open loop: K x 8
    min_prompts: int = 8
    max_tokens: int = 128
    # output length spread S in [0, 1): each request's max_tokens uniform in [max(1, round(M (1 - S))),
    # round(M (1 + S))] (M = max_tokens), one seeded draw per prompt position, the same for every arm and round (as
    # vLLM bench's --random-range-ratio). 0: every request M. With ignore_eos and S = 0 the requests of one wave
    # finish together and their successors' prefills share a step: a lockstep no traffic has.
    max_tokens_spread: float = 0.0
    ignore_eos: bool = False
    temperature: float = 0.0
    rounds: int = 3
    warmup: int = 1  # waves: warmup x C requests per engine and level
    arrival: str = "poisson"  # open loop: poisson | gamma
    burstiness: float = 1.0  # gamma shape; 1.0 is Poisson
    noise_floor: bool = True
    seed: int = 0
    random_input_len: int = 64  # --dataset random: prompt length in tokens (each engine's own tokenizer)
    dataset_path: str | None = None  # the user's prompts (custom JSONL, ShareGPT JSON, Spec-Bench JSONL)
    endpoint_type: str = "completions"  # "chat": every request as chat messages (the server's template)
    c1_counters: bool = True  # at c1, per-request spec counts from counter deltas where requests carry none
    client_procs: int = 1  # client processes per openai arm (0 = auto: one per 64 in flight, up to cores - 1)

    def __post_init__(self) -> None:
        if self.mode not in ("closed", "open"):
            raise ValueError(f"mode={self.mode!r} is invalid: expected closed or open")
        if not self.levels:
            raise ValueError("levels is empty: expected at least one concurrency or request rate")
        for v in self.levels:
            if not (v > 0) or (self.mode == "closed" and (v != int(v) or math.isinf(v))):
                what = "request rate" if self.mode == "open" else "concurrency"
                raise ValueError(f"{what} {v} is invalid: expected {'a number > 0 or inf' if self.mode == 'open' else 'an integer >= 1'}")
        for name in ("rounds", "max_tokens", "prompts_per_level"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: expected an integer >= 1")
        if self.warmup < 0:
            raise ValueError(f"warmup={self.warmup} is invalid: expected an integer >= 0")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts={self.num_prompts} is invalid: expected an integer >= 1")
        if self.arrival not in ("poisson", "gamma"):
            raise ValueError(f"arrival={self.arrival!r} is invalid: expected poisson or gamma")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness={self.burstiness} is invalid: expected a number > 0")
        if self.endpoint_type not in ENDPOINT_TYPES:
            raise ValueError(f"endpoint_type={self.endpoint_type!r} is invalid: expected one of "
                             f"{', '.join(ENDPOINT_TYPES)}")
        if self.client_procs < 0:
            raise ValueError(f"client_procs={self.client_procs} is invalid: expected an integer >= 1, or 0 (auto)")
        if not (0.0 <= self.max_tokens_spread < 1.0):
            raise ValueError(f"max_tokens_spread={self.max_tokens_spread} is invalid: expected a number in [0, 1)")
        if self.random_input_len < 1:
            raise ValueError(f"random_input_len={self.random_input_len} is invalid: expected an integer >= 1")

    @property
    def max_tokens_hi(self) -> int:
        """The largest max_tokens a request gets (the context every prompt must leave room for)."""
        return output_len_range(self.max_tokens, self.max_tokens_spread)[1]

    def width(self, level: float) -> int:
        """Requests in flight a level aims at: C, or in open loop the cap (8 when uncapped)."""
        return int(level) if self.mode == "closed" else (self.max_concurrency or 8)

    def prompts_at(self, level: float) -> int:
        if self.num_prompts is not None:
            return self.num_prompts
        return max(self.min_prompts, self.prompts_per_level * self.width(level))

    def warmup_at(self, level: float) -> int:
        return self.warmup * self.width(level)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Arm:
    label: str
    engine: str  # the engine string it was built from (provenance)
    copy_of: str | None = None  # set on the noise-floor copy


def schedule(arms: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """The interleaved order of cells at one level: round 0 A B ..., round 1 A B ..., ..."""
    return [(r, a) for r in range(rounds) for a in arms]


def with_noise_copy(arms: Sequence[Arm], baseline: str | None = None) -> list[Arm]:
    """The arms plus a second copy of the baseline (default: the first arm), placed last in a round."""
    base = baseline or arms[0].label
    src = next((a for a in arms if a.label == base), None)
    if src is None:
        raise ValueError(f"baseline arm {base!r} is not one of {[a.label for a in arms]}")
    return [*arms, Arm(label=base + NOISE_SUFFIX, engine=src.engine, copy_of=base)]


def arrival_offsets(n: int, rate: float, arrival: str = "poisson", burstiness: float = 1.0,
                    seed: int = 0) -> list[float]:
    """Send offsets (s) of n requests at `rate` req/s: gamma inter-arrivals with shape `burstiness` and
    mean 1/rate (burstiness 1 = Poisson); rate inf sends everything at once. The first request goes at 0."""
    if math.isinf(rate):
        return [0.0] * n
    shape = 1.0 if arrival == "poisson" else burstiness
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape, 1.0 / (rate * shape), size=n)
    gaps[0] = 0.0
    return [float(x) for x in np.cumsum(gaps)]


@dataclass
class SweepRunner:
    cfg: SweepConfig
    arms: list[Arm]
    adapters: dict[str, EngineAdapter]  # by label; a noise copy maps to its source's adapter
    workload: Workload
    sink: Sink
    progress: Any = None  # None / False, or plan / phase / advance (module docstring)
    on_cell: Callable[[dict], None] | None = None
    cells_done: int = field(default=0, init=False)
    cells_started: int = field(default=0, init=False)

    def adapter(self, arm: Arm) -> EngineAdapter:
        return self.adapters[arm.copy_of or arm.label]

    def _sources(self) -> list[Arm]:
        return [a for a in self.arms if a.copy_of is None]

    def planned(self) -> tuple[int, int, float]:
        """(cells, requests, waves) of the whole sweep, warm-up included: per level one warm-up cell of warmup x C
        requests per engine (none when warmup is 0), then rounds x arms cells of the level's prompts; a request
        is 1/width of a wave."""
        cfg, ns = self.cfg, len(self._sources())
        cells = sum((ns if cfg.warmup_at(lv) else 0) + cfg.rounds * len(self.arms) for lv in cfg.levels)
        per = {lv: cfg.warmup_at(lv) * ns + cfg.rounds * len(self.arms) * cfg.prompts_at(lv) for lv in cfg.levels}
        return cells, sum(per.values()), sum(n / cfg.width(lv) for lv, n in per.items())

    def _tracker(self) -> Any:
        return self.progress if callable(getattr(self.progress, "advance", None)) else None

    async def run(self) -> None:
        if (t := self._tracker()) is not None:
            _, reqs, waves = self.planned()
            t.plan(reqs, work=waves)
        for li, level in enumerate(self.cfg.levels):
            await self.run_level(li, level)

    async def run_level(self, li: int, level: float) -> None:
        cfg, n = self.cfg, self.cfg.prompts_at(level)
        positions = list(range(n))  # the same prompts at every level and in every cell
        conc = int(level) if cfg.mode == "closed" else cfg.max_concurrency
        offsets = None if cfg.mode == "closed" else arrival_offsets(n, level, cfg.arrival, cfg.burstiness,
                                                                   cfg.seed + li)
        nw = cfg.warmup_at(level)
        for arm in self._sources() if nw else []:
            wpos = [n + i for i in range(nw)]  # prompts past the measured ones
            await self.run_cell(arm, level, -1, wpos, conc if conc else None, None, warmup=True)
        for rnd, label in schedule([a.label for a in self.arms], cfg.rounds):
            arm = next(a for a in self.arms if a.label == label)
            await self.run_cell(arm, level, rnd, positions, conc, offsets)

    async def run_cell(self, arm: Arm, level: float, rnd: int, positions: list[int], conc: int | None,
                       offsets: list[float] | None, warmup: bool = False) -> dict:
        cfg, ad = self.cfg, self.adapter(arm)
        tracker = self._tracker()
        wave = 1.0 / cfg.width(level)  # one request's share of a wave at this level (the ETA's work)
        self.cells_started += 1
        if tracker is not None:
            when = "warm-up" if warmup else f"round {rnd + 1}/{cfg.rounds}"
            tracker.phase(f"{_level_name(cfg, level)} {when} {arm.label}, cell {self.cells_started}/"
                          f"{self.planned()[0]}", len(positions))
        key = {"arm": arm.label, "level": level, "level_kind": "concurrency" if cfg.mode == "closed" else "rate",
               "round": rnd, "warmup": warmup, "copy_of": arm.copy_of}
        reqs = self.workload.requests(arm.copy_of or arm.label, positions, cfg.max_tokens, cfg.ignore_eos,
                                      cfg.temperature, meta=dict(key), spread=cfg.max_tokens_spread, seed=cfg.seed)
        for i, r in enumerate(reqs):
            r.rid = f"{arm.label}/{_level_name(cfg, level)}/r{rnd}/{i}"
        # the client-side metrics audit (suites/metrics_audit.py): the server idle first, then its spec counters
        before_m = await settle(ad)
        before = await _counters(ad)
        per_step, k = per_step_stream(_describe(ad)), _k(ad)
        t0, wall0, cpu0 = time.perf_counter(), time.time(), time.thread_time()
        index = {r.rid: i for i, r in enumerate(reqs)}

        def record(res: GenResult) -> None:
            self.sink.request(res, arm.label, index.get(res.rid, -1), rnd)
            if tracker is not None:
                tracker.advance(work=wave)

        scrape_s = 0.0
        c1: dict = {}  # the per-request counter attribution at c1 (_one_by_one), recorded on the cell
        if cfg.mode == "closed" and conc == 1 and before is not None and cfg.c1_counters:
            results, scrape_s, c1 = await _one_by_one(ad, reqs, before, before_m, record, k, per_step)
        else:
            results = await ad.generate(reqs, concurrency=conc, on_result=record, offsets=offsets)
        cpu = time.thread_time() - cpu0  # this thread runs the event loop: the client's own CPU
        duration = time.perf_counter() - t0 - scrape_s  # the per-request scrapes at c1 are not serving time
        # until the server has published every request of the cell (bounded), then the spec counters
        after_m = await settle(ad, before_m, results, k=k, per_step=per_step) if before_m is not None else None
        after = await _counters(ad)
        cell = {**key, "wall_start": wall0, "duration": duration, "requests": len(reqs),
                "completed": sum(1 for r in results if r.ok), "counters": counters_delta(before, after),
                "concurrency": conc, "offsets": offsets is not None, "scrape_s": scrape_s,
                "client": client_load(cpu, time.perf_counter() - t0, sum(len(r.chunk_times) for r in results),
                                      list(getattr(ad, "client_cpu_by_proc", None) or [])),
                "server_metrics": None if before_m is None else
                {"before": before_m, "after": after_m, "per_step": per_step, "k": k}}
        if c1:
            cell["c1_counters"] = c1
        self.sink.cell(cell)
        self.cells_done += 1
        if self.on_cell is not None:
            self.on_cell(cell)
        return cell


CLIENT_SATURATED = 0.9  # the event loop busy this share of a cell's wall time: the client set the pace


def client_load(cpu_s: float, wall_s: float, chunks: int, procs_cpu: list[float] | None = None) -> dict:
    """The client's own load in one cell: CPU of the event-loop thread (request building, SSE parsing,
    timing, records; an in-process engine steps on its own thread and is not counted) and, with client
    processes (--client-procs, harness/adapters/sharded.py), each one's loop CPU; `busy` is the busiest
    loop's share of the wall time, the headroom 1 - busy, CPU per streamed chunk over all of them, and
    `saturated` when busy >= CLIENT_SATURATED (then the figures may measure the client, not the server)."""
    procs = list(procs_cpu or [])
    busy = max([cpu_s, *procs]) / wall_s if wall_s > 0 else 0.0
    total = cpu_s + sum(procs)
    return {"cpu_s": round(total, 6), "busy": round(busy, 4), "headroom": round(max(0.0, 1.0 - busy), 4),
            "cpu_us_per_chunk": round(total / chunks * 1e6, 2) if chunks else None,
            "saturated": busy >= CLIENT_SATURATED, "procs": max(1, len(procs))}


def _describe(ad: EngineAdapter) -> dict:
    try:
        return ad.describe()
    except Exception:
        return {}


def _k(ad: EngineAdapter) -> int | None:
    cfg = _describe(ad).get("config")
    k = cfg.get("k") if isinstance(cfg, dict) else None
    return int(k) if isinstance(k, int) and k > 0 else None


async def _one_by_one(ad: EngineAdapter, reqs: list, before: dict, before_m: dict | None,
                      record: Callable[[GenResult], None], k: int | None, per_step: bool
                      ) -> tuple[list[GenResult], float, dict]:
    """c1 with a counter snapshot after every request: a request that reports no spec counts of its own
    gets the counter delta around it (source "counters-c1"). Where the endpoint has /metrics each snapshot
    is a settle against that one request (suites/metrics_audit.py), so a count the server publishes late
    never lands on the next request. From the first request whose counters did not settle on, no request of
    the cell gets counts (a neighbour would be credited with its share). Returns the results, the time spent
    scraping (taken off the cell's duration) and the attribution's record: {"attributed": n} and, where it
    stopped, "unsettled_at" (the request's index in the cell); {} when no request needed counts."""
    out, prev, prev_m, scrape_t = [], before, before_m, 0.0
    given, unsettled = 0, None
    for i, r in enumerate(reqs):
        res = (await ad.generate([r]))[0]
        t = time.perf_counter()
        s = await settle(ad, prev_m, [res], k=k, per_step=per_step) if prev_m is not None else None
        if s is not None:
            prev_m, after = s, s.get("spec")
            if unsettled is None and not (s.get("settle") or {}).get("agreed"):
                unsettled = i
        else:
            after = await _counters(ad)
        scrape_t += time.perf_counter() - t
        d = counters_delta(prev, after)
        if unsettled is None and res.ok and res.spec is None and d is not None and d.get("num_drafts") is not None:
            res.spec = {**d, "source": "counters-c1"}
            given += 1
        prev = after if after is not None else prev
        record(res)
        out.append(res)
    rec: dict = {"attributed": given} if given or unsettled is not None else {}
    if unsettled is not None:
        rec["unsettled_at"] = unsettled
    return out, scrape_t, rec


async def _counters(ad: EngineAdapter) -> dict | None:
    try:
        return await ad.spec_counters()
    except Exception:  # an unreachable /metrics must not stop the sweep; acceptance falls back to none
        return None


def _level_name(cfg: SweepConfig, level: float) -> str:
    if cfg.mode == "closed":
        return f"c{int(level)}"
    return f"r{level:g}"
