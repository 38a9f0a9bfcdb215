"""Child process of the in-process vLLM diagnostic: standard library + vLLM only (it runs under the
engine's interpreter, which need not have this project's other dependencies).

Reads a JSON job on stdin: model dir, engine settings, optional peft adapter dir, whether to reset the
prefix cache before each call, and per cell the requests (token-id prompts, max tokens, temperature,
seed, stop ids); runs `vllm.LLM` on them with one warmup and N timed repetitions per cell; writes one JSON
result on stdout (last line).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    job = json.loads(sys.stdin.read())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams, TokensPrompt

    kwargs = dict(model=job["model_dir"], dtype="bfloat16", seed=0, max_model_len=job["max_model_len"],
                  kv_cache_memory_bytes=job["kv_cache_memory_bytes"], generation_config="vllm")
    kwargs.update(job.get("engine_overrides", {}))
    lora_request = None
    if job.get("adapter_dir"):
        from vllm.lora.request import LoRARequest

        kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=job["max_lora_rank"])
        lora_request = LoRARequest("policy", 1, job["adapter_dir"])
    started = time.perf_counter()
    llm = LLM(**kwargs)
    cold_start_s = time.perf_counter() - started
    try:  # on by default for generative models: a repeated prompt (the warm-up's) skips its prefill
        prefix_caching = bool(llm.llm_engine.vllm_config.cache_config.enable_prefix_caching)
    except AttributeError:
        prefix_caching = "not_measured"
    cells, resets = {}, []
    for cell_id, requests in job["cells"].items():
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
        params = [SamplingParams(max_tokens=r["max_new_tokens"], temperature=r["temperature"],
                                 seed=r["seed"], stop_token_ids=r["eos_token_ids"], logprobs=0)
                  for r in requests]
        walls, tokens = [], None
        for repetition in range(1 + job["repetitions"]):  # repetition 0: warmup, excluded
            if job.get("reset_prefix_cache"):  # no call reuses an earlier call's prompt KV (outside the timing)
                resets.append(bool(llm.reset_prefix_cache()))
            begin = time.perf_counter()
            outputs = llm.generate(prompts, params, lora_request=lora_request, use_tqdm=False)
            wall = time.perf_counter() - begin
            if repetition:
                walls.append(wall)
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        walls.sort()
        median = walls[len(walls) // 2]
        cells[cell_id] = {"wall_s": walls, "median_wall_s": median, "generated_tokens": tokens,
                          "tokens_per_s": tokens / median}
    print(json.dumps({"cold_start_s": cold_start_s, "cells": cells, "adapter": bool(lora_request),
                      "prefix_caching": prefix_caching,
                      **({"prefix_cache_reset_before_each_call": all(resets)} if job.get("reset_prefix_cache")
                         else {})}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
