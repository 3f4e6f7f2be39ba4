"""longserve: an inference and serving engine for long video generation with diffusion transformers, and LSS
long-text scoring.

    from longserve import VideoPipeline, TextScoringPipeline

The installed package is this one name; the repository keeps its folders (`engine/`, `pipelines/`, `server/`,
`weights/`), which the build maps under it (`longserve.engine`, ...: pyproject.toml's package-dir). The user's
classes are imported on first use, so `import longserve` (the CLI's first step) stays light.
"""

from __future__ import annotations

__version__ = "0.1.0"

#: what `from longserve import X` gives, and the module that defines it
_EXPORTS = {
    "VideoPipeline": "longserve.pipelines.video",
    "VideoOutput": "longserve.pipelines.video",
    "TextScoringPipeline": "longserve.pipelines.scoring",
    "ScoreResult": "longserve.pipelines.scoring",
    "RequestError": "longserve.engine.errors",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'longserve' has no attribute {name!r}")
