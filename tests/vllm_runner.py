"""vLLM engines for the connector tests, one scenario per process (vLLM spawns workers; each
engine takes about 1 GB). Run as ``python -m tests.vllm_runner SCENARIO ARGS-JSON``; the last
line printed is ``RESULT <json>``. The tests start and stop the daemons; a scenario that
replaces a daemon stops its own.

Model: a tiny random Llama saved by ``make_model`` (2 layers, 2 KV heads of 32, float32), token
id prompts, greedy decoding with logprobs, block size 32.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

for _k, _v in {
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "2",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: steps by hand
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_k, _v)

BLOCK = 32
KV_BLOCK_BYTES = 2 * 2 * BLOCK * 64 * 4  # layers x heads x block x (K+V head) x fp32


def make_model(folder: str, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=256,
        max_position_embeddings=1024,
    )
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(folder)


def prompts(count: int = 6, seed: int = 1) -> list[list[int]]:
    """Chat-like prompts: a shared 96-token system prompt, then 60-160 tokens of their own."""
    import numpy as np

    rng = np.random.default_rng(seed)
    system = rng.integers(1, 500, 96).tolist()
    return [
        system + rng.integers(1, 500, int(rng.integers(60, 160))).tolist() for _ in range(count)
    ]


def make_llm(args: dict, connector: bool = True, **over: Any):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    extra = {
        "hicache.endpoint": args.get("endpoint", ""),
        "hicache.retry_s": 0.5,  # (timeout_s: the default; CI machines stall for a second)
    }
    kw: dict[str, Any] = dict(
        model=args["model"],
        skip_tokenizer_init=True,
        dtype=args.get("dtype", "float32"),
        enforce_eager=True,
        max_model_len=512,
        block_size=args.get("block_size", BLOCK),
        kv_cache_memory_bytes=args.get("kv_blocks", 24) * KV_BLOCK_BYTES // args.get("tp", 1),
        max_num_seqs=4,
        max_num_batched_tokens=512,
        enable_prefix_caching=True,
        disable_log_stats=False,
        tensor_parallel_size=args.get("tp", 1),
    )
    if connector:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="HiCacheConnector",
            kv_connector_module_path="hicache.client.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra,
        )
    kw.update(over)
    return LLM(**kw)


def generate(llm, batch: list[list[int]], max_tokens: int = 6) -> list[dict]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], sp, use_tqdm=False)
    return [_out(o) for o in outs]


def _out(o) -> dict:
    c = o.outputs[0]
    logprobs = [[lp[t].logprob for t in sorted(lp)] for lp in c.logprobs]
    return {"tokens": list(c.token_ids), "logprobs": logprobs, "cached": o.num_cached_tokens}


def reset_prefix_cache(llm) -> None:
    """vLLM's own prefix cache emptied (retried while blocks are held)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    deadline = time.monotonic() + 60
    while not llm.reset_prefix_cache():
        assert time.monotonic() < deadline, "vLLM's prefix cache would not reset"
        llm.generate([TokensPrompt(prompt_token_ids=[1])], SamplingParams(max_tokens=1))


def external_hits(llm, name: str = "vllm:external_prefix_cache_hits") -> float:
    """vLLM's own counter of prompt tokens served by the connector (or another counter)."""
    return sum(getattr(m, "value", 0) for m in llm.get_metrics() if m.name == name)


def engine_figures(endpoint: str, vllm: dict[str, float]) -> dict:
    """This engine's figures in the daemon (its scheduler session's engine_*_tokens), once
    they equal ``vllm`` (they come with the heartbeat) or 10 s passed."""
    from hicache.client import HiCacheClient

    deadline = time.monotonic() + 10
    while True:
        with HiCacheClient(endpoint, name="runner", heartbeat=False) as hc:
            mine = [
                s
                for s in hc.stats()["session_list"]
                if s["client"].startswith("vllm-scheduler") and s["pid"] == os.getpid()
            ]
        got = {
            k: sum(s[k] for s in mine)
            for k in ("engine_queried_tokens", "engine_hit_tokens", "engine_loaded_tokens")
        }
        if time.monotonic() > deadline or (
            got["engine_queried_tokens"] == vllm["queries"]
            and got["engine_hit_tokens"] == vllm["hits"]
        ):
            return got
        time.sleep(0.2)


def daemon_stats(endpoint: str) -> dict:
    from hicache.client import HiCacheClient

    with HiCacheClient(endpoint, name="runner") as hc:
        return hc.stats(check=True)


