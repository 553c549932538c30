"""Starting and stopping a ttt-server process for the interoperability tests."""
import re
import socket
import subprocess
import sys
import time

SKIP = 77  # ctest's SKIP_RETURN_CODE for these tests.


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """ttt-server on loopback; its gRPC port is read from its log."""

    def __init__(self, binary, model, metrics_port=-1, extra=()):
        self.process = subprocess.Popen(
            [binary, "--model", model, "--host", "127.0.0.1", "--port", "0",
             "--metrics-port", str(metrics_port), "--backend", "cpu", *extra],
            stderr=subprocess.PIPE, text=True)
        self.port = None
        deadline = time.time() + 30
        while time.time() < deadline:
            line = self.process.stderr.readline()
            if not line:
                break
            match = re.search(r"serving model .*? on port (\d+)", line)
            if match:
                self.port = int(match.group(1))
                break
        if self.port is None:
            self.stop()
            sys.exit("ttt-server did not start")
        self.target = f"127.0.0.1:{self.port}"

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def run(command, **kwargs):
    return subprocess.run(command, capture_output=True, text=True, check=False, **kwargs)


def check(condition, message):
    if not condition:
        print("FAILED:", message)
        sys.exit(1)
    print("ok:", message)
