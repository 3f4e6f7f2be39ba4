"""The user-facing Python API."""

from pipelines.scoring import ScoreResult, TextScoringPipeline  # noqa: F401
from pipelines.video import VideoOutput, VideoPipeline  # noqa: F401
