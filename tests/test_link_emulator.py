"""Link emulator on loopback: rate, delay, jitter ordering, cuts, control channel, ZeroMQ through the relay."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import zmq

from testbed.link_emulator import LinkEmulator, send_control
from testbed.links import LINK_PROFILES, LinkProfile, get_link_profile

TIMEOUT_S = 10.0  # s: every blocking socket call in these tests; a failure, never a hang
REPO = Path(__file__).resolve().parents[1]


# -- helpers --------------------------------------------------------------------------------------------------------

@contextlib.contextmanager
def tcp_server(handle, sock: socket.socket | None = None):
    """A loopback TCP server running handle(conn) on a thread per connection; yields (host, port)."""
    srv = sock or socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.1)
    stop, threads = threading.Event(), []

    def serve(conn):
        with conn, contextlib.suppress(OSError):
            handle(conn)

    def accept_loop():
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.settimeout(TIMEOUT_S)
            threads.append(threading.Thread(target=serve, args=(conn,), daemon=True))
            threads[-1].start()

    acceptor = threading.Thread(target=accept_loop, daemon=True)
    acceptor.start()
    try:
        yield srv.getsockname()[:2]
    finally:
        stop.set()
        acceptor.join(TIMEOUT_S)
        srv.close()
        for t in threads:
            t.join(TIMEOUT_S)


def echo(conn: socket.socket) -> None:
    while data := conn.recv(65536):
        conn.sendall(data)


def connect(address: tuple[str, int]) -> socket.socket:
    sock = socket.create_connection(address, timeout=TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        data = sock.recv(n - len(buf))
        if not data:
            raise ConnectionError(f"EOF after {len(buf)} of {n} bytes")
        buf += data
    return bytes(buf)


def ping_rtts(address: tuple[str, int], count: int) -> list[float]:
    with connect(address) as sock:
        rtts = []
        for i in range(count):
            t0 = time.monotonic()
            sock.sendall(b"ping%04d" % i)
            assert recv_exactly(sock, 8) == b"ping%04d" % i
            rtts.append(time.monotonic() - t0)
        return rtts


def dropped(sock: socket.socket) -> bool:
    """True if the peer closed or reset the connection."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def refused(address: tuple[str, int]) -> bool:
    """True if a new connection is reset or closed at once (the kernel accepts, the relay resets it at once, maybe
    before connect() returns)."""
    try:
        with connect(address) as sock:
            return dropped(sock)
    except ConnectionResetError:
        return True


# -- profiles -------------------------------------------------------------------------------------------------------

def test_profiles_validate_and_lookup():
    assert {"loopback", "wifi-near", "wifi-mid", "wifi-far", "lte", "nb-iot", "satellite"} <= set(LINK_PROFILES)
    assert get_link_profile("wifi-near").up_rate_bps == 10e6
    assert get_link_profile("nb-iot").up_rate_bps == 350e3 / 8
    with pytest.raises(ValueError, match="known: loopback, wifi-near"):
        get_link_profile("wifi-moon")
    for bad in (dict(up_rate_bps=0), dict(down_rate_bps=-1.0), dict(up_rate_bps=float("nan")),
                dict(delay_s=-0.001), dict(delay_s=0.01, jitter_s=0.02), dict(delay_s=float("inf"))):
        with pytest.raises(ValueError, match="link profile 'x'"):
            LinkProfile("x", **bad)
    assert LinkProfile("x", up_rate_bps=float("inf")).rate("up") == float("inf")


# -- accuracy: a user-space relay is only as punctual as the scheduler ----------------------------------------------

ATTEMPTS = 3


def best_of(measure, within, what: str):
    """The first of ATTEMPTS results of measure() that is within tolerance. If none is, fail, except on a saturated
    CPU (1-minute load average above the core count), where the timers cannot be punctual: skip, saying so. Gross
    errors fail in any case: measure() asserts a loose bound itself."""
    for _ in range(ATTEMPTS):
        result = measure()
        print(f"{what}: {result}")
        if within(result):
            return result
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    if load > cores:
        pytest.skip(f"{what} {result} out of tolerance on a saturated CPU (load {load:.1f} on {cores} cores)")
    pytest.fail(f"{what} {result} out of tolerance (load {load:.1f} on {cores} cores)")


# -- (a) rate, both directions at once, each at its own rate -------------------------------------------------------

