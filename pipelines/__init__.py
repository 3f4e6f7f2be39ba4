"""The user-facing Python API."""

from pipelines.video import VideoOutput, VideoPipeline  # noqa: F401
