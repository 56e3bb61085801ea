"""The wire's own ceiling: a bare gRPC stream, and a bare migration lane, between two
processes on this machine.

No work is done per byte: no framing, no hash, no copy into a cache. The channel
options and message size are a migration's (4 MiB, about one layer's KV frame).
``bench migrate`` reports it next to each raw transfer, measured in the same run:
a migration's transfer over gRPC cannot beat it, so ``transfer_over_ceiling`` says
how much of the wire the checkpoint path leaves unused.

:func:`measure_lane` does the same on a migration lane (kvferry.migration_lane),
the socket beside the stream that a migration's frames take by default.

The gRPC sink is this module run with ``--serve``. It listens on 127.0.0.1 only, takes
the caller's token (the ``authorization`` metadata) and stops with its parent's run.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time

METHOD = "/kvferry.bench.Sink/Take"
MESSAGE = 4 << 20


def _serve(token: str) -> None:
    from concurrent import futures

    import grpc

    from ..transport import grpc_options

    def take(requests, context):
        if dict(context.invocation_metadata()).get("authorization") != f"Bearer {token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "auth failed")
        n = sum(len(m) for m in requests)
        yield str(n).encode()

    server = grpc.server(futures.ThreadPoolExecutor(2), options=grpc_options())
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "kvferry.bench.Sink", {"Take": grpc.stream_stream_rpc_method_handler(take)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin (or goes)
    server.stop(0)


def _stop(sink: subprocess.Popen) -> None:
    sink.stdin.close()  # the sink stops when its stdin ends
    try:
        sink.wait(10)
    except subprocess.TimeoutExpired:
        sink.kill()


def _result(rates: list[float], message: int, count: int) -> dict:
    return {"mb_s": sorted(rates)[(len(rates) - 1) // 2], "reps": rates, "message_bytes": message,
            "bytes": count * message}


def measure(total_bytes: int, reps: int = 3, message: int = MESSAGE) -> dict:
    """MB/s of ``total_bytes`` streamed to the sink in ``message``-byte messages,
    ``reps`` times; the median and every rep."""
    import grpc

    from ..transport import grpc_options

    token = secrets.token_urlsafe(16)
    sink = subprocess.Popen([sys.executable, "-m", "kvferry.bench.ceiling", "--serve"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "KVFERRY_SINK_TOKEN": token})
    try:
        port = int(sink.stdout.readline())
        payload = os.urandom(message)
        count = max(1, total_bytes // message)
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=grpc_options()) as ch:
            call = ch.stream_stream(METHOD)
            rates = []
            for _ in range(reps):
                t = time.perf_counter()
                got = int(b"".join(call(iter([payload] * count), metadata=(("authorization", f"Bearer {token}"),))))
                rates.append(round(got / 1e6 / (time.perf_counter() - t), 1))
    finally:
        _stop(sink)
    return _result(rates, message, count)


def _serve_lane() -> None:
    """A migration lane's target end (kvferry.migration_lane) that drops what it reads:
    its port, then one ticket a line for each connection the parent makes."""
    import threading

    from ..migration_lane import Inbox, LaneListener

    lane = LaneListener("127.0.0.1", 0)
    print(lane.port, flush=True)
    for _ in sys.stdin:  # a line: the parent wants a ticket for one more run
        stream_open = threading.Event()  # the Transfer stream the lane sits beside: open until the run ends

        def held():
            stream_open.wait()
            yield from ()
        inbox = Inbox(held())
        print(lane.issue(inbox).hex(), flush=True)
        inbox.merge()
        got, want = 0, int(sys.stdin.readline())
        for frame in inbox:
            got += len(frame.data)
            frame.release()  # as the Transfer handler does once a frame has landed
            if got >= want:
                break
        stream_open.set()
        inbox.close()
        print(got, flush=True)


def measure_lane(total_bytes: int, reps: int = 3, message: int = MESSAGE) -> dict:
    """As :func:`measure`, on a migration lane instead of a gRPC stream: the socket a
    migration's KV frames take beside the stream, with its framing and buffers but
    no checkpoint work."""
    from ..migration_lane import LaneWriter

    sink = subprocess.Popen([sys.executable, "-m", "kvferry.bench.ceiling", "--serve-lane"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(sink.stdout.readline())
        payload = os.urandom(message)
        count = max(1, total_bytes // message)
        rates = []
        for _ in range(reps):
            sink.stdin.write("run\n")
            sink.stdin.flush()
            ticket = bytes.fromhex(sink.stdout.readline())
            sink.stdin.write(f"{count * message}\n")
            sink.stdin.flush()
            w = LaneWriter("127.0.0.1", port, ticket, None, lambda _: None)
            t = time.perf_counter()
            for i in range(count):
                w.put(i, payload)
            got = int(sink.stdout.readline())
            rates.append(round(got / 1e6 / (time.perf_counter() - t), 1))
            w.close()
    finally:
        _stop(sink)
    return _result(rates, message, count)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve(os.environ["KVFERRY_SINK_TOKEN"])
elif __name__ == "__main__" and sys.argv[1:] == ["--serve-lane"]:
    _serve_lane()
