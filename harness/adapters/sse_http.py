"""A minimal HTTP/1.1 client for the openai adapter's one hot path: POST a JSON body, read the answer
(an SSE stream or one JSON body) in network-sized reads. httpx / h11 parse every HTTP chunk through
several layers of Python (about 60 % of the client's CPU per streamed chunk, benchmarks/client.py); this
reads up to 64 KiB at a time from asyncio streams and undoes the chunked framing in one loop.

Contract:
- `RawHTTP(root, headers, connect_timeout, read_timeout)` for a plain http:// root; keep-alive
  connections are pooled per instance (an instance belongs to one event loop: the adapter makes one per
  loop, like its httpx client; the adapter's concurrency bounds how many are open).
- `await post(path, body)` -> `RawResponse` (status, headers); then `body()` for the whole body or
  `async for data in resp.iter_bytes()` for the decoded body in network-sized pieces (chunked,
  content-length or read-to-close framing). The connection goes back to the pool only when the body
  was read to its end and the server did not say `connection: close`; anything else closes it.
- Errors: `ConnectFailed` (nothing accepted the connection, or a pooled connection was already closed by
  the server before it answered a byte: safe to retry), `ReadFailed` (the answer broke off), and
  `TimeoutError` when a read waits longer than read_timeout. No TLS, no proxies, no compression (it sends
  no Accept-Encoding): `usable(root)` says whether this client may serve a root (http://, no proxy
  variable set, SPECBENCH_RAW_HTTP not 0); the adapter uses httpx otherwise.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

from specbench import env

READ = 65536
ENV = "SPECBENCH_RAW_HTTP"  # the off switch: 0 = always httpx


class ConnectFailed(ConnectionError):
    """Nothing answered before the request was taken: safe to send again."""


class ReadFailed(ConnectionError):
    """The answer broke off after it began."""


def usable(root: str) -> bool:
    if not env.flag(ENV) or not root.startswith("http://"):
        return False
    return not any(os.environ.get(v) for v in ("http_proxy", "HTTP_PROXY", "all_proxy", "ALL_PROXY"))


class RawResponse:
    def __init__(self, client: RawHTTP, conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], status: int,
                 headers: dict[str, str], rest: bytes) -> None:
        self._client, self._conn, self.status, self.headers, self._rest = client, conn, status, headers, rest
        self._done = False
        self._it: AsyncIterator[bytes] | None = None

    async def _read(self) -> bytes:
        async with asyncio.timeout(self._client.read_timeout):
            return await self._conn[0].read(READ)

    def iter_bytes(self) -> AsyncIterator[bytes]:
        """The decoded body, one piece per network read; one iterator per response (a caller that stopped
        early can resume it, e.g. through `finish`)."""
        if self._it is None:
            self._it = self._pieces()
        return self._it

    async def finish(self, timeout: float) -> None:
        """Read what is left of the body (at most `timeout` s), so the connection can be reused; a body that
        does not end in time closes the connection instead."""
        try:
            async with asyncio.timeout(timeout):
                async for _ in self.iter_bytes():
                    pass
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            self._done = False
        self.release()

    async def _pieces(self) -> AsyncIterator[bytes]:
        try:
            te = self.headers.get("transfer-encoding", "").lower()
            if "chunked" in te:
                async for piece in self._chunked():
                    yield piece
            elif "content-length" in self.headers:
                left = int(self.headers["content-length"])
                data = self._rest[:left]
                left -= len(data)
                if data:
                    yield data
                while left > 0:
                    data = await self._read()
                    if not data:
                        raise ReadFailed(f"the connection closed with {left} body bytes still to come")
                    left -= len(data)
                    yield data
            else:  # read to close
                if self._rest:
                    yield self._rest
                while data := await self._read():
                    yield data
                self.headers["connection"] = "close"
            self._done = True
        finally:
            self.release()

    async def _chunked(self) -> AsyncIterator[bytes]:
        buf, need = self._rest, -1
        while True:
            out: list[bytes] = []
            while True:
                if need < 0:
                    i = buf.find(b"\r\n")
                    if i < 0:
                        break
                    try:
                        size = int(buf[:i].split(b";", 1)[0], 16)
                    except ValueError:
                        raise ReadFailed(f"bad chunk size line {bytes(buf[:40])!r}") from None
                    if size == 0:  # the last chunk: trailers (if any) end with an empty line
                        tail = buf[i + 2:]
                        while not (tail.startswith(b"\r\n") or b"\r\n\r\n" in tail):
                            more = await self._read()
                            if not more:
                                break
                            tail += more
                        if out:
                            yield b"".join(out)
                        return
                    buf, need = buf[i + 2:], size
                if len(buf) < need + 2:
                    break
                out.append(buf[:need])
                buf, need = buf[need + 2:], -1
            if out:
                yield b"".join(out)
            data = await self._read()
            if not data:
                raise ReadFailed("the connection closed inside a chunked body")
            buf += data

    async def body(self) -> bytes:
        return b"".join([x async for x in self.iter_bytes()])  # noqa: C416 (an async iterator)

    def release(self) -> None:
        conn, self._conn = self._conn, None  # type: ignore[assignment]
        if conn is None:
            return
        if self._done and self.headers.get("connection", "").lower() != "close":
            self._client.idle.append(conn)
        else:
            conn[1].close()


class RawHTTP:
    def __init__(self, root: str, headers: dict[str, str], connect_timeout: float, read_timeout: float) -> None:
        u = urlsplit(root)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.base_path = u.path.rstrip("/")
        self.head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self.connect_timeout, self.read_timeout = connect_timeout, read_timeout
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            async with asyncio.timeout(self.connect_timeout):
                conn = await asyncio.open_connection(self.host, self.port, limit=2 ** 20)
        except (OSError, TimeoutError) as e:
            raise ConnectFailed(f"ConnectError ({type(e).__name__}): {e}") from e
        return conn

    async def post(self, path: str, body: bytes) -> RawResponse:
        req = (f"POST {self.base_path}{path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
               f"content-type: application/json\r\naccept: text/event-stream\r\n{self.head}"
               f"content-length: {len(body)}\r\n\r\n").encode("latin-1") + body
        for fresh in (False, True):
            reused = bool(self.idle) and not fresh
            conn = self.idle.pop() if reused else await self._connect()
            try:
                conn[1].write(req)
                async with asyncio.timeout(self.read_timeout):
                    head = await conn[0].readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError) as e:
                conn[1].close()
                if reused:  # a pooled connection the server had closed (its keep-alive timeout): once more, fresh
                    continue
                raise ConnectFailed(f"ConnectError ({type(e).__name__} before any answer): {e}") from e
            except TimeoutError:
                conn[1].close()
                raise
            lines = head.decode("latin-1").split("\r\n")
            try:
                status = int(lines[0].split(" ", 2)[1])
            except (IndexError, ValueError):
                conn[1].close()
                raise ReadFailed(f"not an HTTP/1.1 status line: {lines[0][:80]!r}") from None
            headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
            return RawResponse(self, conn, status, headers, b"")
        raise ConnectFailed("no connection")  # unreachable: the fresh attempt raises or returns

    async def aclose(self) -> None:
        for _, w in self.idle:
            w.close()
        self.idle.clear()
