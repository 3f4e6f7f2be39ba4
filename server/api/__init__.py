"""The OpenAI-compatible HTTP service: protocol models, routes, the video and scoring services, the job store."""
