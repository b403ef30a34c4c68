"""Helpers for the reliability suites (fuzz, hostile, security); no tests here.

- `SIZE`: `$QUANTSERVE_RELIABILITY`, `quick` (the default, what `make test` runs) or `full`.
- `assert_openai_error`: a 4xx/5xx answer is `{"error": {"message", "type", "param", "code"}}`.
- `Figures`: the numbers a suite measured, written to `runs/reliability/<suite>.json` as
  `{"suite", "size", "rows": [{"what", "figure"}]}` so a table can be built from all suites.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "runs" / "reliability"

SIZE = os.environ.get("QUANTSERVE_RELIABILITY", "quick")
if SIZE not in ("quick", "full"):
    raise ValueError(f"QUANTSERVE_RELIABILITY={SIZE!r}: use quick or full")


def assert_openai_error(response, status: int | None = None, code: str | None = None) -> dict:
    """Check the OpenAI error shape of an httpx or requests response; return its `error` object."""
    if status is not None:
        assert response.status_code == status, (response.status_code, response.text[:500])
    assert 400 <= response.status_code < 600, (response.status_code, response.text[:500])
    assert response.headers.get("content-type", "").startswith("application/json"), response.headers
    body = response.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    if code is not None:
        assert error["code"] == code, error
    return error


class Figures:
    def __init__(self, suite: str):
        self.suite = suite
        self.rows: list[dict] = []

    def add(self, what: str, figure) -> None:
        self.rows.append({"what": what, "figure": str(figure)})

    def write(self) -> Path:
        OUT.mkdir(parents=True, exist_ok=True)
        path = OUT / f"{self.suite}.json"
        path.write_text(json.dumps({"suite": self.suite, "size": SIZE, "rows": self.rows}, indent=1) + "\n")
        return path


class RawResponse:
    """Just enough of an HTTP/1.1 response for the checks above (status, headers, JSON body)."""

    def __init__(self, status_code: int, headers: dict[str, str], content: bytes):
        self.status_code, self.headers, self.content = status_code, headers, content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self):
        return json.loads(self.content)


def raw_http(port: int, head: bytes, body: bytes | list[bytes] = b"", timeout: float = 30.0) -> RawResponse:
    """Send bytes exactly as given (clients normalise `..` in paths and refuse bad framing).

    `head` is the request line and headers without the blank line; a list `body` is sent with
    `Transfer-Encoding: chunked`, one chunk per item.
    """
    import socket

    if isinstance(body, list):
        data = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in body) + b"0\r\n\r\n"
        head += b"\r\nTransfer-Encoding: chunked"
    else:
        data = body
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head + b"\r\nConnection: close\r\n\r\n")
        try:
            s.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered (413) and closed before reading everything: read the answer
        received = b""
        try:
            while chunk := s.recv(65536):
                received += chunk
        except ConnectionResetError:
            pass  # closed with unread request bytes: what arrived before is the answer
    header_blob, _, content = received.partition(b"\r\n\r\n")
    lines = header_blob.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
    if headers.get("transfer-encoding") == "chunked":
        out, rest = b"", content
        while rest:
            size, _, rest = rest.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            out, rest = out + rest[:n], rest[n + 2:]
        content = out
    return RawResponse(status, headers, content)
