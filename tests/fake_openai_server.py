"""A stand-in for vLLM's OpenAI-compatible server, for CPU tests of the managed-server plumbing.

Deterministic tokens: token_i = (sum(prompt) + 7 * i + seed) % 997; logprob_i = -0.01 * (i + 1).
Flags: --ignore-sigterm, --never-healthy, --die-after N (exit during the N-th completion),
--exit-at-start.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ARGS = None
STATE = {"completions": 0, "adapters": {}}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, fmt, *args):  # keep the log readable
        sys.stdout.write("fake-server: " + fmt % args + "\n")
        sys.stdout.flush()

    def _json(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health" and not ARGS.never_healthy:
            self._json(200, {})
        else:
            self._json(503, {"error": "not ready"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/v1/load_lora_adapter":
            STATE["adapters"][body["lora_name"]] = body["lora_path"]
            return self._json(200, {"loaded": body["lora_name"]})
        if self.path == "/v1/unload_lora_adapter":
            STATE["adapters"].pop(body["lora_name"], None)
            return self._json(200, {})
        if self.path != "/v1/completions":
            return self._json(404, {"error": self.path})
        if body["model"] != "actor" and body["model"] not in STATE["adapters"]:
            return self._json(404, {"error": f"model {body['model']} not loaded"})
        STATE["completions"] += 1
        once = ARGS.die_once_file
        if ARGS.die_after and STATE["completions"] >= ARGS.die_after and not (once and os.path.exists(once)):
            if once:
                open(once, "w").close()
            print("fake-server: simulated crash mid-request", flush=True)
            os._exit(17)
        seed = body.get("seed") or 0
        base = sum(body["prompt"])
        tokens, logprobs, finish = [], [], "length"
        for i in range(body["max_tokens"]):
            token = (base + 7 * i + seed) % 997
            tokens.append(token)
            logprobs.append(-0.01 * (i + 1))
            if token in body.get("stop_token_ids", []):
                finish = "stop"
                break
        if not body.get("stream"):
            return self._json(200, {"choices": [{"index": 0, "text": "", "token_ids": tokens, "finish_reason": finish,
                                                 "logprobs": {"token_logprobs": logprobs}}]})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i, (token, logprob) in enumerate(zip(tokens, logprobs, strict=True)):
            last = i == len(tokens) - 1
            chunk = {"choices": [{"index": 0, "text": "", "token_ids": [token],
                                  "finish_reason": finish if last else None,
                                  "logprobs": {"token_logprobs": [logprob]}}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.001)
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()


def main():
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--never-healthy", action="store_true")
    parser.add_argument("--die-after", type=int, default=0)
    parser.add_argument("--exit-at-start", action="store_true")
    parser.add_argument("--exit-like-vllm-engine-core", action="store_true")
    parser.add_argument("--die-once-file", default="")
    ARGS = parser.parse_args()
    print(f"fake-server: starting on 127.0.0.1:{ARGS.port}", flush=True)
    if ARGS.exit_at_start:
        print("fake-server: RuntimeError: simulated start-up failure", flush=True)
        sys.exit(3)
    if ARGS.exit_like_vllm_engine_core:  # the shape of vLLM 0.26's log when its engine core fails
        print("(EngineCore pid=41) ERROR 12-01 17:55:02 [core.py:1100] EngineCore failed to start.", flush=True)
        print("(EngineCore pid=41) Traceback (most recent call last):", flush=True)
        print('(EngineCore pid=41)   File "vllm/v1/engine/core.py", line 1090, in run_engine_core', flush=True)
        print("(EngineCore pid=41) ValueError: simulated: float32 is not supported by this attention backend",
              flush=True)
        for line in range(60):  # the API server's own wrapper traceback: all that a 40-line tail shows
            print(f'(APIServer pid=40)   File "vllm/entrypoints/openai/api_server.py", line {line}, in run',
                  flush=True)
        print("(APIServer pid=40) RuntimeError: Engine core initialization failed. See root cause above. "
              "Failed core proc(s): {}", flush=True)
        sys.exit(1)
    if ARGS.ignore_sigterm:
        signal.signal(signal.SIGTERM, lambda *a: print("fake-server: ignoring SIGTERM", flush=True))
    class Server(ThreadingHTTPServer):
        # eight requests arrive at once; the default listen backlog of 5 can drop one under load, and the
        # client's retry after 1 s then breaks the timing tests' bounds
        request_queue_size = 64

    Server(("127.0.0.1", ARGS.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
