"""A real Prometheus scrapes ttt-server while ttt-loadgen runs; its HTTP API then reports
ttt_generation_tokens_total equal to what loadgen counted, and a positive time-to-first-token
quantile.

Usage: prometheus_test.py --server-bin B --loadgen-bin L --model DIR
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

from harness import SKIP, Server, check, free_port, run


def query(port, expression):
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
    with urllib.request.urlopen(url, timeout=5) as response:
        result = json.load(response)["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def main():
    parser = argparse.ArgumentParser()
    for flag in ("--server-bin", "--loadgen-bin", "--model"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    prometheus_bin = shutil.which("prometheus")
    if prometheus_bin is None:
        print("SKIPPED: prometheus is not installed")
        return SKIP

    work = tempfile.mkdtemp()
    metrics_port = free_port()
    with open(os.path.join(work, "prometheus.yml"), "w") as config:
        config.write(f"""global:
  scrape_interval: 1s
scrape_configs:
  - job_name: ttt
    static_configs:
      - targets: ["127.0.0.1:{metrics_port}"]
""")
    with Server(args.server_bin, args.model, metrics_port) as server:
        prometheus_port = free_port()  # Only now: the server's own ports are taken.
        prometheus = subprocess.Popen(
            [prometheus_bin, f"--config.file={work}/prometheus.yml",
             f"--storage.tsdb.path={work}/data", f"--web.listen-address=127.0.0.1:{prometheus_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            ready = False
            for _ in range(100):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{prometheus_port}/-/ready", timeout=1)
                    ready = True
                    break
                except OSError:
                    time.sleep(0.2)
            check(ready, "Prometheus is up")
            baseline = None
            for _ in range(40):  # A scrape before the load, so that rates see it start.
                baseline = query(prometheus_port, "ttt_generation_tokens_total")
                if baseline is not None:
                    break
                time.sleep(0.25)
            check(baseline == 0, "Prometheus scraped the idle server")
            summary_path = os.path.join(work, "loadgen.json")
            loadgen = run([args.loadgen_bin, "--server", server.target, "--concurrency", "8",
                           "--connections", "2", "--requests", "48", "--prompt-tokens", "uniform:4:40",
                           "--output-tokens", "uniform:8:24", "--session-share", "0.25",
                           "--duration", "0", "--progress=false", "--json-out", summary_path])
            check(loadgen.returncode == 0,
                  f"ttt-loadgen ran without errors {loadgen.stdout[-300:]} {loadgen.stderr[-300:]}")
            with open(summary_path) as f:
                summary = json.load(f)
            check(summary["connections"] == 2, "loadgen spread its streams over 2 connections")
            full_load = summary["full_load"]
            check(0 < full_load["duration_s"] <= summary["duration_s"]
                  and full_load["generated_tokens_per_s"] > 0,
                  f"loadgen timed the span in which every stream was busy ({full_load})")
            check(0 < summary["server_ttft_ms"]["p50"] <= summary["ttft_ms"]["p50"]
                  and summary["tokens_per_message"] >= 1,
                  "loadgen split the time to the first token by the server's account "
                  f"({summary['server_ttft_ms']} of {summary['ttft_ms']}), and counted messages")
            expected = summary["generated_tokens"]
            seen = None
            for _ in range(40):
                seen = query(prometheus_port, "ttt_generation_tokens_total")
                if seen == expected:
                    break
                time.sleep(0.5)
            check(seen == expected,
                  f"Prometheus' ttt_generation_tokens_total ({seen}) equals loadgen's count ({expected})")
            ttft = None
            for _ in range(20):  # The rate needs two scrapes that saw the load.
                ttft = query(prometheus_port, "histogram_quantile(0.9, sum by (le) "
                                              "(increase(ttt_time_to_first_token_seconds_bucket[1m])))")
                if ttft is not None and ttft > 0:
                    break
                time.sleep(0.5)
            check(ttft is not None and ttft > 0, f"the p90 time to first token is positive ({ttft})")
        finally:
            prometheus.terminate()
            prometheus.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
