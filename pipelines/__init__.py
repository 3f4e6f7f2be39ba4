"""The user-facing Python API."""

from longserve.pipelines.scoring import ScoreResult, TextScoringPipeline  # noqa: F401
from longserve.pipelines.video import VideoOutput, VideoPipeline  # noqa: F401
