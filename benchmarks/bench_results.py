"""How fast a finished request's captures reach a client on the server's host: over HTTP (the
safetensors bytes, `GET /v1/tapc/results/{id}`) or where they lie (`?via=shm`: the client maps
the server's shared memory, copies what it keeps, then gives it back). CPU only: tapc's own
results store (`MemoryResults`, as one API server process holds results) and arena reader over
real /dev/shm files, served by uvicorn in a process of its own, fetched by aiohttp clients.

    python3 benchmarks/bench_results.py [--results 64] [--rows 290] [--layers 8] [--width 4096] [--clients 8]

Each result is one request's capture of every layer's residual at every row, `[rows, layers,
width]` bf16 in one arena block, served per key as tapc serves it (strided views).
"""
import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse


def app_for(results: int, rows: int, layers: int, width: int) -> FastAPI:
    import torch

    from tapc.wire.arena import Arena, ArenaReader
    from tapc.serving.results import MemoryResults, Stored

    arena, reader = Arena(segment_bytes=1 << 30), ArenaReader()
    blocks = []
    for _ in range(results):
        t = arena.tensor(rows, layers, width, torch.bfloat16)
        t.copy_(torch.randn(rows, layers, width))
        blocks.append(arena.locate(t))
    store = MemoryResults(600.0, lambda: None)
    app = FastAPI()

    @app.get("/r/{i}")
    async def get(i: int, via: str = "http"):
        block = reader.view(*blocks[i], (rows, layers, width), torch.bfloat16)
        tid = f"{i}-{time.monotonic_ns()}"
        await store.put(tid, Stored({f"model.layers.{k}.resid": block[:, k] for k in range(layers)}, {}, None))
        del block
        if via == "shm":
            return JSONResponse({**await store.lend(tid, 1.0, reader.where), "tid": tid})
        reply = await store.take(tid, 1.0)
        return StreamingResponse(reply.chunks, media_type="application/octet-stream",
                                 headers={"content-length": str(reply.size)})

    @app.delete("/r/{tid}")
    async def give_back(tid: str):
        return JSONResponse({"given_back": store.give_back(tid)})

    return app


async def fetch_all(port: int, n: int, clients: int, via: str) -> tuple[int, float]:
    import aiohttp

    from serve_load import kept

    todo, got = list(range(n)), [0]

    async def client(session):
        while todo:
            i = todo.pop()
            async with session.get(f"http://127.0.0.1:{port}/r/{i}", params={"via": via}) as resp:
                if via == "http":
                    body = await resp.read()
                    assert resp.status == 200 and len(body) == int(resp.headers["content-length"]), (resp.status, len(body))
                    got[0] += len(body)
                    continue
                lent = await resp.json()
            copies = await asyncio.to_thread(kept, lent["tensors"])
            got[0] += sum(v.numel() * v.element_size() for v in copies.values())
            async with session.delete(f"http://127.0.0.1:{port}/r/{lent['tid']}") as resp:
                assert (await resp.json())["given_back"]

    async with aiohttp.ClientSession() as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        return got[0], time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=int, default=64)
    ap.add_argument("--rows", type=int, default=290)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)   # the server process's port
    args = ap.parse_args()
    if args.serve:
        import uvicorn

        uvicorn.run(app_for(args.results, args.rows, args.layers, args.width), port=args.serve, log_level="warning")
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--results", str(args.results),
                               "--rows", str(args.rows), "--layers", str(args.layers), "--width", str(args.width)])
    try:
        for _ in range(600):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        size = args.rows * args.layers * args.width * 2
        print(f"{args.results} results of {size / 2**20:.1f} MiB ({args.rows} rows x {args.layers} layers x "
              f"{args.width} bf16), {args.clients} clients, {os.cpu_count()} CPUs\n")
        print("| round | via | GB | seconds | GB/s |\n|---:|---|---:|---:|---:|")
        for r in range(args.rounds):
            for via in ("http", "shm"):
                n, s = asyncio.run(fetch_all(port, args.results, args.clients, via))
                print(f"| {r} | {via} | {n / 1e9:.2f} | {s:.2f} | {n / 1e9 / s:.2f} |", flush=True)
    finally:
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
