"""What the video engine's jobs (`engine.worker`) report to the coordinator: small frozen dataclasses that cross
the pool's result queue. The scheduler (`engine.scheduler`) and the families (`engine.families`) read and make
them; this module imports nothing of either, so `engine.worker` -> `engine.families` -> here is no circle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from longserve.engine.outputs import LiveChunkInfo, Sound


@dataclass(frozen=True)
class Progress:
    """What the coordinator learns of a request after every job."""

    steps_done: int
    batch_key: tuple
    decodable: bool            # final frames wait to be decoded
    num_steps: int | None = None    # when the totals changed since admission (a live session was stopped)
    num_frames: int | None = None
    model: int = 0             # which of the family's denoisers its next step uses (Wan 2.2: the expert)
    switch_ready: bool = True  # a prompt switch sent now applies at once (a causal request at a chunk's start,
                               # with no switch applied in that chunk yet); the scheduler holds it until then
    chunk_steps: int = 0       # a chunk loop's forwards per chunk (outside the serial live loop: a job's length)
    chunk: int = -1            # a chunk loop's chunk being made (-1: not a chunk loop)
    chunks_per_job: int = 1    # chunks one job may make (the stages live loop's stream batch: a switch's promise)


class EncodeRefused(Exception):
    """Raised on *every* rank by `VideoFamily.broadcast_from_first` when rank 0's `make` failed: rank 0 broadcast
    the failure in place of its result, so the collective completed everywhere and nothing is left pending. The
    `admit` job turns it into its request's `AdmitFailure` (the request fails alone; the pool stays up)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class AdmitFailure:
    """What `admit` returns instead of an `Admission` when the request could not be admitted (its prompt or image
    could not be encoded): the request fails, no other request or worker is touched. No traceback: the worker's
    log has it."""

    message: str
    field: str | None = None


@dataclass(frozen=True)
class Admission:
    num_steps: int
    num_frames: int
    encode_s: float
    progress: Progress


@dataclass(frozen=True)
class StepResult:
    progress: list[dict]       # per step run: {request_id: Progress}
    compute_s: float
    compiled_graphs: int = 0   # graphs this worker compiled so far (`compile` blocks; 0 without)


@dataclass(frozen=True)
class DecodedChunk:
    """Frames [start, stop) of a request (rank 0's view); `done` once every frame was handed out."""

    frames: object
    start: int
    stop: int
    num_frames: int
    vae_s: float
    done: bool
    progress: Progress
    timings: dict = field(default_factory=dict)
    audio: Sound | None = None                   # a model's sound, handed out once (engine.outputs)
    live: LiveChunkInfo | None = None            # a causal model's chunk: its index and prompt



@dataclass(frozen=True)
class LiveTick:
    """What `live_tick` (a decode and the steps beside it, engine/live_loop.py) reports from one rank: rank 0 the
    steps' result and the chunk's place (`decoded`, its frames None unless rank 0 decoded them), the lane rank the
    frames and its decode's seconds. The coordinator puts the two together (`engine.core`)."""

    step: StepResult | None = None
    decoded: DecodedChunk | None = None
    frames: object = None
    vae_s: float = 0.0
    vae_total_s: float = 0.0           # the lane's VAE seconds for the request so far (its `timings["vae_s"]`)
    lane: bool = False                 # this rank decoded (its frames and vae_s are the chunk's)
