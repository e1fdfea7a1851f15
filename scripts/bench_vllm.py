"""bench_vllm: real vLLM alone against vLLM + hicache on the chat and doc-QA traces.

Per trace, vLLM's KV cache holds 25% of the trace's working set; the daemon's host pool holds
all of it. Chat: 12 conversations of 5 turns over 2 system prompts of 1,024 tokens (with 4
turns, an unbounded cache computes only 2.99x fewer tokens than vLLM alone: too little reuse
to tell caches apart). Configurations: vLLM with its own prefix caching alone; vLLM + hicache
(one engine); two engines splitting the trace, alone and sharing one daemon. vLLM's own CPU
offloading is tried and its refusal printed (LMCache: whether it is installed). Requests run
one after the other per engine (as a chat user waits for each answer), 8 generated tokens
each, greedy.

Outputs: the greedy token ids of vLLM alone and vLLM + hicache are compared (and the largest
logprob difference printed: vLLM computes a prompt in other chunks when part of it is cached,
so logprobs may differ in the last bits, as with vLLM's own prefix cache).

Per run: prompt tokens computed (and what an unbounded cache would compute on the same trace:
the ceiling), time to first token p50/p90, throughput, hit ratios by tier (vLLM's own cache,
hicache), the connector's own time. The last line is one JSON object.

    python -m scripts.bench_vllm [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 32
GENERATED = 8
# 8 layers, 12 query heads and 2 KV heads of 64 (grouped-query attention, as served models
# have), fp32: prefill of ~2.5k tokens takes a while on two cores, so a hit is worth something
MODEL = dict(hidden=768, layers=8, heads=12, kv_heads=2, inter=2048, vocab=512)
KV_TOKEN_BYTES = MODEL["layers"] * MODEL["kv_heads"] * 64 * 2 * 4


# ---- one engine, in its own process ------------------------------------------------------------
def engine_main(spec: dict) -> dict:
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kw: dict[str, Any] = dict(
        model=spec["model"],
        skip_tokenizer_init=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=spec["max_model_len"],
        block_size=BLOCK,
        kv_cache_memory_bytes=spec["kv_bytes"],
        max_num_seqs=2,
        max_num_batched_tokens=2048,
        enable_prefix_caching=True,
        disable_log_stats=False,
    )
    if spec.get("connector"):
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=spec["connector"],
            kv_connector_module_path=spec.get("module"),
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=spec.get("extra", {}),
        )
    try:
        llm = LLM(**kw)
    except Exception as exc:  # a connector that refuses this machine
        return {"refused": f"{type(exc).__name__}: {str(exc).splitlines()[-1][:200]}"}
    items = json.loads(Path(spec["requests"]).read_text())
    engine = llm.llm_engine
    history: dict[int, list[int]] = {}  # chat: each conversation so far, with its own answers
    out = []
    started = time.perf_counter()
    for i, item in enumerate(items):
        if "conv" in item:  # a chat turn: the conversation so far, then the user's tokens
            prompt = history.get(item["conv"], item["system"] or []) + item["user"]
            gen = item["answer_len"]
        else:
            prompt, gen = item["prompt"], GENERATED
        sp = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True, logprobs=1)
        t0 = time.perf_counter()
        engine.add_request(str(i), TokensPrompt(prompt_token_ids=prompt), sp)
        ttft, final = None, None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if ttft is None and o.outputs and o.outputs[0].token_ids:
                    ttft = time.perf_counter() - t0
                if o.finished:
                    final = o
        c = final.outputs[0]
        if "conv" in item:
            history[item["conv"]] = prompt + list(c.token_ids)
        out.append(
            {
                "prompt": len(prompt),
                "sequence": prompt + list(c.token_ids),
                "cached": final.num_cached_tokens,
                "ttft": ttft,
                "tokens": list(c.token_ids),
                "logprobs": [[lp[t].logprob for t in sorted(lp)] for lp in c.logprobs],
            }
        )
    wall = time.perf_counter() - started
    metrics = {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}
    connector = _connector_figures(llm)
    return {"requests": out, "wall_s": wall, "metrics": metrics, "connector": connector}


def _connector_figures(llm) -> dict:
    try:
        conn = llm.llm_engine.engine_core.engine_core.scheduler.connector
        return dict(vars(conn.sched.figures))
    except AttributeError:
        return {}


def run_engines(specs: list[dict], tmp: str) -> list[dict]:
    """Each spec in a process of its own, all at once; whole process groups killed after."""
    procs = []
    threads = str(max(1, (os.cpu_count() or 1) // len(specs)))  # engines side by side share cores
    for i, spec in enumerate(specs):
        path = Path(tmp) / f"spec-{time.monotonic_ns()}-{i}.json"
        path.write_text(json.dumps(spec))
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "scripts.bench_vllm", "--engine", str(path)],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
                env={**os.environ, "OMP_NUM_THREADS": threads},
            )
        )
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=3600)
            lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
            if not lines:
                raise RuntimeError(f"an engine failed (exit {p.returncode}):\n{err[-3000:]}")
            results.append(json.loads(lines[-1][len("RESULT ") :]))
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    return results


# ---- the driver ------------------------------------------------------------------------------
def make_model(folder: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=MODEL["vocab"],
        hidden_size=MODEL["hidden"],
        num_attention_heads=MODEL["heads"],
        num_key_value_heads=MODEL["kv_heads"],
        num_hidden_layers=MODEL["layers"],
        intermediate_size=MODEL["inter"],
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(folder)


def ceiling(requests: list[dict]) -> int:
    """Prompt tokens an unbounded cache computes on the same requests: it holds the whole blocks
    of every earlier sequence whose KV was computed (the prompt and all generated tokens but
    the last), and a prompt still computes at least its last token (vLLM's block granularity)."""
    seen: set[tuple[int, ...]] = set()
    computed = 0
    for r in requests:
        p, seq = r["sequence"][: r["prompt"]], r["sequence"][:-1]
        hit = 0
        while hit + BLOCK <= len(p) - 1 and tuple(p[: hit + BLOCK]) in seen:
            hit += BLOCK
        computed += len(p) - hit
        for end in range(BLOCK, len(seq) + 1, BLOCK):
            seen.add(tuple(seq[:end]))
    return computed


def summarize(runs: list[dict]) -> dict:
    reqs = [r for run in runs for r in run["requests"]]
    prompt = sum(r["prompt"] for r in reqs)
    cached = sum(r["cached"] for r in reqs)
    ttfts = sorted(r["ttft"] for r in reqs)
    m = [run["metrics"] for run in runs]
    external = sum(x.get("vllm:external_prefix_cache_hits", 0) for x in m)
    conn = [run.get("connector") or {} for run in runs]
    sched_s = sum(c.get("scheduler_s", 0) for c in conn)
    worker_s = sum(c.get("worker_s", 0) for c in conn)
    generated = sum(len(r["tokens"]) for r in reqs)
    return {
        "prompt": prompt,
        "computed": prompt - cached,
        "hit_vllm": (cached - external) / prompt,
        "hit_hicache": external / prompt,
        "ttft_p50": statistics.median(ttfts),
        "ttft_sum": sum(ttfts),
        "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
        "tok_s": (prompt + generated) / max(run["wall_s"] for run in runs),
        "connector_s": sched_s + worker_s,
        "scheduler_s": sched_s,
        "worker_s": worker_s,
        "n": len(reqs),
        "outputs": [(r["tokens"], r["logprobs"]) for r in reqs],
    }


def row(trace: str, label: str, s: dict, ceil: int) -> None:
    print(
        f"{trace:6s} {label:28s} computed={s['computed']:7d} (ceiling {ceil:6d}, "
        f"{ceil / max(s['computed'], 1):4.2f}) ttft p50={s['ttft_p50'] * 1e3:7.1f}ms "
        f"p90={s['ttft_p90'] * 1e3:7.1f}ms {s['tok_s']:7.0f} tok/s "
        f"hit vllm={s['hit_vllm']:.3f} hicache={s['hit_hicache']:.3f}"
        + (
            f" connector {s['scheduler_s'] / s['n'] * 1e3:.2f}+{s['worker_s'] / s['n'] * 1e3:.2f}"
            "ms/req (scheduler+copies)"
            if s["connector_s"]
            else ""
        ),
        flush=True,
    )


def bench_trace(
    name: str, items: list[dict], halves: list[list[dict]], model: str, tmp: str
) -> dict:
    """``items`` in one engine; ``halves`` in two engines at once."""
    from hicache.daemon.launch import start_daemon, stop_daemon

    path = Path(tmp) / f"{name}.json"
    path.write_text(json.dumps(items))
    half_paths = [Path(tmp) / f"{name}-{i}.json" for i in range(2)]
    for half, items_half in zip(half_paths, halves, strict=True):
        half.write_text(json.dumps(items_half))
    longest = max(_longest(items), *(_longest(h) for h in halves))
    max_len = -(-longest // BLOCK) * BLOCK
    base = {"model": model, "max_model_len": max_len}
    runs: dict[str, dict] = {}
    working_tokens = _working_set(items)
    kv_tokens = max(working_tokens // 4, max_len + 2 * BLOCK)
    base["kv_bytes"] = kv_tokens * KV_TOKEN_BYTES
    (alone,) = run_engines([{**base, "requests": str(path)}], tmp)
    ceil = ceiling(alone["requests"])
    print(
        f"# {name}: {len(items)} requests, working set {working_tokens} tokens, vLLM KV "
        f"{kv_tokens} tokens ({kv_tokens / working_tokens:.0%}), unbounded-cache ceiling "
        f"{ceil} computed",
        flush=True,
    )
    runs["vllm alone"] = summarize([alone])
    row(name, "vllm alone", runs["vllm alone"], ceil)
    for label, n in (("vllm + hicache", 1), ("2 engines + 1 hicache", 2)):
        ep = f"ipc://{tmp}/{name}-{n}.sock"
        host = ["--host-tokens", str(4 * working_tokens)]
        proc = start_daemon(ep, "--device-tier", "engine", *host)
        extra = {"hicache.endpoint": ep}
        conn = {"connector": "HiCacheConnector", "module": "hicache.client.vllm", "extra": extra}
        try:
            files = [path] if n == 1 else half_paths
            specs = [{**base, **conn, "requests": str(f)} for f in files]
            runs[label] = summarize(run_engines(specs, tmp))
        finally:
            stop_daemon(proc)
        row(name, label, runs[label], ceil)
    specs = [{**base, "requests": str(f)} for f in half_paths]
    runs["2 engines alone"] = summarize(run_engines(specs, tmp))
    row(name, "2 engines alone", runs["2 engines alone"], ceil)
    alone, hi = runs["vllm alone"], runs["vllm + hicache"]
    per_token = alone["ttft_sum"] / max(alone["computed"], 1)  # prefill seconds per token
    saved_s = (alone["computed"] - hi["computed"]) * per_token
    return {
        "reduction": alone["computed"] / max(hi["computed"], 1),
        "reduction_2": runs["2 engines alone"]["computed"]
        / max(runs["2 engines + 1 hicache"]["computed"], 1),
        "ceiling_ratio": ceil / max(hi["computed"], 1),
        "ttft_speedup": alone["ttft_p50"] / hi["ttft_p50"],
        "overhead": hi["connector_s"] / saved_s if saved_s > 0 else float("inf"),
        "identical": [t for t, _ in alone["outputs"]] == [t for t, _ in hi["outputs"]],
        "logprob_diff": max(
            abs(x - y)
            for (_, la), (_, lb) in zip(alone["outputs"], hi["outputs"], strict=True)
            for ra, rb in zip(la, lb, strict=True)
            for x, y in zip(ra, rb, strict=True)
        ),
    }


def _working_set(items: list[dict]) -> int:
    """Tokens of KV the requests hold at once at most: distinct system prompts, every turn's
    user tokens and answer (chat); distinct whole blocks of the prompts (others)."""
    blocks: set[tuple[int, ...]] = set()
    tokens = 0
    for item in items:
        if "conv" in item:
            tokens += len(item["user"]) + item["answer_len"]
            head = item["system"] or []
            blocks.update(tuple(head[:e]) for e in range(BLOCK, len(head) + 1, BLOCK))
        else:
            p = item["prompt"]
            blocks.update(tuple(p[:e]) for e in range(BLOCK, len(p) + 1, BLOCK))
    return tokens + len(blocks) * BLOCK


def _longest(items: list[dict]) -> int:
    """The longest prompt and answer of a request list (chat: the whole conversation)."""
    convs: dict[int, int] = {}
    longest = 0
    for item in items:
        if "conv" in item:
            convs[item["conv"]] = (
                convs.get(item["conv"], len(item["system"] or []))
                + len(item["user"])
                + item["answer_len"]
            )
            longest = max(longest, convs[item["conv"]])
        else:
            longest = max(longest, len(item["prompt"]) + GENERATED)
    return longest


def peers(model: str, tmp: str) -> None:
    """vLLM's own CPU offloading and LMCache on this machine, started as users would."""
    spec = {"model": model, "max_model_len": 512, "kv_bytes": 64 << 20, "requests": ""}
    offload = {"connector": "OffloadingConnector", "extra": {"cpu_bytes_to_use": 64 << 20}}
    (r,) = run_engines([{**spec, **offload}], tmp)
    print(f"# vLLM OffloadingConnector: {r.get('refused', 'started')}")
    try:
        import lmcache  # noqa: F401

        print("# LMCache: installed (not measured here)")
    except ImportError:
        print("# LMCache: not installed (its 0.5.6 CPU build serves no hits on this machine)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # internal: one engine's run
    ap.add_argument("--quick", action="store_true", help="smaller traces (a smoke run)")
    ap.add_argument("--trace", choices=["chat", "docqa", "both"], default="both")
    args = ap.parse_args()
    if args.engine:
        result = engine_main(json.loads(Path(args.engine).read_text()))
        print("RESULT " + json.dumps(result), flush=True)
        os._exit(0)
    from scripts import traces

    with tempfile.TemporaryDirectory(prefix="hicache-vllm-") as tmp:
        model = f"{tmp}/model"
        make_model(model)
        peers(model, tmp)
        chat = traces.chat_turns(turns=5)  # (4 turns: the ceiling itself is 2.99x)
        docqa = [{"prompt": r["prompt"]} for r in traces.doc_qa()]
        if args.quick:
            chat = traces.chat_turns(convs=4, turns=3, system_len=256, answer_len=16)
            docqa = [{"prompt": r["prompt"][-700:]} for r in traces.doc_qa()[:12]]
        by_conv = [[t for t in chat if t["conv"] % 2 == i] for i in range(2)]  # sticky routing
        c = d = None
        if args.trace in ("chat", "both"):
            c = bench_trace("chat", chat, by_conv, model, tmp)
        if args.trace in ("docqa", "both"):
            d = bench_trace("docqa", docqa, [docqa[0::2], docqa[1::2]], model, tmp)
    if c is None or d is None:
        print(json.dumps({k: v for k, v in (c or d).items()}))
        return
    print(
        json.dumps(
            {
                "vllm_recompute_reduction_chat": round(c["reduction"], 2),
                "vllm_recompute_reduction_docqa": round(d["reduction"], 2),
                "two_engines_recompute_reduction_chat": round(c["reduction_2"], 2),
                "two_engines_recompute_reduction_docqa": round(d["reduction_2"], 2),
                "ceiling_over_hicache_chat": round(c["ceiling_ratio"], 3),
                "ceiling_over_hicache_docqa": round(d["ceiling_ratio"], 3),
                "ttft_p50_speedup_docqa": round(d["ttft_speedup"], 2),
                "ttft_p50_speedup_chat": round(c["ttft_speedup"], 2),
                "connector_overhead_fraction": round(max(c["overhead"], d["overhead"]), 4),
                "outputs_identical": c["identical"] and d["identical"],
                "max_logprob_diff": max(c["logprob_diff"], d["logprob_diff"]),
            }
        )
    )


if __name__ == "__main__":
    main()