def transfer_both_ways(profile: LinkProfile, size: int) -> dict:
    """Send `size` random bytes each way at once through a relay; bytes/s seen by each receiver, first to last byte."""
    payload = {"up": os.urandom(size), "down": os.urandom(size)}
    arrivals = {"up": [], "down": []}  # (monotonic s, bytes) per recv at the receiver
    got = {}

    def receive(sock, direction):
        buf = bytearray()
        while len(buf) < size and (data := sock.recv(65536)):
            arrivals[direction].append((time.monotonic(), len(data)))
            buf += data
        got[direction] = bytes(buf)

    def send_and_receive(sock, send, receive_as):
        sender = threading.Thread(target=sock.sendall, args=(payload[send],))
        sender.start()
        receive(sock, receive_as)
        sender.join(TIMEOUT_S)

    with tcp_server(lambda conn: send_and_receive(conn, "down", "up")) as addr, LinkEmulator(profile, addr) as link:
        with connect(("127.0.0.1", link.port)) as sock:
            send_and_receive(sock, "up", "down")
        deadline = time.monotonic() + TIMEOUT_S
        while "up" not in got and time.monotonic() < deadline:  # the server's receive may finish last
            time.sleep(0.01)
    assert got == payload
    rates = {}
    for direction, times in arrivals.items():
        (t_first, n_first), (t_last, _) = times[0], times[-1]
        rates[direction] = (size - n_first) / (t_last - t_first)
    return rates


def test_rate_each_direction_independently():
    configured = {"up": 2e6, "down": 4e6}  # bytes/s
    profile = LinkProfile("rate-test", configured["up"], configured["down"], delay_s=0.005)

    def rate_error(measured: dict) -> float:
        return max(abs(measured[d] - configured[d]) / configured[d] for d in configured)

    def measure() -> dict:
        measured = transfer_both_ways(profile, 2_500_000)
        # gross errors fail at once (a shaper not applied reads ~100x; one direction shaped by the other's rate 2x);
        # a hiccup of the 2-core machine's scheduler (seen: one attempt 30 % slow) is retried by best_of
        assert rate_error(measured) < 0.5, measured
        return measured

    measured = best_of(measure, lambda m: rate_error(m) < 0.10, "rates (bytes/s)")
    for d in ("up", "down"):
        print(f"{d}: configured {configured[d] / 1e6:.2f} MB/s, measured {measured[d] / 1e6:.3f} MB/s")


# -- (b) delay ------------------------------------------------------------------------------------------------------

def test_one_way_delay():
    delay = 0.020  # s

    def one_way(port: int) -> float:
        baseline = statistics.median(ping_rtts(addr, 20))
        relayed = statistics.median(ping_rtts(("127.0.0.1", port), 20))
        one_way = (relayed - baseline) / 2
        assert abs(one_way - delay) < 0.010, one_way
        return one_way

    with tcp_server(echo) as addr, LinkEmulator(LinkProfile("delay-test", delay_s=delay), addr) as link:
        measured = best_of(lambda: one_way(link.port), lambda m: abs(m - delay) < 0.002, "one-way delay (s)")
    print(f"one-way delay: configured {delay * 1e3:.1f} ms, measured {measured * 1e3:.2f} ms")


def test_set_profile_at_run_time():
    with tcp_server(echo) as addr, LinkEmulator("loopback", addr) as link:
        fast = statistics.median(ping_rtts(("127.0.0.1", link.port), 5))
        link.set_profile(LinkProfile("slow", delay_s=0.030))
        slow = statistics.median(ping_rtts(("127.0.0.1", link.port), 5))
        with pytest.raises(ValueError, match="unknown link profile"):
            link.set_profile("nope")
        assert link.stats()["profile"] == "slow"
    assert slow - fast > 0.050  # 2 x 30 ms more, give or take the scheduler


# -- (c) jitter keeps order and bytes -------------------------------------------------------------------------------

def test_jitter_keeps_order_and_content():
    rng = random.Random(0)
    pieces = [rng.randbytes(rng.randint(1, 4000)) for _ in range(200)]
    expected = b"".join(pieces)
    profile = LinkProfile("jitter-test", delay_s=0.010, jitter_s=0.010)  # each way uniform in [0, 20] ms
    with tcp_server(echo) as addr, LinkEmulator(profile, addr, seed=1) as link:
        rtts = ping_rtts(("127.0.0.1", link.port), 15)
        with connect(("127.0.0.1", link.port)) as sock:
            def send():
                for piece in pieces:
                    sock.sendall(piece)
                    time.sleep(0.0005)  # separate reads, so many chunks with independent jitter
            sender = threading.Thread(target=send)
            sender.start()
            got = recv_exactly(sock, len(expected))
            sender.join(TIMEOUT_S)
        chunks = link.stats()["up"]["chunks"]
    print(f"jitter: RTTs {min(rtts) * 1e3:.1f}..{max(rtts) * 1e3:.1f} ms, {chunks} chunks up")
    assert got == expected  # byte-exact and in order, though later chunks often drew shorter delays
    assert chunks > 20  # many chunks, each with its own jitter draw
    assert max(rtts) - min(rtts) > 0.005  # the jitter is there


