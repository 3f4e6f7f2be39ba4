"""The deployment recipes checked against what they run: deploy/compose.yaml and the Kubernetes base in
deploy/kubernetes/ against the Dockerfile (its ENTRYPOINT, user, data dir and port) and the server's own flags and
routes; `docker compose config` and `kubectl kustomize` where those binaries work; the HEALTHCHECK's probe reads the
port the server was given; a store that does not answer stops the server with one line naming --store."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from dockerfile import docker_run_argv, instructions, pyproject, readme_docker_line

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def serve_args(image_args: list[str]):
    """What `docker run IMAGE ARGS...` (or a pod's `args:`) makes the server parse: Docker's rule, then serve's
    own parser."""
    from longserve.server.cli import build_parser

    argv = docker_run_argv(image_args)
    assert argv[:2] == ["longserve", "serve"] and "serve" not in image_args[:1], image_args
    return build_parser().parse_args(argv[1:])


def image_user() -> tuple[str, int]:
    setup = next(a for k, a in instructions() if k == "RUN" and "useradd" in a)
    uid = int(re.search(r"--uid (\d+)", setup).group(1))
    return [a for k, a in instructions() if k == "USER"][-1], uid


def probe(path: str):
    """GET `path` of the server's app as kubelet does (the pod's IP as the Host; the server not started: what a probe
    sees while the model loads)."""
    from starlette.testclient import TestClient

    from longserve.server.api.app import create_app
    from longserve.server.api.service import ServeConfig, VideoService

    with TestClient(create_app(VideoService(ServeConfig.from_options(data_dir="/nonexistent")))) as client:
        return client.get(path, headers={"Host": "10.1.2.3:8000"})


# -- compose ----------------------------------------------------------------------------------------------------


def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


def test_compose_replicas_run_the_image_s_entrypoint_with_its_user_data_dir_port_and_a_drain_long_enough():
    from longserve.server.api.config import DEFAULT_DRAIN_S

    spec = compose()
    services = spec["services"]
    replicas = {n: s for n, s in services.items() if s.get("image", "").startswith("longserve")}
    assert len(replicas) >= 2, "several API replicas"
    make_tag = re.search(r"docker build -t (\S+) \.", (ROOT / "Makefile").read_text()).group(1)
    user, uid = image_user()
    ids = set()
    for name, svc in replicas.items():
        assert svc["image"] == make_tag, f"{name}: the image `make docker` builds"
        assert "user" not in svc, f"{name}: runs as the image's user ({user}, uid {uid})"
        args = serve_args([str(a) for a in svc["command"]])
        ids.add(args.replica_id)
        container_ports = {int(str(p).rsplit(":", 1)[1]) for p in svc["ports"]}
        assert container_ports == {args.port}, f"{name}: publishes the port the server listens on"
        targets = {str(v).removesuffix(":ro").removesuffix(":rw").rsplit(":", 1)[1] for v in svc["volumes"]}
        assert args.data_dir in targets, f"{name}: a volume at the data dir the image makes for {user}"
        setup = next(a for k, a in instructions() if k == "RUN" and "useradd" in a)
        assert f"mkdir -p {args.data_dir}" in setup and f"chown {user}:{user} {args.data_dir}" in setup
        assert any(t == "/models" for t in targets) and args.model.startswith("/models/")
        grace = float(str(svc["stop_grace_period"]).rstrip("s"))
        assert grace >= args.drain_seconds + 10 >= DEFAULT_DRAIN_S + 10
        env = svc["environment"]
        store = env["LONGSERVE_STORE"]                  # --store's default, out of the process list
        assert "--store" not in svc["command"] and re.match(r"postgresql://longserve:\$\{\w+[^}]*\}@db:5432/", store)
        db = services["db"]["environment"]
        assert store.rsplit("/", 1)[1] == db["POSTGRES_DB"] and db["POSTGRES_USER"] == "longserve"
        assert args.media_store.startswith("s3://") and env["AWS_ENDPOINT_URL_S3"].startswith("http://minio:")
        bucket = args.media_store[len("s3://"):].split("/")[0]
        assert f"local/{bucket}" in " ".join(services["bucket"]["command"]), "the bucket is made before use"
        [secret] = svc["secrets"]
        assert env["LONGSERVE_API_KEY_FILE"] == f"/run/secrets/{secret}" and secret in spec["secrets"]
        [gpus] = svc["deploy"]["resources"]["reservations"]["devices"]
        assert len(gpus["device_ids"]) == args.workers, f"{name}: one GPU per worker"
        for dep in svc["depends_on"]:
            assert dep in services
    assert len(ids) == len(replicas), "each replica its own --replica-id"


def test_docker_compose_config_accepts_the_file_where_compose_exists(tmp_path):
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no `docker compose` here (the parse test above checks the file)")
    keys = DEPLOY / "secrets" / "longserve_keys"
    made = not keys.exists()
    if made:
        keys.write_text("sk-test\n")
    try:
        run = subprocess.run([docker, "compose", "-f", str(DEPLOY / "compose.yaml"), "config", "--quiet"],
                             capture_output=True, text=True, timeout=60)
    finally:
        if made:
            keys.unlink()
    assert run.returncode == 0, run.stderr


# -- Kubernetes --------------------------------------------------------------------------------------------------


def kubernetes_objects() -> list[dict]:
    """The base rendered by `kubectl kustomize` where it runs, else its resources' files parsed."""
    kubectl = shutil.which("kubectl")
    if kubectl is not None:
        run = subprocess.run([kubectl, "kustomize", str(DEPLOY / "kubernetes")], capture_output=True, text=True,
                             timeout=60)
        assert run.returncode == 0, run.stderr
        return [d for d in yaml.safe_load_all(run.stdout) if d]
    kustomization = yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())
    return [d for f in kustomization["resources"] for d in yaml.safe_load_all((DEPLOY / "kubernetes" / f).read_text())
            if d]


