"""`Scheduler`: step-level batching of video requests, as decisions (coordinator side, no I/O).

A diffusion request is a loop of denoising steps, so, as vLLM does per decoding
iteration, the scheduler decides at every *step boundary* what the workers do next.
`schedule()` returns that decision as a `SchedulerOutput`; the engine core
(`engine/core.py`) carries it out on the worker pool, applies the failure policy and
reports the results back (`admitted`, `stepped`, `decoded`, `fail`, `requeue`). The
scheduler never touches the pool, the model, HTTP or files.

Lifecycle (`RequestState`), one way only except for the crash recovery noted below::

    WAITING --admit--> RUNNING --last step--> DECODING --last frame--> FINISHED_COMPLETED
       |                  |                      |
       +------------------+----------------------+--> FINISHED_CANCELLED | FINISHED_FAILED

- WAITING: submitted, no worker state; a FIFO queue.
- RUNNING: admitted (prompt encoded on the workers, latents and a diffusers scheduler of
  its own prepared there); it takes part in denoising batches. Frames that are already
  final (a long video's finished segments) are decoded meanwhile.
- DECODING: denoised; its remaining frames are VAE-decoded a chunk at a time.
- FINISHED_*: its worker state is released.

One iteration's decision (`schedule()`), in the order the engine core carries it out:

1. `release`: running requests whose abort was asked for (`abort(id, reason)`: FINISHED_CANCELLED,
   or FINISHED_FAILED when the reason is a failure): an aborted request leaves at the next boundary
   and its slot is free at once.
2. `admit`: waiting requests, oldest first, while fewer than `max_running` are admitted
   (RUNNING + DECODING). Live sessions do not take these slots: their memory is fixed and counted
   against `live_kv_budget` when they are submitted, and the server's admission counts their work, so
   sessions that run for minutes never keep a video waiting for a slot (issue 32).
3. `decode`: one chunk of at most `decode_chunk_frames` frames of the oldest request that
   has final frames not yet decoded, so a long VAE decode is spread over several
   boundaries and never stalls the others' steps for long. Outside the serial live loop
   (`live_loop`) the engine core runs it in the same job as the step, on a decode lane
   beside the steps (engine/live_lane.py), so it does not hold the step to one step.
4. `step`: the batch and how many steps it runs -- ONE, or, while nothing else could
   happen at the boundaries in between (nobody waits or was just admitted, nothing is
   cancelled or has frames to decode, no other batch takes turns), up to
   `max_steps_per_job` steps in one worker job, which saves the pool's per-job overhead; the
   job stops early when a request finishes or its batch key changes. Requests with the
   same batch key (the family's: latent shape, and anything else one forward needs in
   common, such as Wan 2.2's expert) share a batch, whatever their timesteps and guidance
   scales; key groups take turns round-robin, and a group sends its oldest requests first,
   up to `max_batch`, then its live sessions, the least recently stepped first (a session has no
   end to wait for: past `max_batch` they take turns, and a video of their shape is never left
   out behind them). A request admitted in this iteration joins the batches of the next:
   its batch key is known once its admission ran.

Live sessions (causal models, `engine/families/causal_wan.py`) are requests too: a chunk loop of
`steps_per_chunk` steps per chunk whose frames are decoded chunk by chunk, plus `update`: changes
asked for while a request runs (a new prompt, stop), carried out between admission and decode
(`Scheduler.update`, `SchedulerOutput.update`). A causal request's KV cache is counted against
`live_kv_budget` when it is submitted (`KVBudgetError` past it) and freed when it finishes.
A prompt switch (`switch`) is held here, one per request: a newer one replaces the held one (it is
never applied, and `PromptSwitch.replaced` says so), and the held one is sent only when the request's
last progress says it applies at once (`Progress.switch_ready`: a chunk's start, once per chunk). So a
burst of switches costs one text encode and one recache per chunk, however many were sent.
"""

from __future__ import annotations

import collections
import enum
import itertools
import threading
import time
from dataclasses import dataclass, field

from longserve.engine.config import EngineConfig
from longserve.engine.outputs import OutputStream, RequestFailure
from longserve.engine.request import GenerationSpec