# -- (d) cuts -------------------------------------------------------------------------------------------------------

def test_stall_holds_data_until_restore():
    payload = os.urandom(200_000)
    with tcp_server(echo) as addr, LinkEmulator("loopback", addr) as link, \
            connect(("127.0.0.1", link.port)) as sock:
        sock.sendall(b"before")
        assert recv_exactly(sock, 6) == b"before"
        link.cut("stall")
        sock.sendall(payload)
        sock.settimeout(0.3)
        with pytest.raises(socket.timeout):
            sock.recv(1)
        assert link.stats()["up"]["bytes"] == 6 and link.stats()["cut"] == "stall"
        link.restore()
        sock.settimeout(TIMEOUT_S)
        assert recv_exactly(sock, len(payload)) == payload


def test_reset_drops_connections_until_restore():
    with tcp_server(echo) as addr, LinkEmulator("loopback", addr) as link:
        with connect(("127.0.0.1", link.port)) as sock:
            sock.sendall(b"hello")
            assert recv_exactly(sock, 5) == b"hello"
            link.cut("reset")
            assert dropped(sock)
        assert refused(("127.0.0.1", link.port))
        stats = link.stats()
        assert stats["connections"]["refused"] == 1 and stats["connections"]["active"] == 0
        link.restore()
        assert len(ping_rtts(("127.0.0.1", link.port), 3)) == 3


def test_unreachable_upstream_then_serves_again():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))  # bound, not listening: connecting is refused
        with LinkEmulator("loopback", srv.getsockname()[:2]) as link:
            assert refused(("127.0.0.1", link.port))
            assert link.stats()["connections"]["upstream_errors"] == 1
            srv.listen()
            with tcp_server(echo, sock=srv):
                assert len(ping_rtts(("127.0.0.1", link.port), 2)) == 2


def test_listen_conflict_and_close_idempotent():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        with pytest.raises(OSError, match="could not listen"):
            LinkEmulator("loopback", ("127.0.0.1", 9), listen=taken.getsockname()[:2])
    link = LinkEmulator("loopback", ("127.0.0.1", 9))
    link.close()
    link.close()
    assert not link._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        link.stats()


# -- (e) control channel, from another process ---------------------------------------------------------------------

def hat_link(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "testbed.link_cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=30)


def test_control_channel():
    with tcp_server(echo) as addr, \
            LinkEmulator("loopback", addr, control=("127.0.0.1", 0)) as link:
        control = f"{link.control_address[0]}:{link.control_address[1]}"
        done = hat_link("cut", "stall", "--control", control)
        assert done.returncode == 0, done.stderr
        assert link.stats()["cut"] == "stall"
        done = hat_link("stats", "--control", control)
        assert done.returncode == 0 and json.loads(done.stdout)["cut"] == "stall"
        assert send_control(link.control_address, "restore") == {"ok": True}
        assert send_control(link.control_address, "profile lte") == {"ok": True}
        assert link.profile.name == "lte" and link.stats()["cut"] is None
        with pytest.raises(RuntimeError, match="known: loopback"):
            send_control(link.control_address, "profile nope")
        with pytest.raises(RuntimeError, match="unknown command"):
            send_control(link.control_address, "explode now")
        assert send_control(link.control_address, "cut reset") == {"ok": True}
        assert link.stats()["cut"] == "reset"
    assert "wifi-near" in hat_link("--list").stdout


# -- (f) ZeroMQ DEALER / ROUTER through the relay -------------------------------------------------------------------

def test_zmq_dealer_router_through_relay_and_reconnect_after_reset():
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        for s in (router, dealer):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, int(TIMEOUT_S * 1000))
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        with LinkEmulator("wifi-near", ("127.0.0.1", port)) as link:
            dealer.connect(link.address)

            def round_trip(i: int) -> float:
                body = os.urandom(100_000)
                t0 = time.monotonic()
                dealer.send_multipart([b"%d" % i, body])
                ident, tag, got = router.recv_multipart()
                assert (tag, got) == (b"%d" % i, body)
                router.send_multipart([ident, tag, got[::-1]])
                assert dealer.recv_multipart() == [tag, body[::-1]]
                return time.monotonic() - t0

            rtts = [round_trip(i) for i in range(5)]
            link.cut("reset")
            time.sleep(0.2)
            link.restore()
            rtts.append(round_trip(99))  # the DEALER reconnected by itself
            assert link.stats()["connections"]["accepted"] >= 2
        # 100 kB at 10 MB/s up and 15 MB/s down, plus 2 x 2 ms: at least 20 ms a round trip
        print(f"zmq through wifi-near: RTTs {[round(r * 1e3, 1) for r in rtts]} ms")
        assert all(r > 0.015 for r in rtts)
    finally:
        dealer.close()
        router.close()
        ctx.term()


