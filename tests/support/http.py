"""HTTP checks for the reliability suites (fuzz, hostile, security); no tests here.

- `assert_openai_error`: a 4xx/5xx answer is `{"error": {"message", "type", "param", "code"}}`.
- `raw_http`: bytes sent exactly as given, for what HTTP clients normalise or refuse to send.

The suite size and the figures files come from `reliability.py`, shared with the soak and fault
suites.
"""

from __future__ import annotations

import json


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
