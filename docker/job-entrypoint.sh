#!/bin/sh
# Entry point of the `job` service: wait for the S3 server and create the bucket, join the Ray
# cluster as a CPU-less node (its driver, coordinator and local tier live here), wait until the
# worker nodes have joined, then run the given command (the example).
set -eu

: "${RAY_HEAD:=ray-head:6379}"
: "${CKPT_BUCKET:=ray-ckpt}"
: "${EXPECTED_NODES:=4}"

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

until ray start --address="$RAY_HEAD" --num-cpus=0 --disable-usage-stats; do
    echo "waiting for the Ray head at $RAY_HEAD ..."
    sleep 2
done

python - <<'PY'
import os, sys, time
import ray

ray.init(address="auto", log_to_driver=False)
want = int(os.environ.get("EXPECTED_NODES", "4"))
deadline = time.monotonic() + 180
while sum(n["Alive"] for n in ray.nodes()) < want:
    if time.monotonic() > deadline:
        sys.exit(f"only {sum(n['Alive'] for n in ray.nodes())} of {want} Ray nodes joined")
    time.sleep(1)
print(f"{want} Ray nodes alive: {ray.cluster_resources()}")
ray.shutdown()
PY

exec "$@"
