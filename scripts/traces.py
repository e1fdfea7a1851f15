"""Workload traces as JSON lines: one request per line, ``{"prompt": [...], "answer": [...]}``.

Generated from seeds here, written to files, and replayed from those files, so that any tool
(the end-to-end benchmark, a future `hicache bench`) can replay the same requests.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from hicache.workload import chat_trace


def chat(seed: int = 1, vocab: int = 512) -> list[dict]:
    """Multi-turn chats over shared system prompts; each request is the whole history."""
    reqs = chat_trace(
        n_systems=2,
        system_len=1024,
        n_convs=12,
        turns=4,
        user_len=150,
        answer_len=80,
        seed=seed,
        vocab=vocab,
    )
    return [
        {"prompt": r.prompt.tolist(), "answer": r.finished[len(r.prompt) :].tolist()} for r in reqs
    ]


def chat_turns(
    seed: int = 1,
    vocab: int = 512,
    systems: int = 2,
    system_len: int = 1024,
    convs: int = 12,
    turns: int = 4,
    user_len: int = 150,
    answer_len: int = 80,
) -> list[dict]:
    """The chat trace's shape for an engine that writes the answers itself (a real model): per
    request the conversation, its system prompt (first turn only), the user's tokens and how
    many tokens to answer. The engine's prompt is the conversation so far (system, then each
    turn's user tokens and its own answer) plus the new user tokens; conversations interleave
    turn by turn in a shuffled order, as in ``chat``."""
    rng = np.random.default_rng(seed)
    heads = [rng.integers(1, vocab, system_len).tolist() for _ in range(systems)]
    out = []
    for turn in range(turns):
        for conv in rng.permutation(convs):
            out.append(
                {
                    "conv": int(conv),
                    "system": heads[conv % systems] if turn == 0 else None,
                    "user": rng.integers(1, vocab, user_len).tolist(),
                    "answer_len": answer_len,
                }
            )
    return out


def doc_qa(
    seed: int = 2, vocab: int = 512, docs: int = 6, doc_len: int = 2500, questions: int = 4
) -> list[dict]:
    """Long documents, each asked several questions, interleaved across documents so the
    working set is every document at once."""
    rng = np.random.default_rng(seed)
    texts = [rng.integers(1, vocab, doc_len).tolist() for _ in range(docs)]
    out = []
    for _ in range(questions):
        for d in rng.permutation(docs):
            question = rng.integers(1, vocab, 48).tolist()
            out.append(
                {"prompt": texts[d] + question, "answer": rng.integers(1, vocab, 32).tolist()}
            )
    return out


def write(path: Path, requests: list[dict]) -> Path:
    with open(path, "w") as fh:
        for req in requests:
            fh.write(json.dumps(req) + "\n")
    return path


def read(path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt, finished) int32 arrays per request."""
    out = []
    with open(path) as fh:
        for line in fh:
            req = json.loads(line)
            prompt = np.array(req["prompt"], dtype=np.int32)
            out.append((prompt, np.concatenate([prompt, np.array(req["answer"], np.int32)])))
    return out


def working_set(requests: list[tuple[np.ndarray, np.ndarray]]) -> int:
    """Distinct prefix tokens the trace ever holds (its finished sequences, shared once)."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for _, finished in requests:
        for end in range(64, len(finished) + 1, 64):  # 64-token granularity is plenty here
            key = tuple(finished[end - 64 : end].tolist()) + (end,)
            if key not in seen:
                seen.add(key)
                total += 64
    return total