def test_the_kubernetes_base_renders_and_its_probes_ports_gpus_env_and_volumes_match_the_server():
    objects = {o["kind"]: o for o in kubernetes_objects()}
    assert {"Deployment", "Service", "ScaledObject"} <= set(objects)
    deployment = objects["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    args = serve_args([re.sub(r"\$\((\w+)\)", "pod-0", str(a)) for a in container["args"]])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == args.port
    probes = {k: container[k]["httpGet"] for k in ("livenessProbe", "readinessProbe", "startupProbe")}
    assert probes["livenessProbe"]["path"] == "/health/live" and probes["readinessProbe"]["path"] == "/health/ready"
    for kind, get in probes.items():          # while loading: live answers 200, ready 503 "starting"
        answer = probe(get["path"])
        assert answer.status_code == (200 if "live" in get["path"] else 503), (kind, answer.text)
        assert answer.json()["status"] in ("alive", "starting")
        assert ports.get(get["port"], get["port"]) == args.port
    assert container["resources"]["limits"]["nvidia.com/gpu"] == args.workers
    assert pod["terminationGracePeriodSeconds"] > args.drain_seconds + 5
    user, uid = image_user()
    assert pod["securityContext"]["runAsUser"] == uid and pod["securityContext"]["fsGroup"] == uid
    # secrets: the database URL and the keys from the Secret, never in args
    assert env["LONGSERVE_STORE"]["valueFrom"]["secretKeyRef"]["name"] == "longserve"
    assert not any(str(a).startswith("postgresql") for a in container["args"]) and "--api-key" not in container["args"]
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    key_file = Path(env["LONGSERVE_API_KEY_FILE"]["value"])
    key_mount = mounts[str(key_file.parent)]
    assert volumes[key_mount["name"]]["secret"]["secretName"] == "longserve"
    assert key_file.name in {i["path"] for i in volumes[key_mount["name"]]["secret"]["items"]}
    assert args.data_dir in mounts and mounts["/models"]["readOnly"] and args.model.startswith("/models/")
    service = objects["Service"]
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} <= set(ports)
    scaled = objects["ScaledObject"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "postgresql" and trigger["metadata"]["connectionFromEnv"] in env
    assert float(trigger["metadata"]["targetQueryValue"]) == args.max_batch, "one replica's budget of work"


def test_the_autoscaler_s_query_reads_the_queued_work_of_the_store_s_schema(tmp_path):
    """KEDA runs the ScaledObject's query on the replicas' database: it must run on the schema the store migrates
    and return an integer that grows with the queued and running work."""
    import psycopg
    from postgres import fresh_schema

    from longserve.server.api.pg_store import PostgresJobStore
    from longserve.server.api.store import VideoRecord

    query = next(o for o in kubernetes_objects() if o["kind"] == "ScaledObject")["spec"]["triggers"][0]["metadata"][
        "query"]
    with fresh_schema() as url:
        store = PostgresJobStore(url, tmp_path / "data")
        try:
            with psycopg.connect(url) as conn:
                assert conn.execute(query).fetchone()[0] == 0
            for i, (status, cost) in enumerate([("queued", 2.5), ("in_progress", 1.0), ("completed", 9.0)]):
                store.insert(VideoRecord(id=f"video_{i}", created_at=0, status=status, model="m", prompt="p",
                                         seconds="1", size="64x64", params={}), cost=cost)
            with psycopg.connect(url) as conn:
                value = conn.execute(query).fetchone()[0]
            assert isinstance(value, int) and value == 4          # ceil(2.5 + 1.0): the finished job is not work
        finally:
            store.close()


# -- the image ------------------------------------------------------------------------------------------------------


def test_the_image_s_torch_is_the_gpu_runs_and_the_readme_line_stops_after_the_drain():
    from longserve.server.api.config import DEFAULT_DRAIN_S

    ins = instructions()
    args = dict(a.split("=", 1) for k, a in ins if k == "ARG" and "=" in a)
    base = args["BASE_IMAGE"]
    gpu_runs = set(re.findall(r"PyTorch (\d+\.\d+\.\d+)\+cu(\d+)", (ROOT / "docs" / "gpu.md").read_text()))
    assert len(gpu_runs) == 1, gpu_runs
    [(version, cuda)] = gpu_runs
    assert base.startswith(f"pytorch/pytorch:{version}-cuda{cuda[:-1]}.{cuda[-1]}-"), (base, gpu_runs)
    readme = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    line = re.search(r"`(docker run [^`]*)`", readme).group(1)
    assert int(re.search(r"--stop-timeout (\d+)", line).group(1)) >= DEFAULT_DRAIN_S + 10, line
    assert readme_docker_line()


def test_requires_python_is_what_the_dependencies_need():
    from importlib.metadata import PackageNotFoundError, metadata

    declared = pyproject()["project"]["requires-python"]
    floor = tuple(int(x) for x in re.match(r">=\s*(\d+)\.(\d+)", declared).groups())
    needed = {}
    for dep in pyproject()["project"]["dependencies"]:
        name = re.split(r"[<>=\[ ;]", dep, maxsplit=1)[0]
        try:
            wanted = metadata(name).get("Requires-Python") or ""
        except PackageNotFoundError:
            continue
        m = re.search(r">=\s*(\d+)\.(\d+)", wanted)
        if m:
            needed[name] = tuple(int(x) for x in m.groups())
    assert floor >= max(needed.values()), f"requires-python {declared}; the dependencies need {needed}"
    assert floor == max(needed.values()), "no higher than they need"


def test_the_healthcheck_probes_the_port_the_server_was_given(tmp_path):
    from longserve.server.cli.probe import probe_url, serve_address

    healthcheck = next(a for k, a in instructions() if k == "HEALTHCHECK")
    assert "longserve.server.cli.probe" in healthcheck and "8000" not in healthcheck
    assert serve_address(docker_run_argv([])) == ("127.0.0.1", 8000)          # 0.0.0.0: probed on loopback
    assert serve_address(docker_run_argv(["--model", "/m", "--port", "9001"])) == ("127.0.0.1", 9001)
    config = tmp_path / "serve.yaml"
    config.write_text("port: 9002\nhost: '::'\n")
    argv = ["/usr/bin/python", "/usr/local/bin/longserve", "serve", "--config", str(config)]
    assert serve_address(argv) == ("::1", 9002)
    assert serve_address(argv + ["--port", "9003"]) == ("::1", 9003)          # the command line wins, as in serve
    assert probe_url("::1", 9003) == "http://[::1]:9003/health/ready"
    assert probe_url("127.0.0.1", 1, live=True).endswith("/health/live")


# -- a store that does not answer ---------------------------------------------------------------------------------


def test_a_store_that_does_not_answer_stops_the_server_within_store_wait_with_one_line_naming_store(tmp_path):
    import socket

    with socket.socket() as sock:                # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = Path(sys.executable).parent / "longserve"
    t0 = time.monotonic()
    run = subprocess.run([str(script), "serve", "--model", "tiny-latte", "--device", "cpu", "--port", str(port + 1),
                          "--data-dir", str(tmp_path / "d"), "--score-model", "none", "--no-warm-up",
                          "--store", f"postgresql://user:hunter2@127.0.0.1:{port}/db", "--store-wait", "2"],
                         capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and "PoolTimeout" not in run.stderr, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("longserve serve: error: --store postgresql://user:***@127.0.0.1:"), last
    assert "--store-wait 2 s" in last and "hunter2" not in run.stderr
    assert took < 60, took