class RequestState(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    DECODING = "decoding"
    FINISHED_COMPLETED = "finished_completed"
    FINISHED_FAILED = "finished_failed"
    FINISHED_CANCELLED = "finished_cancelled"

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")


class QueueFullError(RuntimeError):
    """`submit` refused: the waiting queue already holds `max_queue` requests."""


class KVBudgetError(QueueFullError):
    """`submit` refused: the request's KV cache would not fit in `live_kv_budget` beside the others'."""


@dataclass(eq=False)
class ScheduledRequest:
    """One request as the coordinator tracks it (the worker-side state lives in the model family)."""

    spec: GenerationSpec
    seq: int                                   # arrival order: the "oldest first" key
    state: RequestState = RequestState.WAITING
    num_steps: int = 0                         # known once admitted
    steps_done: int = 0
    num_frames: int = 0                        # output frames, known once admitted
    frames_done: int = 0                       # output frames decoded and handed out
    batch_key: tuple | None = None             # the family's: equal keys can share a step
    model: int = 0                             # the denoiser its next step uses (a two-expert model's expert)
    passed_over: int = 0                       # offload: batches of the other expert run while it waited
    decodable: bool = False                    # final frames wait to be decoded
    abort_reason: str | RequestFailure | None = None   # why it ends before its time (`Scheduler.abort`)
    solo: bool = False                         # runs in a batch of its own (after an out-of-memory batch)
    error: RequestFailure | None = None        # when FINISHED_FAILED
    admissions: int = 0                        # > 1 after a crash sent it back to the queue
    queue_position: int | None = None          # the last position its stream was told
    kv_bytes: int = 0                          # KV cache it holds per worker (causal models), counted on submit
    updates: list = field(default_factory=list)  # changes asked for while it runs (a live session's stop)
    held_prompt: dict | None = None            # the prompt switch waiting for `switch_ready` (one at most)
    prompts: int = 1                           # prompt indexes given out: the next switch's is this one
    switch_ready: bool = True                  # its last progress: a switch sent now applies at once
    chunk_steps: int = 0                       # a chunk loop's forwards per chunk (0: not a chunk loop)
    chunk: int = -1                            # a chunk loop's chunk being made, as last reported
    chunks_per_job: int = 1                    # chunks a job of it may make (the stages live loop's stream batch)
    edge_s: float = 0.0                        # the coordinator's reads of its frames (shared memory, "np")
    last_stepped: int = -1                     # the boundary of its last denoising batch (sessions take turns)
    timings: dict = field(default_factory=dict)
    submitted_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    stream: OutputStream = field(default_factory=OutputStream)

    @property
    def id(self) -> str:
        return self.spec.request_id

    @property
    def aborted(self) -> bool:
        """Asked to end before its time: it leaves at the next step boundary (a waiting one has left)."""
        return self.abort_reason is not None

    @property
    def live(self) -> bool:
        """A live session: no end of its own to wait for (outside `max_running`, takes turns in a batch)."""
        return self.spec.live

    def progressed(self, p) -> None:
        """Take in what a worker job reports of it (`engine.results.Progress`)."""
        self.steps_done, self.batch_key, self.decodable = p.steps_done, tuple(p.batch_key), p.decodable
        self.model = p.model
        self.switch_ready = p.switch_ready
        self.chunk = p.chunk
        self.chunk_steps = p.chunk_steps
        self.chunks_per_job = p.chunks_per_job
        if p.num_steps is not None:
            self.num_steps = p.num_steps
        if p.num_frames is not None:
            self.num_frames = p.num_frames


@dataclass(frozen=True)
class PromptSwitch:
    """What a prompt switch did: the new prompt's index (what the chunks made under it carry) and the index of the
    held switch it replaced, which will never apply (None when none was held)."""

    prompt_index: int
    replaced: int | None = None
    by_chunk: int | None = None    # a chunk loop's: it applies at this chunk at the latest (the chunk being made as
                                   # the workers last reported, plus one: a job may be making it)


@dataclass
class StepPlan:
    batch: list[ScheduledRequest]
    num_steps: int


@dataclass
class SchedulerOutput:
    """What the workers do at this step boundary (see the module docstring), in this order."""

    release: list[ScheduledRequest] = field(default_factory=list)
    admit: list[ScheduledRequest] = field(default_factory=list)
    update: list[tuple[ScheduledRequest, list[dict]]] = field(default_factory=list)
    decode: ScheduledRequest | None = None
    decode_frames: int = 0
    step: StepPlan | None = None

    @property
    def empty(self) -> bool:
        return not (self.release or self.admit or self.update or self.decode or self.step)


class Scheduler:
    """Request states and the decision of each step boundary (thread-safe: submit and cancel come from anywhere)."""

    def __init__(self, config: EngineConfig):
        self.max_batch = config.max_batch
        self.max_running = config.running_limit
        self.max_waiting = config.max_queue
        self.decode_chunk_frames = config.decode_chunk_frames
        self.max_steps_per_job = config.max_steps_per_job
        self.overlap = config.live_loop != "serial"
        self.kv_budget = config.live_kv_budget_bytes
        if self.kv_budget is None:            # a quarter of a worker's memory (engine/memory.py)
            from longserve.engine.memory import default_live_kv_budget

            self.kv_budget = default_live_kv_budget(config.device, config.workers)
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._requests: dict[str, ScheduledRequest] = {}      # every unfinished request
        self._waiting: collections.deque[ScheduledRequest] = collections.deque()
        self._admitted: list[ScheduledRequest] = []           # RUNNING + DECODING, in admission order
        self._key_turns: collections.deque[tuple] = collections.deque()  # round-robin order of batch keys
        self._boundary = 0                                    # denoising batches decided so far
        # expert offload: batches of the resident expert first (see `_select_batch_locked`)
        self.group_by_model = config.offload == "expert"
        self.max_model_wait = config.offload_max_wait
        self.resident_model: int | None = None

    # -- requests come and go (any thread) --------------------------------------------------------

    def submit(self, spec: GenerationSpec, kv_bytes: int = 0) -> ScheduledRequest:
        """Queue a validated request; it is admitted at a coming step boundary. `kv_bytes`: the KV cache it will
        hold per worker, counted against `live_kv_budget` from now until it finishes (KVBudgetError past it)."""
        with self._lock:
            if spec.request_id in self._requests:
                raise ValueError(f"request_id {spec.request_id!r} is already scheduled")
            if self.max_waiting is not None and len(self._waiting) >= self.max_waiting:
                raise QueueFullError(f"the queue is full ({self.max_waiting} requests waiting)")
            if kv_bytes and self.kv_budget is not None:
                held = [r.kv_bytes for r in self._requests.values() if r.kv_bytes]
                if sum(held) + kv_bytes > self.kv_budget:
                    mib = 1 << 20
                    raise KVBudgetError(
                        f"the live KV budget is full: {len(held)} session(s) hold {sum(held) / mib:.1f} MiB of "
                        f"{self.kv_budget / mib:.1f} MiB per worker and this one needs {kv_bytes / mib:.1f} MiB; "
                        f"retry when a session ends")
            req = ScheduledRequest(spec=spec, seq=next(self._seq), kv_bytes=kv_bytes,
                                   # a prompt schedule's prompts have the first indexes (the causal family's)
                                   prompts=max(1, len(spec.options.get("prompt_schedule") or ())))
            self._requests[req.id] = req
            self._waiting.append(req)
        return req

    def abort(self, request_id: str,
              reason: str | RequestFailure = "cancelled") -> tuple[ScheduledRequest | None, bool]:
        """Ask a request to end, for `reason`: a word (it ends Cancelled: "cancelled", "deleted", ...) or a
        `RequestFailure` (it ends Failed). A waiting request leaves the queue now, a running one at the next step
        boundary; the first reason asked for is the one it ends with. Returns (the request or None when it is
        unknown or finished, whether it was dequeued now: decided under the lock, so exactly one thread tells the
        request how it ended)."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.state.finished:
                return None, False
            if req.abort_reason is None:
                req.abort_reason = reason
            if req.state is not RequestState.WAITING:
                return req, False
            self._waiting.remove(req)
            self._finish_aborted_locked(req)
        return req, True

    def update(self, request_id: str, payload: dict) -> bool:
        """Ask a request to change course at the next step boundary (after its admission, in the order asked).
        False when it is unknown or finished. A prompt goes through `switch`."""
        if "prompt" in payload:
            return self.switch(request_id, payload) is not None
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.state.finished or req.aborted:
                return False
            req.updates.append(payload)
        return True

    def switch(self, request_id: str, payload: dict) -> PromptSwitch | None:
        """Hold a prompt switch (`payload["prompt"]`) for the request's next chunk start, replacing the one held
        (see the module docstring); None when the request is unknown or finished."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.state.finished or req.aborted:
                return None
            replaced = req.held_prompt["prompt_index"] if req.held_prompt is not None else None
            req.held_prompt = {**payload, "prompt_index": req.prompts}
            req.prompts += 1
            by_chunk = max(req.chunk, 0) + req.chunks_per_job if req.chunk_steps or req.chunk >= 0 else None
            return PromptSwitch(req.held_prompt["prompt_index"], replaced, by_chunk)

    def kv_bytes_held(self) -> int:
        with self._lock:
            return sum(r.kv_bytes for r in self._requests.values())

    def get(self, request_id: str) -> ScheduledRequest | None:
        with self._lock:
            return self._requests.get(request_id)

    def unfinished(self) -> list[ScheduledRequest]:
        """Every request queued or running (any thread)."""
        with self._lock:
            return list(self._requests.values())

    def waiting_ids(self) -> list[str]:
        """Queued request ids, next to be admitted first."""
        with self._lock:
            return [r.id for r in self._waiting]

    def moved_in_line(self) -> list[tuple[ScheduledRequest, int]]:
        """Waiting requests whose place in line changed since they were last told (and now are)."""
        with self._lock:
            moved = [(r, i) for i, r in enumerate(self._waiting) if r.queue_position != i]
            for r, i in moved:
                r.queue_position = i
        return moved

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_admitted(self) -> int:
        return len(self._admitted)

    @property
    def has_work(self) -> bool:
        return bool(self._waiting) or bool(self._admitted)

    # -- the decision of one step boundary ---------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        with self._lock:
            for r in [r for r in self._admitted if r.aborted]:
                self._admitted.remove(r)
                self._finish_aborted_locked(r)
                out.release.append(r)
            stepping = [r for r in self._admitted if r.state is RequestState.RUNNING]   # admitted before now
            slots = self.max_running - sum(not r.live for r in self._admitted)
            for req in list(self._waiting):
                if not req.live:
                    if slots <= 0:
                        continue
                    slots -= 1
                self._waiting.remove(req)
                req.state = RequestState.RUNNING
                req.steps_done = req.frames_done = 0
                req.decodable = False
                req.batch_key = None
                req.queue_position = None
                req.admissions += 1
                self._admitted.append(req)
                out.admit.append(req)
            for r in stepping:
                if r.batch_key is None or r.aborted:
                    continue
                payloads, r.updates = r.updates, []
                if r.held_prompt is not None and r.switch_ready:
                    payloads.append(r.held_prompt)
                    r.held_prompt = None
                if payloads:
                    out.update.append((r, payloads))
            ready = [r for r in self._admitted if r.decodable and not r.aborted]
            if ready:
                out.decode = min(ready, key=lambda r: r.seq)
                out.decode_frames = self.decode_chunk_frames
            batch = self._select_batch_locked(stepping)
            if batch:
                # outside the serial live loop a decode runs beside the steps (engine/live_lane.py): no reason to
                # run fewer of them
                quiet = (not self._waiting and not out.admit and (out.decode is None or self.overlap)
                         and not out.update
                         and not any(r.updates or r.held_prompt for r in stepping)
                         and all(r in batch for r in stepping))
                # outside the serial loop a chunk's forwards go in one job (it ends at the next chunk's start)
                limit = max(self.max_steps_per_job, *(r.chunk_steps for r in batch)) if self.overlap \
                    else self.max_steps_per_job
                steps = 1 if not quiet else max(1, min(limit, *(r.num_steps - r.steps_done for r in batch)))
                out.step = StepPlan(batch, steps)
                self._boundary += 1
                for r in batch:
                    r.last_stepped = self._boundary
        return out

    def _select_batch_locked(self, candidates: list[ScheduledRequest]) -> list[ScheduledRequest]:
        groups: dict[tuple, list[ScheduledRequest]] = {}
        for r in sorted(candidates, key=lambda r: r.seq):
            if not r.aborted and r.batch_key is not None and r.steps_done < r.num_steps:
                groups.setdefault(("solo", r.id) if r.solo else r.batch_key, []).append(r)
        if not groups:
            return []
        # round-robin over batch keys: new keys join at the back of the rotation
        self._key_turns = collections.deque(s for s in self._key_turns if s in groups)
        self._key_turns.extend(s for s in groups if s not in self._key_turns)
        eligible = set(groups)
        if self.group_by_model:
            eligible = self._model_phase_locked(groups)
        key = next(k for k in self._key_turns if k in eligible)
        self._key_turns.remove(key)
        self._key_turns.append(key)
        # videos oldest first (they end), then sessions least recently stepped first (they take turns)
        order = sorted(groups[key], key=lambda r: (r.live, r.last_stepped if r.live else 0, r.seq))
        batch = order[:self.max_batch]
        if self.group_by_model:
            self.resident_model = batch[0].model
            for group in groups.values():
                for r in group:
                    r.passed_over = 0 if r.model == self.resident_model else r.passed_over + 1
        return batch

    def _model_phase_locked(self, groups: dict[tuple, list[ScheduledRequest]]) -> set[tuple]:
        """Expert offload: the keys whose expert is the resident one, while any is runnable, so that staggered
        requests finish one expert's steps together and one swap moves them all to the other; a key whose
        oldest request was passed over `max_model_wait` times goes first (nobody waits for ever)."""
        overdue = {k for k, g in groups.items() if g[0].model != self.resident_model
                   and max(r.passed_over for r in g) >= self.max_model_wait}
        if overdue:
            return overdue
        resident = {k for k, g in groups.items() if g[0].model == self.resident_model}
        return resident or set(groups)

    # -- results of the work (the engine core's thread) -----------------------------------------------

    def admitted(self, req: ScheduledRequest, admission) -> None:
        """Its admission job (`engine.results.Admission`) ran."""
        req.num_steps, req.num_frames = admission.num_steps, admission.num_frames
        req.progressed(admission.progress)

    def stepped(self, req: ScheduledRequest, progress) -> bool:
        """One step of `req` ran; returns True when that was its last denoising step (now DECODING)."""
        req.progressed(progress)
        if req.steps_done >= req.num_steps:
            with self._lock:
                if req.state is RequestState.RUNNING:
                    req.state = RequestState.DECODING
            return True
        return False

    def decoded(self, req: ScheduledRequest, chunk) -> bool:
        """A chunk of `req`'s frames was decoded (`engine.results.DecodedChunk`); returns True when that was its
        last (FINISHED_COMPLETED)."""
        req.progressed(chunk.progress)
        req.frames_done = chunk.stop
        req.timings = dict(chunk.timings)
        if not chunk.done:
            return False
        with self._lock:
            if req in self._admitted:
                self._admitted.remove(req)
            self._finish_locked(req, RequestState.FINISHED_COMPLETED)
        return True

    def fail(self, req: ScheduledRequest, error: RequestFailure) -> bool:
        """An admitted request failed (FINISHED_FAILED); False, and nothing changes, if it is not admitted."""
        with self._lock:
            if req not in self._admitted:
                return False
            self._admitted.remove(req)
            self._finish_locked(req, RequestState.FINISHED_FAILED, error)
        return True

    def requeue(self, req: ScheduledRequest, solo: bool = False) -> bool:
        """An admitted request goes back to the front of the queue (its worker state is gone), optionally to run
        in a batch of its own; False, and nothing changes, if it is not admitted."""
        with self._lock:
            if req not in self._admitted:
                return False
            self._admitted.remove(req)
            req.solo = req.solo or solo
            self._requeue_locked(req)
        return True

    def close(self) -> list[ScheduledRequest]:
        """Every unfinished request, finished now: as its abort asked, else FINISHED_FAILED (the engine closed
        under it)."""
        error = RequestFailure(code="engine_closed", message="the engine was closed before this request finished",
                               kind="internal")
        with self._lock:
            gone = list(self._requests.values())
            for r in gone:
                if r.aborted:
                    self._finish_aborted_locked(r)
                else:
                    self._finish_locked(r, RequestState.FINISHED_FAILED, error)
            self._waiting.clear()
            self._admitted.clear()
        return gone

    def requeue_admitted(self) -> list[ScheduledRequest]:
        """After a pool restart every admitted request lost its worker state: queue it again, in front, in
        admission order (a cancelled one just finishes). Returns the requests whose admission had run (the
        ones to tell); one whose admission had not (the same boundary's) goes back as if never taken."""
        with self._lock:
            back = sorted(self._admitted, key=lambda r: r.seq)
            self._admitted.clear()
            told = []
            for r in reversed(back):
                if r.batch_key is None and not r.aborted:
                    r.admissions -= 1                 # its admission job never ran
                    self._requeue_locked(r)
                    continue
                told.insert(0, r)
                if r.aborted:
                    self._finish_aborted_locked(r)
                else:
                    self._requeue_locked(r)
        return told

    def _requeue_locked(self, r: ScheduledRequest) -> None:
        r.state = RequestState.WAITING
        r.steps_done = r.frames_done = 0
        r.decodable = False
        r.batch_key = None
        self._waiting.appendleft(r)

    def _finish_aborted_locked(self, req: ScheduledRequest) -> None:
        """An aborted request ends as its reason says: FINISHED_FAILED for a failure, else FINISHED_CANCELLED."""
        if isinstance(req.abort_reason, RequestFailure):
            self._finish_locked(req, RequestState.FINISHED_FAILED, req.abort_reason)
        else:
            self._finish_locked(req, RequestState.FINISHED_CANCELLED)

    def _finish_locked(self, req: ScheduledRequest, state: RequestState, error: RequestFailure | None = None) -> None:
        req.state = state
        req.error = error
        req.finished_at = time.time()
        self._requests.pop(req.id, None)
