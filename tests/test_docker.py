"""docker/: the compose file describes the cluster the docs promise (no Docker engine runs here, so
the files are checked statically: exact versions, the dashboard, services, volumes, S3 wiring, and
the `ray job submit` command line, whose entrypoint must be one the example accepts)."""
import json
import re
import runpy
import shlex
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
RAY_NODES = ("ray-head", "ray-worker-1", "ray-worker-2")  # the job service only submits
IMAGE_USERS = RAY_NODES + ("job",)


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((DOCKER / "docker-compose.yml").read_text())


def argv(cmd):
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def test_services_and_their_commands(compose):
    services = compose["services"]
    assert set(services) == {"ray-head", "ray-worker-1", "ray-worker-2", "seaweedfs", "job"}
    head = argv(services["ray-head"]["command"])
    assert head[:3] == ["ray", "start", "--head"] and "--port=6379" in head and "--block" in head
    assert "--include-dashboard=true" in head and "--dashboard-host=0.0.0.0" in head  # the dashboard is on
    assert "--dashboard-port=8265" in head and "127.0.0.1:8265:8265" in services["ray-head"]["ports"]
    for w in ("ray-worker-1", "ray-worker-2"):
        cmd = argv(services[w]["command"])
        assert cmd[:2] == ["ray", "start"] and "--address=ray-head:6379" in cmd and "--block" in cmd
        assert "ray-head" in services[w]["depends_on"]
    assert set(services["job"]["depends_on"]) == {"ray-head", "ray-worker-1", "ray-worker-2", "seaweedfs"}
    for name in IMAGE_USERS:  # one image, built from the repository root with docker/Dockerfile
        svc = services[name]
        assert svc["build"] == {"context": "..", "dockerfile": "docker/Dockerfile"}
        assert svc["image"] == "ray-ckpt:dev"


def test_every_ray_node_has_its_own_named_volume_for_the_local_tier(compose):
    services, declared = compose["services"], set(compose["volumes"])
    seen = []
    for name in RAY_NODES:
        mounts = [v for v in services[name]["volumes"] if v.split(":")[1] == "/ckpt"]
        assert len(mounts) == 1, name
        vol = mounts[0].split(":")[0]
        assert vol in declared and not vol.startswith((".", "/")), f"{name}: {vol} is not a named volume"
        seen.append(vol)
    assert len(set(seen)) == len(RAY_NODES)  # per node: not shared


def test_s3_server_and_credentials_agree(compose):
    services = compose["services"]
    s3 = services["seaweedfs"]
    cmd = argv(s3["command"])
    assert cmd[0] in ("server", "mini") and "-s3.port=8333" in cmd
    config = next(a.split("=", 1)[1] for a in cmd if a.startswith("-s3.config="))
    mount = next(v for v in s3["volumes"] if v.split(":")[1] == config)
    host_path = DOCKER / mount.split(":")[0]
    assert host_path.is_file()
    creds = [c for ident in json.loads(host_path.read_text())["identities"] for c in ident["credentials"]]
    for name in IMAGE_USERS:  # writers upload and ranks restore from every node; the job creates the bucket
        env = services[name]["environment"]
        assert env["AWS_ENDPOINT_URL_S3"] == "http://seaweedfs:8333"
        assert {"accessKey": env["AWS_ACCESS_KEY_ID"], "secretKey": env["AWS_SECRET_ACCESS_KEY"]} in creds


def test_job_is_submitted_with_ray_job_submit_and_runs_the_openrlhf_example(compose):
    job = compose["services"]["job"]
    cmd = argv(job["command"])
    assert cmd[:4] == ["ray", "job", "submit", "--address=http://ray-head:8265"]
    entry = cmd[cmd.index("--") + 1:]
    assert entry[:2] == ["python", "/opt/ray_ckpt/examples/openrlhf_style/train.py"]
    script = ROOT / "examples" / "openrlhf_style" / "train.py"  # COPY examples /opt/ray_ckpt/examples
    assert script.is_file() and "COPY examples ./examples" in (DOCKER / "Dockerfile").read_text()
    args = runpy.run_path(str(script), run_name="compose_check")["build_parser"]().parse_args(entry[2:])
    assert args.local_dir == "/ckpt/{node_id}"
    assert args.remote_uri.startswith("s3://" + job["environment"]["CKPT_BUCKET"] + "/")
    assert args.kill_at and args.save_every <= args.kill_at < args.steps
    assert "volumes" not in job  # not a Ray node: no local tier of its own
    assert job["environment"]["EXPECTED_NODES"] == str(len(RAY_NODES))
    script = (DOCKER / argv(job["entrypoint"])[0]).read_text()
    assert "ray start" not in script and "list_nodes(" in script and 'exec "$@"' in script
    assert "create_dir" in script  # the bucket is created before the run


def test_images_and_ray_are_pinned_exactly(compose):
    for name, svc in compose["services"].items():
        if "image" in svc and "build" not in svc:
            repo, _, tag = svc["image"].rpartition(":")
            assert repo and re.fullmatch(r"\d+(\.\d+)+", tag), f"{name}: {svc['image']} is not an exact version"
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r'pip install "ray\[default\]==2\.60\.0"', text)


def test_dockerfile_installs_cpu_torch_before_the_package():
    text = (DOCKER / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11\.7-slim-bookworm\s*$", text, re.M)
    torch = re.search(r"pip install torch==2\.13\.0 --index-url https://download\.pytorch\.org/whl/cpu", text)
    pkg = re.search(r"pip install \.", text)
    assert torch and pkg and torch.start() < pkg.start()
    assert "COPY docker/job-entrypoint.sh" in text
    ignore = (DOCKER / "Dockerfile.dockerignore").read_text().split()
    assert ".venv" in ignore and ".git" in ignore


def test_docs_say_how_to_run_it_and_where_the_coordinator_runs():
    cmd = "docker compose -f docker/docker-compose.yml up --build"
    for doc in (DOCKER / "README.md", ROOT / "docs" / "integrating.md"):
        text = doc.read_text()
        assert cmd in text and "ray job submit" in text, doc
        assert "coordinator" in text and "head node" in text, doc