def poison(endpoint: str) -> None:
    """Overwrite every page of the daemon's pool behind its back."""
    from hicache.client import HiCacheClient

    with HiCacheClient(endpoint, name="poisoner") as hc:
        pools = hc.attach()
        for buf in pools.kv_buffer:
            buf.fill_(3.0)
        del pools


def flush(endpoint: str) -> None:
    from hicache.client import HiCacheClient

    with HiCacheClient(endpoint, name="flusher", admin=True) as hc:
        hc.flush()


# ---- scenarios --------------------------------------------------------------------------------
def scenario_main(args: dict) -> dict:
    """One engine, every single-engine property; the daemon is killed at the end."""
    batch, ep = prompts(), args["endpoint"]
    llm = make_llm(args)
    out: dict[str, Any] = {}
    out["cold"] = generate(llm, batch)
    out["stats_after_cold"] = _brief(daemon_stats(ep))
    out["warm_no_reset"] = generate(llm, batch)  # vLLM's 23 blocks hold less than the set
    out["external_after_warm"] = external_hits(llm)
    reset_prefix_cache(llm)
    out["reset"] = generate(llm, batch)
    out["external_after_reset"] = external_hits(llm)
    out["stats_after_reset"] = _brief(daemon_stats(ep))
    out["vllm_counted"] = {
        "queries": external_hits(llm, "vllm:external_prefix_cache_queries"),
        "hits": out["external_after_reset"],
    }
    out["hicache_counted"] = engine_figures(ep, out["vllm_counted"])
    poison(ep)
    reset_prefix_cache(llm)
    out["poisoned"] = generate(llm, batch)
    flush(ep)
    reset_prefix_cache(llm)
    out["after_flush"] = generate(llm, batch)  # recomputed, stored again
    out["stats_after_flush"] = _brief(daemon_stats(ep))
    reset_prefix_cache(llm)
    out["killed"] = _with_daemon_killed(llm, batch, args["daemon_pid"])
    return out


def _with_daemon_killed(llm, batch: list[list[int]], pid: int) -> list[dict]:
    """The requests of ``batch`` in flight while the daemon is SIGKILLed after two steps."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    for i, p in enumerate(batch):
        engine.add_request(f"k{i}", TokensPrompt(prompt_token_ids=p), sp)
    done: dict[str, Any] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = _out(o)
        steps += 1
        if steps == 2:
            os.kill(pid, signal.SIGKILL)
    return [done[f"k{i}"] for i in range(len(batch))]


def scenario_generate(args: dict) -> dict:
    """One fresh engine (any TP size) generating the prompts once (vLLM's cache is empty)."""
    llm = make_llm(args)
    out = {"run": generate(llm, prompts()), "external": external_hits(llm)}
    return out


def scenario_serve_then_hang(args: dict) -> dict:
    """An engine that served (its session holds pages ahead for its next stores), says so,
    and waits to be killed: no goodbye ever goes out."""
    llm = make_llm(args)
    generate(llm, prompts())
    print("SERVED", flush=True)
    while True:
        time.sleep(60)


def scenario_plain(args: dict) -> dict:
    """The same prompts without the connector (the reference outputs)."""
    llm = make_llm(args, connector=False)
    return {"run": generate(llm, prompts())}


def scenario_mismatch(args: dict) -> dict:
    """An engine whose KV layout differs from the one the daemon serves must not start."""
    try:
        make_llm(args)
    except Exception as exc:  # vLLM wraps the worker's error; its text carries ours
        return {"started": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"started": True}


def _brief(stats: dict) -> dict:
    keys = (
        "host_cached_tokens",
        "host_capacity_tokens",
        "integrity",
        "hit_host_tokens",
        "host_owned_tokens",
    )
    out = {k: stats.get(k) for k in keys}
    out["sessions"] = [
        {k: s[k] for k in ("client", "locks", "owned_pages", "queried_tokens", "hit_tokens")}
        for s in stats.get("session_list", [])
    ]
    return out


SCENARIOS = {
    "main": scenario_main,
    "generate": scenario_generate,
    "plain": scenario_plain,
    "mismatch": scenario_mismatch,
    "serve_then_hang": scenario_serve_then_hang,
}

if __name__ == "__main__":
    name, raw = sys.argv[1], sys.argv[2]
    result = SCENARIOS[name](json.loads(raw))
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # vLLM's worker processes and threads: no slow interpreter teardown