def test_cli_runs_relay_until_interrupted():
    with tcp_server(echo) as (host, port):
        proc = subprocess.Popen([sys.executable, "-m", "testbed.link_cli", "--profile", "wifi-far", "--listen",
                                 "127.0.0.1:0", "--upstream", f"{host}:{port}", "--stats-interval", "0.2"],
                                cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        killer = threading.Timer(3 * TIMEOUT_S, proc.kill)  # unblocks the readline()s below if it hangs
        killer.start()
        try:
            banner = proc.stdout.readline()  # "hat-link wifi-far: tcp://127.0.0.1:PORT -> ..."
            relay_port = int(banner.split("tcp://127.0.0.1:")[1].split()[0])
            assert len(ping_rtts(("127.0.0.1", relay_port), 3)) == 3
            stats_line = proc.stdout.readline()
            proc.send_signal(signal.SIGINT)
            assert proc.wait(TIMEOUT_S) == 0
        finally:
            killer.cancel()
            proc.kill()
            proc.communicate(timeout=TIMEOUT_S)
    assert "[wifi-far]" in stats_line and "connections" in stats_line


# -- (e) loss: TCP retransmits, so a lost segment shows as a delay, never as missing bytes ---------------------------

def test_loss_delays_chunks_and_keeps_every_byte():
    rng = random.Random(3)
    payload = rng.randbytes(400_000)
    profile = LinkProfile("lossy", delay_s=0.002, loss=0.02)  # 2 % of 1448-byte segments
    with tcp_server(echo) as addr, LinkEmulator(profile, addr, seed=2) as link:
        with connect(("127.0.0.1", link.port)) as sock:
            threading.Thread(target=sock.sendall, args=(payload,), daemon=True).start()
            got = bytearray()
            while len(got) < len(payload):
                got += sock.recv(65536)
        stats = link.stats()
    assert bytes(got) == payload
    assert stats["up"]["losses"] > 0 and stats["down"]["losses"] > 0
    with pytest.raises(ValueError, match="loss must be a probability"):
        LinkProfile("x", loss=1.0)


# -- (f) the kernel's rate: a namespace behind a tbf-shaped veth (root) ----------------------------------------------

def _netns_reason():
    from testbed.netns_link import unavailable

    return unavailable()


@pytest.mark.netns
@pytest.mark.skipif(_netns_reason() is not None, reason=str(_netns_reason()))
def test_netns_link_shapes_rate_in_the_kernel_and_delay_in_the_relay():
    """A client inside the namespace sends 300 kB up a 250 kB/s link (satellite's, without its loss so the rate is
    what is measured): tbf holds it to the rate; a tiny round trip pays the relay's 2 × 300 ms. The namespace, its
    link and the relay are gone afterwards."""
    import dataclasses
    import subprocess
    import sys

    from testbed.netns_link import NetnsLink, tbf_args

    assert tbf_args(250e3)[:2] == ["rate", "2000000bit"]
    script = """import socket, sys, time
host, port = sys.argv[1].rsplit(":", 1)
s = socket.create_connection((host, int(port)))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
t0 = time.perf_counter(); s.sendall(b"p"); s.recv(1); rtt = time.perf_counter() - t0
data = bytes(300_000); t0 = time.perf_counter(); s.sendall(data); got = 0
while got < len(data):
    got += len(s.recv(65536))
print(rtt, time.perf_counter() - t0)
"""
    with tcp_server(echo) as addr:
        lossless = dataclasses.replace(LINK_PROFILES["satellite"], name="satellite-lossless", loss=0.0)
        with NetnsLink(lossless, upstream=addr, name="hs-linktest") as link:
            assert "tbf" in link.qdiscs() and "2Mbit" in link.qdiscs()
            out = subprocess.run(link.exec([sys.executable, "-c", script, link.address[len("tcp://"):]]),
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            rtt, seconds = map(float, out.stdout.split())
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert 0.55 < rtt < 0.7  # 2 × (300 ± 10) ms
    # up at 250 kB/s and back down at 1.25 MB/s (echo), pipelined: the uplink dominates (1.2 s)
    assert 1.0 < seconds < 2.6, seconds
    assert "hs-linktest" not in names
