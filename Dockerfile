# longserve for GPU machines: the OpenAI-compatible video server on CUDA PyTorch.
#
#   make docker                       # docker build -t longserve:latest .
#   docker run --gpus all --stop-timeout 30 -p 8000:8000 \
#       -v /path/to/checkpoints:/models:ro -v longserve-data:/data \
#       longserve:latest --model /models/Wan2.1-T2V-1.3B-Diffusers --workers 4    # bf16, /data, 0.0.0.0:8000
#
# Weights are not baked in: mount a directory of diffusers-format checkpoints at /models.
# Jobs and videos go to /data (a volume, so completed videos survive a container restart).
# The server runs as the unprivileged user `longserve`, which owns /data (mode 0700: every prompt is there).
#
# It listens on 0.0.0.0 and, with no key, is open to anyone who reaches the port (it warns so at start
# and in /health). Give it a key in the environment or in a file, never on the command line (the process
# list shows arguments):
#   docker run ... -e LONGSERVE_API_KEY=sk-... longserve:latest ...
#   docker run ... -v /srv/keys:/run/secrets:ro -e LONGSERVE_API_KEY_FILE=/run/secrets/longserve_keys ...
# (a key file holds one key per line, one per client). See docs/serving.md, "Deployment and security".

# Several replicas, PostgreSQL and an S3-compatible store on one machine: deploy/compose.yaml; a cluster: the Kubernetes
# base in deploy/kubernetes/ (docs/serving.md, "Deployment").
#
# The base image's torch is the release the GPU figures of docs/gpu.md were measured on (PyTorch 2.11.0, CUDA 13.0);
# tests/server/test_docker.py keeps the two equal.
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda13.0-cudnn9-runtime
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1

WORKDIR /opt/longserve

# Metadata first, then the packages (the tiny checkpoints in weights/ make the image
# testable without a mount: --model tiny-latte; their builders, tools/weights/, stay out).
COPY pyproject.toml setup.py README.md constraints.txt ./
COPY longserve ./longserve
COPY engine ./engine
COPY pipelines ./pipelines
COPY server ./server
COPY weights ./weights

# The project with its GPU extra (xformers) and boto3 (`--media-store s3://`). The constraint keeps the base image's CUDA
# torch: pip then picks the xformers build made for it instead of replacing torch.
RUN python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > /tmp/torch-constraint.txt \
 && pip install -c /tmp/torch-constraint.txt -c constraints.txt '.[gpu,s3]' \
 && python -c "import xformers, imageio_ffmpeg; print(xformers.__version__, imageio_ffmpeg.get_ffmpeg_exe())" \
 && rm /tmp/torch-constraint.txt

# An unprivileged user owns the data dir; a new named volume is created from it (owner and mode kept)
RUN useradd --system --uid 10001 --user-group --create-home --home-dir /home/longserve longserve \
 && mkdir -p /data && chown longserve:longserve /data && chmod 0700 /data
USER longserve

VOLUME ["/data"]
EXPOSE 8000
# Ready (/health/ready: the model loaded and warmed, the store reachable) on the port the server was given: the probe
# reads the server's own command line (process 1: the entrypoint, the arguments after the image name, a --config
# file), so `docker run IMAGE ... --port 9000` is probed on 9000. The start period covers a large model's load.
HEALTHCHECK --interval=30s --timeout=10s --start-period=600s CMD ["python", "-m", "longserve.server.cli.probe"]

# Stopping: SIGTERM drains (no new videos; running ones get --drain-seconds, default 20, to finish; the rest
# fail with server_shutdown), then the server exits. Docker's default 10 s stop timeout would kill a drain:
# give it 30 s (docker run --stop-timeout 30, docker stop -t 30, compose stop_grace_period: 30s; Kubernetes'
# terminationGracePeriodSeconds is 30 by default). docs/serving.md, "Stopping".
STOPSIGNAL SIGTERM

# The entrypoint carries what every run of the image needs (`docker run IMAGE ARGS...` replaces CMD, not the
# entrypoint): bf16 on CUDA, the absolute data dir the user owns, every interface, port 8000. CMD is the default
# model only; arguments after the image name replace it (a flag given again there wins: argparse keeps the last).
ENTRYPOINT ["longserve", "serve", "--device", "cuda", "--dtype", "bfloat16", "--data-dir", "/data", \
            "--host", "0.0.0.0", "--port", "8000"]
CMD ["--model", "/models/Wan2.1-T2V-1.3B-Diffusers"]
