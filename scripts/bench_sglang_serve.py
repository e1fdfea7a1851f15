"""SGLang's own server on a multi-turn chat trace, restarted halfway: hicache under it (the
README's one-page keys, and chains), against SGLang alone and against SGLang's own ``file``
storage backend on /dev/shm.

The served model is the tiny random Llama of the SGLang server tests, on SGLang's CPU engine
(the README's line with the CPU flags; scripts/setup_sglang.sh makes the venv). Its answers are
meaningless, but their lengths are fixed (``ignore_eos``), so every side serves the same
prompts. Conversations interleave turn by turn (scripts/traces.py ``chat_turns``): each
request is its conversation so far (a shared system prompt, earlier questions and the answers
this server wrote) and a new question. SGLang's own tiers are small: the device pool an eighth
of the trace's working set and the host pool (its hierarchical cache) a quarter, so a
conversation's earlier turns are mostly gone from them when it comes back. Halfway through,
the server is stopped and started again (the daemon, and the file backend's folder, stay).

Per side: prompt tokens computed (SGLang's ``prompt_tokens - cached_tokens``) and the time to
the first token (streamed), in all and for the first round after the restart, with what one
unbounded cache would have computed (the ceiling: every whole page of every earlier request's
tokens kept). The sides one after the other, each on a fresh server (and a fresh daemon);
the last line is one JSON object.

    .venv/bin/python -m scripts.bench_sglang_serve [--convs 16] [--turns 4] [--seed 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from hicache.daemon.launch import start_daemon, stop_daemon
from scripts import traces
from tests.sglang_server import server as sglang

PAGE = 64  # the README's --page-size
SIDES = ("alone", "file", "hicache", "hicache_chains")


def stream(server: sglang.Server, ids: list[int], answer: int) -> dict:
    """One streamed ``/generate`` of ``answer`` tokens (greedy, no early stop): the time to
    its first chunk, its output ids and SGLang's cached-token figures."""
    body = {"input_ids": ids, "stream": True, "sampling_params": {
        "max_new_tokens": answer, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    req = urllib.request.Request(server.base + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    t0 = time.perf_counter()
    first, last, other = None, None, []
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                other.append(line)
                continue
            if first is None:
                first = time.perf_counter() - t0
            last = json.loads(line[5:])
    if last is None or "meta_info" not in last:
        raise RuntimeError(f"SGLang answered no tokens: {last or other}")
    meta = last["meta_info"]
    return {
        "ttft_s": first,
        "output_ids": last["output_ids"],
        "prompt_tokens": meta["prompt_tokens"],
        "cached_tokens": meta["cached_tokens"],
    }


def ceiling(requests: list[list[int]], finished: list[list[int]]) -> list[int]:
    """Prompt tokens one unbounded cache computes per request: all but the leading whole pages
    some earlier request's tokens (prompt and answer) hold, at least one token."""
    seen: set[bytes] = set()
    out = []
    for prompt, done in zip(requests, finished, strict=True):
        pages = 0
        while (pages + 1) * PAGE <= len(prompt) and _key(prompt, pages + 1) in seen:
            pages += 1
        out.append(len(prompt) - min(pages * PAGE, (len(prompt) - 1) // PAGE * PAGE))
        for n in range(1, len(done) // PAGE + 1):
            seen.add(_key(done, n))
    return out


def _key(tokens: list[int], pages: int) -> bytes:
    return b"".join(t.to_bytes(4, "little") for t in tokens[: pages * PAGE])


def serve_side(side: str, args, model: Path, folder: Path) -> dict:  # noqa: ANN001
    """The trace on one side: a fresh server (and daemon), restarted halfway."""
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    turns = traces.chat_turns(seed=args.seed, vocab=vocab, systems=2, system_len=args.system,
                              convs=args.convs, turns=args.turns, user_len=args.user,
                              answer_len=args.answer)  # fmt: skip
    working = args.systems_len_total + args.convs * args.turns * (args.user + args.answer)
    device = max(2048, working // 8)  # SGLang's device pool (at least one long request)
    extra = ["--max-total-tokens", str(device), "--hicache-ratio", f"{working / 4 / device:.3f}"]
    endpoint = f"ipc://{folder}/hicache.sock"
    env = {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(args.shm / side)}
    daemon = None
    if side.startswith("hicache"):
        daemon = start_daemon(endpoint, "--device-tier", "engine", "--host-bytes", "1GiB",
                              "--keep-host", "false")  # fmt: skip
    storage = {"alone": "none", "file": "file"}.get(side, "hicache")
    history: dict[int, list[int]] = {}
    prompts, finished, rows = [], [], []
    restart_at = len(turns) // 2
    server = None
    try:
        for i, turn in enumerate(turns):
            if server is None or i == restart_at:
                if server is not None:
                    server.flush()  # (waits for SGLang's backups to storage to finish)
                    server.stop()
                server = sglang.start(model, endpoint, folder / f"{side}-{i}", *extra,
                                      storage=storage, env=env,
                                      prefix_keys=side == "hicache_chains")  # fmt: skip
            conv = turn["conv"]
            prompt = (turn["system"] or history[conv]) + turn["user"]
            got = stream(server, prompt, turn["answer_len"])
            history[conv] = prompt + got["output_ids"]
            prompts.append(prompt)
            finished.append(history[conv])
            rows.append(got)
    finally:
        if server is not None:
            server.stop()
        if daemon is not None:
            stop_daemon(daemon)
    best = ceiling(prompts, finished)
    after = slice(restart_at, restart_at + args.convs)  # the first round after the restart
    computed = [r["prompt_tokens"] - r["cached_tokens"] for r in rows]
    ttft = [r["ttft_s"] for r in rows]
    return {
        "requests": len(rows),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "computed": sum(computed),
        "ceiling": sum(best),
        "computed_after_restart": sum(computed[after]),
        "ceiling_after_restart": sum(best[after]),
        "ttft_p50_ms": round(statistics.median(ttft) * 1e3, 1),
        "ttft_mean_ms": round(statistics.fmean(ttft) * 1e3, 1),
        "ttft_max_ms": round(max(ttft) * 1e3, 1),
        "ttft_after_restart_mean_ms": round(statistics.fmean(ttft[after]) * 1e3, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--convs", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system", type=int, default=512, help="system prompt tokens (two of them)")
    p.add_argument("--user", type=int, default=150, help="tokens of each question")
    p.add_argument("--answer", type=int, default=32, help="tokens of each answer")
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    args = p.parse_args()
    args.systems_len_total = 2 * args.system
    out: dict = {"bench": "sglang_serve", "page": PAGE}
    with tempfile.TemporaryDirectory(prefix="hicache-serve-", dir="/tmp") as tmp:
        folder = Path(tmp)
        args.shm = Path(tempfile.mkdtemp(prefix="hicache-serve-file-", dir="/dev/shm"))
        try:
            model = sglang.make_model(folder / "tiny-llama")
            for side in args.sides:
                (args.shm / side).mkdir()
                got = serve_side(side, args, model, folder)
                out[side] = got
                print(f"{side:8s} computed {got['computed']:7d} of {got['prompt_tokens']:7d} "
                      f"prompt tokens (ceiling {got['ceiling']}), after the restart "
                      f"{got['computed_after_restart']} (ceiling "
                      f"{got['ceiling_after_restart']}); TTFT p50 {got['ttft_p50_ms']} ms, "
                      f"mean {got['ttft_mean_ms']} ms, max {got['ttft_max_ms']} ms, after the "
                      "restart "
                      f"{got['ttft_after_restart_mean_ms']} ms", flush=True)  # fmt: skip
        finally:
            shutil.rmtree(args.shm, ignore_errors=True)
    for side in ("alone", "file"):
        if side in out and "hicache" in out:
            out[f"computed_hicache_vs_{side}"] = round(
                out["hicache"]["computed"] / max(1, out[side]["computed"]), 3
            )
    for side in ("hicache", "hicache_chains"):
        if side in out:
            out[f"computed_{side}_vs_ceiling"] = round(
                out[side]["computed"] / max(1, out[side]["ceiling"]), 3
            )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
