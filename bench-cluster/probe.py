#!/usr/bin/env python3
"""What a shaped link delivers to plain TCP: an iperf-style probe.

One process per emulated node (run inside the node's network namespace).
Each listens on PORT, then at the agreed start time opens FLOWS TCP
connections to every peer it is told to send to and sends as fast as the
kernel takes data for WARMUP + SECONDS seconds. Receivers count the bytes
that arrive inside the measured window (after the warm-up, so TCP's slow
start is not counted) and print one JSON line:

  {"node": K, "received_bytes": B, "window_s": T, "from": {"10.77.0.11": b, ...}}

bench-cluster/run.sh --probe starts it on every node with the pattern of
the training run's traffic (a ring: each node to the next; all: each node
to every other) and reports each node's delivered rate next to the nominal
one, so `zeropp plan --nic-gbit` can be given what the link delivers.
"""
import argparse
import json
import socket
import sys
import threading
import time

CHUNK = 64 << 10


def serve(listener, window, counts, lock, done):
    """Accept connections until `done`; count bytes inside the window per source."""
    listener.settimeout(0.2)
    threads = []

    def drain(conn, addr):
        conn.settimeout(0.5)
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        got = outside = 0
        # Drain until the sender closes (its last send may end after the
        # window), or a while after the window if it never does.
        while time.time() < window[1] + 30:
            try:
                n = conn.recv_into(view)
            except socket.timeout:
                continue
            except OSError:
                break
            if n == 0:
                break
            now = time.time()
            if window[0] <= now < window[1]:
                got += n
            else:
                outside += n
        conn.close()
        with lock:
            counts[addr[0]] = counts.get(addr[0], 0) + got
            counts["outside_window"] = counts.get("outside_window", 0) + outside

    while not done.is_set():
        try:
            conn, addr = listener.accept()
        except socket.timeout:
            continue
        t = threading.Thread(target=drain, args=(conn, addr), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(timeout=max(0.0, window[1] + 31 - time.time()))


def send(peer, port, start, stop, errors, late):
    """One flow: connect, wait for the start, send until the stop; how late
    after the start its first byte went (in `late`)."""
    payload = b"\0" * CHUNK
    deadline = time.time() + 30
    while True:
        try:
            s = socket.create_connection((peer, port), timeout=5)
            break
        except OSError as e:
            if time.time() > deadline:
                errors.append(f"cannot connect to {peer}:{port}: {e}")
                return
            time.sleep(0.1)
    s.settimeout(5)
    time.sleep(max(0.0, start - time.time()))
    late.append(round(time.time() - start, 3))
    try:
        while time.time() < stop:
            s.sendall(payload)
    except OSError as e:
        if time.time() < stop:
            errors.append(f"sending to {peer}: {e}")
    finally:
        s.close()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--listen", required=True, help="this node's address")
    p.add_argument("--port", type=int, default=29600)
    p.add_argument("--to", default="", help="comma-separated peer addresses to send to")
    p.add_argument("--flows", type=int, default=1, help="TCP connections to each peer")
    p.add_argument("--start", type=float, required=True, help="epoch seconds to start sending")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--seconds", type=float, default=8.0)
    a = p.parse_args()

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((a.listen, a.port))
    listener.listen(256)

    window = (a.start + a.warmup, a.start + a.warmup + a.seconds)
    counts, lock, done, errors, late = {}, threading.Lock(), threading.Event(), [], []
    server = threading.Thread(target=serve, args=(listener, window, counts, lock, done), daemon=True)
    server.start()
    senders = [
        threading.Thread(
            target=send, args=(peer, a.port, a.start, window[1], errors, late), daemon=True
        )
        for peer in filter(None, a.to.split(","))
        for _ in range(a.flows)
    ]
    for t in senders:
        t.start()
    for t in senders:
        t.join(timeout=window[1] - time.time() + 30)
    # Let the peers' last bytes of the window arrive, then stop accepting and
    # wait for the open flows to end.
    time.sleep(max(0.0, window[1] + 1.0 - time.time()))
    done.set()
    server.join(timeout=40)
    if errors:
        sys.exit("probe: " + "; ".join(errors))
    outside = counts.pop("outside_window", 0)
    print(json.dumps({
        "node": a.node,
        "received_bytes": sum(counts.values()),
        "window_s": a.seconds,
        "from": counts,
        # Diagnostics: bytes that arrived before or after the window, and
        # how late after the agreed start each flow began sending.
        "outside_window_bytes": outside,
        "started_late_s": late,
    }))


if __name__ == "__main__":
    main()
