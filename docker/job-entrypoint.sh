#!/bin/sh
# Entry point of the `job` service (not a Ray node): wait for the S3 server and create the bucket,
# wait until the Ray head's job API answers and the cluster's nodes have joined, then run the given
# command: `ray job submit ... -- python .../train.py ...`, whose driver runs on the head node.
set -eu

: "${RAY_HEAD:=ray-head:6379}"
: "${CKPT_BUCKET:=ray-ckpt}"
: "${EXPECTED_NODES:=3}"

python - <<'PY'
import os, sys, time
from urllib.parse import urlparse
import pyarrow.fs as pafs

url = urlparse(os.environ["AWS_ENDPOINT_URL_S3"])
bucket = os.environ.get("CKPT_BUCKET", "ray-ckpt")
deadline = time.monotonic() + 120
while True:
    try:
        fs = pafs.S3FileSystem(endpoint_override=url.netloc, scheme=url.scheme,
                               access_key=os.environ["AWS_ACCESS_KEY_ID"],
                               secret_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                               region=os.environ.get("AWS_REGION", "us-east-1"),
                               allow_bucket_creation=True, connect_timeout=2, request_timeout=10)
        fs.create_dir(bucket)
        with fs.open_output_stream(f"{bucket}/.ready-probe") as out:
            out.write(b"ok")
        fs.delete_file(f"{bucket}/.ready-probe")
        print(f"S3 bucket {bucket!r} ready on {url.netloc}")
        break
    except OSError as exc:
        if time.monotonic() > deadline:
            sys.exit(f"S3 server {url.netloc} not ready after 120 s: {exc}")
        time.sleep(2)
PY

python - <<'PY'
import os, sys, time
from ray.util.state import list_nodes

head, want = os.environ.get("RAY_HEAD", "ray-head:6379"), int(os.environ.get("EXPECTED_NODES", "3"))
deadline, alive, last = time.monotonic() + 180, 0, None
while time.monotonic() < deadline:
    try:  # the state API: through the head's GCS and dashboard, no local Ray node needed
        alive = sum(n.state == "ALIVE" for n in list_nodes(address=head, timeout=10))
        if alive >= want:
            print(f"{alive} Ray nodes alive")
            break
    except Exception as exc:  # head or dashboard not up yet
        last = exc
    time.sleep(2)
else:
    sys.exit(f"only {alive} of {want} Ray nodes joined {head} within 180 s (last error: {last})")
PY

exec "$@"
