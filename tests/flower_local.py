"""Test harness: a Flower deployment on one machine, a SuperLink and SuperNodes as real processes on 127.0.0.1.

Used by the deployment tests (tests/test_flower_deploy.py) and the Flower benchmark (benchmarks/flower.py); not
part of the zofed package. Each process gets its own FLWR_HOME (as it would on its own machine), a log file,
and is stopped by its PID together with the processes Flower starts under it (SuperExec, ServerApp and
ClientApp processes).
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

BIN = Path(sys.executable).parent  # flower-superlink, flower-supernode and flwr of this environment


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalDeployment:
    """Started processes, their environments and logs under `root`."""

    def __init__(self, root: Path, threads: int = 1) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.threads = threads
        self.started: list[tuple[str, subprocess.Popen]] = []

    def env(self, name: str) -> dict[str, str]:
        home = self.root / f"home-{name}"
        home.mkdir(parents=True, exist_ok=True)
        # Torch threads are fixed so results compare with an in-process run using as many.
        return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "FLWR_HOME": str(home),
                "FLWR_TELEMETRY_ENABLED": "0", "OMP_NUM_THREADS": str(self.threads), "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}

    def log(self, name: str) -> Path:
        return self.root / f"{name}.log"

    def start(self, name: str, command: list[str]) -> subprocess.Popen:
        with self.log(name).open("wb") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env(name),
                                    start_new_session=True)
        self.started.append((name, proc))
        return proc

    def superlink(self, port: int, *flags: str) -> subprocess.Popen:
        return self.start("superlink", [str(BIN / "flower-superlink"), "--host", "127.0.0.1", "--port", str(port),
                                        "--disable-runtime-dependency-installation", *flags])

    def supernode(self, name: str, superlink: str, partition_id: int, num_partitions: int,
                  *flags: str) -> subprocess.Popen:
        return self.start(name, [str(BIN / "flower-supernode"), "--superlink", superlink, "--port", str(free_port()),
                                 "--node-config", f"partition-id={partition_id} num-partitions={num_partitions}",
                                 *flags])

    def connection(self, name: str, address: str, ca: Path | None = None) -> None:
        """The `flwr` CLI's SuperLink connection `name`, in the CLI's own FLWR_HOME."""
        tls = f'root-certificates = "{ca}"' if ca else "insecure = true"
        config = Path(self.env("cli")["FLWR_HOME"]) / "config.toml"
        config.write_text(f'[superlink]\ndefault = "{name}"\n\n[superlink.{name}]\naddress = "{address}"\n{tls}\n')

    def flwr(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / "flwr"), *args], env=self.env("cli"), capture_output=True, text=True,
                              timeout=timeout)

    def wait_healthy(self, port: int, ca: Path | None = None, timeout: float = 60) -> None:
        """Wait for the SuperLink's HTTP API; fail with its log if it exits or stays down."""
        proc = dict(self.started)["superlink"]
        url = f"{'https' if ca else 'http'}://127.0.0.1:{port}/health"
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca) if ca else True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the SuperLink exited with {proc.returncode}:\n{self._tail('superlink')}")
            try:
                if httpx.get(url, timeout=2, verify=verify).is_success:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"the SuperLink at {url} was not healthy within {timeout} s:\n{self._tail('superlink')}")

    def stop_all(self) -> list[str]:
        """SIGTERM (then SIGKILL) every started process and every process under it, each by its PID; returns
        those still running afterwards (none, unless stopping failed)."""
        tree: dict[int, str] = {}
        for name, proc in self.started:
            tree[proc.pid] = name
            try:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    tree.setdefault(child.pid, f"{name}/{' '.join(child.cmdline()[:2])}")
            except psutil.Error:
                pass  # already gone
        for _name, proc in reversed(self.started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for pid in tree:
            _stop_pid(pid)
        return [f"{pid} ({name})" for pid, name in tree.items() if _running(pid)]

    def _tail(self, name: str, chars: int = 3000) -> str:
        return self.log(name).read_text(errors="replace")[-chars:]


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _stop_pid(pid: int) -> None:
    if not _running(pid):
        return
    try:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while _running(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # ended between the check and the signal


def run_insecure(app: Path, root: Path, num_supernodes: int, timeout: float = 600,
                 run_config: str | None = None) -> dict:
    """Start a SuperLink and `num_supernodes` SuperNodes without TLS, `flwr run` the app (with `--run-config
    run_config` when given), stop everything. Returns the run's return code and output, the seconds from the
    SuperLink's start to the run's end, and any process that could not be stopped."""
    deployment = LocalDeployment(root)
    port = free_port()
    t0 = time.perf_counter()
    try:
        deployment.superlink(port, "--insecure")
        for i in range(num_supernodes):
            deployment.supernode(f"supernode{i}", f"127.0.0.1:{port}", i, num_supernodes, "--insecure")
        deployment.wait_healthy(port)
        deployment.connection("zofed-local", f"127.0.0.1:{port}")
        overrides = ["--run-config", run_config] if run_config else []
        run = deployment.flwr("run", str(app), "zofed-local", "--stream", *overrides, timeout=timeout)
        seconds = time.perf_counter() - t0
    finally:
        survivors = deployment.stop_all()
    return {"returncode": run.returncode, "output": run.stdout + run.stderr, "seconds": seconds,
            "survivors": survivors}
