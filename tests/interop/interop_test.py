"""Other gRPC stacks talk to ttt-server: a Python client (Debian's python3-grpcio) and a Node.js
client (@grpc/grpc-js) stream a generation that equals ttt-client's, continue a session, get
INVALID_ARGUMENT naming the field for a bad request, and read the health status.

Usage: interop_test.py --lang python|node --server-bin B --client-bin C --model DIR --proto-root P
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from harness import SKIP, Server, check, run

HERE = os.path.dirname(os.path.abspath(__file__))


def client_ids(client_bin, target, *args):
    result = run([client_bin, "--server", target, *args])
    check(result.returncode == 0, f"ttt-client {' '.join(args)}: {result.stderr.strip()}")
    return [int(x) for x in result.stdout.split()]


def steps_runner(lang, proto_root):
    """A function running a list of steps in the other stack's client, or None to skip."""
    if lang == "python":
        try:
            import grpc  # noqa: F401
        except ImportError:
            print("SKIPPED: python3-grpcio is not installed")
            return None
        generated = tempfile.mkdtemp()
        protoc = run(["protoc", f"--proto_path={proto_root}", f"--python_out={generated}",
                      f"--grpc_python_out={generated}",
                      "--plugin=protoc-gen-grpc_python=" + shutil.which("grpc_python_plugin"),
                      os.path.join(proto_root, "ttt/v1/ttt.proto")])
        check(protoc.returncode == 0, f"Python code generated from ttt.proto {protoc.stderr}")
        command = [sys.executable, os.path.join(HERE, "python_client.py")]
        extra = [generated]
        cwd = HERE
    else:
        node_dir = os.path.join(HERE, "node")
        if not shutil.which("node") or not os.path.isdir(os.path.join(node_dir, "node_modules")):
            print("SKIPPED: node or tests/interop/node/node_modules (npm ci) is missing")
            return None
        command = ["node", os.path.join(node_dir, "client.js")]
        extra = [proto_root]
        cwd = node_dir

    def run_steps(target, steps):
        result = subprocess.run(command + [target] + extra, input=json.dumps(steps),
                                capture_output=True, text=True, cwd=cwd, check=False)
        check(result.returncode == 0, f"{lang} client ran: {result.stderr.strip()[-500:]}")
        return json.loads(result.stdout)
    return run_steps


def main():
    parser = argparse.ArgumentParser()
    for flag in ("--lang", "--server-bin", "--client-bin", "--model", "--proto-root"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    run_steps = steps_runner(args.lang, args.proto_root)
    if run_steps is None:
        return SKIP

    prompt = [1, 17, 33, 49, 65, 81, 97, 113, 129, 145, 161, 177, 193]
    greedy = {"temperature": 0}
    stopping = {"max_new_tokens": 16, "ignore_eos": True}
    with Server(args.server_bin, args.model) as server:
        ids = ",".join(map(str, prompt))
        reference = client_ids(args.client_bin, server.target, "generate", "--prompt-ids", ids,
                               "--temperature", "0", "--max-new-tokens", "16", "--ignore-eos",
                               "--print-ids", "--usage=false")
        # The same session story through ttt-client, for comparison.
        run([args.client_bin, "--server", server.target, "session", "create", "reference"])
        first = client_ids(args.client_bin, server.target, "generate", "--session", "reference",
                           "--prompt-ids", "5,6,7", "--temperature", "0", "--max-new-tokens", "8",
                           "--ignore-eos", "--print-ids", "--usage=false")
        second = client_ids(args.client_bin, server.target, "generate", "--session", "reference",
                            "--prompt-ids", "8,9", "--temperature", "0", "--max-new-tokens", "8",
                            "--ignore-eos", "--print-ids", "--usage=false")

        session = f"{args.lang}-session"
        results = run_steps(server.target, [
            {"call": "Health"},
            {"call": "Generate", "request": {"token_ids": {"ids": prompt}, "sampling": greedy,
                                             "stopping": stopping}},
            {"call": "CreateSession", "request": {"session_id": session}},
            {"call": "Generate", "request": {"token_ids": {"ids": [5, 6, 7]}, "session_id": session,
                                             "sampling": greedy,
                                             "stopping": {"max_new_tokens": 8, "ignore_eos": True}}},
            {"call": "Generate", "request": {"token_ids": {"ids": [8, 9]}, "session_id": session,
                                             "sampling": greedy,
                                             "stopping": {"max_new_tokens": 8, "ignore_eos": True}}},
            {"call": "GetSession", "request": {"session_id": session}},
            {"call": "Generate", "request": {"token_ids": {"ids": [1]},
                                             "sampling": {"top_p": 7}}},
        ])
        health, stream, created, one, two, info, bad = results
        check(health["code"] == 0 and health["response"]["status"] == 1, "health is SERVING")
        check(stream["code"] == 0 and [t["id"] for t in stream["tokens"]] == reference,
              f"streamed generation equals ttt-client's ({reference})")
        check(stream["finish_reason"] == "FINISH_REASON_LENGTH", "finish reason is LENGTH")
        check(created["code"] == 0 and created["response"]["id"] == session, "session created")
        check([t["id"] for t in one["tokens"]] == first and
              [t["id"] for t in two["tokens"]] == second,
              "a session continued in two requests equals ttt-client's")
        check(int(info["response"]["tokens_absorbed"]) == 3 + 8 + 2 + 8,
              "the session absorbed every token")
        check(bad["code"] == 3 and "sampling.top_p" in bad["message"],
              f"a bad request is INVALID_ARGUMENT naming the field ({bad.get('message')})")
        if args.lang == "python":
            (reflection,) = run_steps(server.target, [{"call": "Reflection"}])
            check(reflection["code"] == 0 and
                  reflection["response"]["services"] == ["ttt.v1.TttService", "grpc.health.v1.Health"],
                  "server reflection lists ttt.v1.TttService and grpc.health.v1.Health")
    return 0


if __name__ == "__main__":
    sys.exit(main())
