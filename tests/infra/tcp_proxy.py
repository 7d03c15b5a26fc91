"""A tiny TCP proxy put in front of the test S3 server to simulate outages (run as a script).

    python tcp_proxy.py LISTEN_PORT TARGET_PORT [--rate BYTES_PER_S] [--fail-first N]

Killing this process (SIGKILL) resets every open connection and refuses new ones — the S3 endpoint
is down — while the S3 server behind it keeps its buckets and objects; starting it again on the same
port brings the endpoint back. SIGSTOP makes it a hung server (connections are accepted by the
kernel but nothing answers). `--rate` slows client→server bytes so a write is reliably in flight
when the proxy is killed; `--fail-first N` answers the first N requests with 503 SlowDown.
Prints `ready` once listening and `up <bytes>` as client bytes are forwarded.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

SLOWDOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
    b"Content-Length: 113\r\n\r\n"
    b"<?xml version=\"1.0\"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
)


class Proxy:
    def __init__(self, target_port: int, rate: float, fail_first: int) -> None:
        self.target_port, self.rate, self.fail_left = target_port, rate, fail_first
        self.up = 0
        self.reported = 0

    async def pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: bool) -> None:
        try:
            while data := await reader.read(16384 if upstream and self.rate else 65536):
                writer.write(data)
                await writer.drain()
                if upstream:
                    self.up += len(data)
                    if self.up - self.reported >= 65536:
                        self.reported = self.up
                        print(f"up {self.up}", flush=True)
                    if self.rate:
                        await asyncio.sleep(len(data) / self.rate)
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self.fail_left > 0:
            self.fail_left -= 1
            try:
                await client_r.readuntil(b"\r\n\r\n")
                client_w.write(SLOWDOWN)
                await client_w.drain()
            except (ConnectionError, OSError, asyncio.IncompleteReadError):
                pass
            client_w.close()
            return
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(self.pipe(client_r, server_w, True), self.pipe(server_r, client_w, False))


async def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("listen_port", type=int)
    parser.add_argument("target_port", type=int)
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--fail-first", type=int, default=0)
    args = parser.parse_args(argv)
    proxy = Proxy(args.target_port, args.rate, args.fail_first)
    server = await asyncio.start_server(proxy.handle, "127.0.0.1", args.listen_port, reuse_address=True)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
