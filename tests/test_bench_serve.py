"""scripts/bench_serve.py counts a request the server failed inside its stream as failed."""

from __future__ import annotations

import http.server
import threading

import pytest

from scripts import bench_serve


class _Server(http.server.BaseHTTPRequestHandler):
    """Answers every completion 200 and streams what ``lines`` holds (as vLLM does)."""

    lines: list[bytes] = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for line in self.lines:
            self.wfile.write(line + b"\n\n")

    def log_message(self, *args) -> None:  # (quiet)
        pass


@pytest.mark.parametrize(
    "lines, fails",
    [
        ([b'data: {"choices": [{"text": "a"}]}', b"data: [DONE]"], False),
        (
            [b'data: {"error": {"message": "Token id 499 is out of vocabulary"}}', b"data: [DONE]"],
            True,
        ),  # fmt: skip
    ],
)
def test_an_error_in_the_stream_is_a_failed_request(lines, fails):
    handler = type("Handler", (_Server,), {"lines": lines})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        if fails:
            with pytest.raises(bench_serve.RequestFailed, match="out of vocabulary"):
                bench_serve.one(url, "m", [1, 2, 3], 4)
        else:
            assert bench_serve.one(url, "m", [1, 2, 3], 4)["ttft"] > 0
    finally:
        server.shutdown()
        server.server_close()
