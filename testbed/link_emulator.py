"""User-space link emulator: a TCP relay that imposes a LinkProfile between a device and the cloud server.

The kernel here has no netem, so delay, jitter and outages are emulated by a relay: the device connects to the relay
instead of the server, and the relay forwards to the server (``upstream``).

Model, per direction (up = client -> upstream, down = upstream -> client); a direction's rate is shared by every
connection through the relay, as one physical link would be:
1. serialization: a chunk of n bytes occupies the direction for n / rate seconds, from when it is read or when the
   chunk before it is done, whichever is later (back to back while there is a backlog);
2. propagation: the chunk arrives delay + U(-jitter, +jitter) seconds after its serialization ends;
3. in order: per connection, delivery time = max(previous delivery time, computed time); TCP never reorders.
4. loss: each MSS-sized segment of a chunk is lost with the profile's probability; TCP recovers a lost segment by
   retransmitting after a timeout, so a chunk with a loss arrives max(TCP_MIN_RTO_S, 2 RTT) later, and everything
   behind it on the connection waits (head-of-line blocking). The bytes are never dropped: TCP delivers them.
Chunks are at most CHUNK_BYTES so shaping is smooth. A chunk's times are computed when it is read, in absolute loop
time (time.monotonic()), so timer lateness never accumulates. Back-pressure: a direction stops reading while more
than MAX_QUEUE_S of link time is queued, and a connection holds at most MAX_IN_FLIGHT_CHUNKS per direction read but
not delivered; the sender's TCP window then fills, as behind a real bottleneck.

Cut modes:
- "stall": nothing enters or leaves the link; data is held and delivered after restore() (an outage TCP rides out).
- "reset": every connection is reset (RST), and new ones are reset on accept until restore().

The relay runs an asyncio loop on its own thread; the public methods are thread-safe and block until done.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import socket
import struct
import threading
from dataclasses import dataclass, field

from testbed.links import LinkProfile, get_link_profile

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 * 1024     # bytes read per step: 8 ms on a 2 MB/s link, small enough for smooth shaping
MAX_IN_FLIGHT_CHUNKS = 256  # per direction and connection, read but not delivered: <= 4 MiB buffered
MAX_QUEUE_S = 0.05          # s of link time read ahead of the link, like a router's transmit queue: chunks queue
                            # back to back, so timer lateness under this costs no throughput; past it, stop reading
TIMER_LATE_MAX_S = 0.002    # s: cap on one timer-lateness sample (a loop stalled by GC must not skew the mean)
TIMER_LATE_GAIN = 0.1       # weight of a new sample in the running mean of timer lateness
COMMAND_TIMEOUT_S = 5.0     # s: how long a caller waits for the relay thread to start or to run a command
CUT_MODES = ("stall", "reset")
MSS_BYTES = 1448            # a TCP segment on Ethernet-sized links: the unit a loss hits
TCP_MIN_RTO_S = 0.2         # Linux's minimum retransmission timeout


@dataclass
class _Direction:
    """One direction of the link, shared by every connection."""
    name: str                # "up" (client -> upstream) or "down" (upstream -> client)
    busy_until: float = 0.0  # loop time (s) at which the direction has serialized everything it accepted
    bytes: int = 0           # delivered to the receiving socket
    chunks: int = 0          # delivered
    losses: int = 0          # chunks delayed by a retransmission (a lost segment)


@dataclass(eq=False)  # hashed by identity, kept in a set
class _Connection:
    writers: list                              # client writer, then upstream writer once connected
    tasks: list = field(default_factory=list)  # the two pump tasks

    def close(self, reset: bool) -> None:
        for task in self.tasks:
            task.cancel()
        for writer in self.writers:
            if reset:
                _reset(writer)
            else:
                writer.close()


class LinkEmulator:
    """A TCP relay imposing a LinkProfile on everything between its clients and `upstream`.

    Starts listening on construction (`port`, `address`; port 0 picks a free one) and stops on close() or on leaving
    `with`. `control`, if given, is a TCP address for line commands from other processes (see _command).
    """

    def __init__(self, profile: LinkProfile | str, upstream: tuple[str, int],
                 listen: tuple[str, int] = ("127.0.0.1", 0), control: tuple[str, int] | None = None,
                 *, seed: int | None = None, connect_timeout_s: float = 5.0):
        self.profile = get_link_profile(profile)
        self.upstream = (upstream[0], int(upstream[1]))
        self._listen, self._control = listen, control
        self._connect_timeout_s = connect_timeout_s  # s to open the upstream connection before giving up
        self._rng = random.Random(seed)               # jitter draws; seeded for reproducible runs
        self._dirs = {"up": _Direction("up"), "down": _Direction("down")}
        self._conns: set[_Connection] = set()
        self._control_writers: set[asyncio.StreamWriter] = set()
        self._counts = {"accepted": 0, "refused": 0, "upstream_errors": 0}
        self._cut: str | None = None
        self._timer_late_s = 0.0  # s, running mean of how late asyncio timers fire; see _sleep_until
        self._timer_samples = 0   # wake-ups measured so far: the first ones get a plain mean, so it converges fast
        self._closed = False
        self._error: BaseException | None = None
        self.host: str | None = None
        self.port: int | None = None
        self.control_address: tuple[str, int] | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"link-{self.profile.name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(COMMAND_TIMEOUT_S) or self._error is not None:
            self.close()
            raise OSError(f"link emulator could not listen on {listen} (control {control}): {self._error}")

    @property
    def address(self) -> str:
        """The ZeroMQ endpoint a device connects to instead of the server, e.g. "tcp://127.0.0.1:5601"."""
        return f"tcp://{self.host}:{self.port}"

    def __enter__(self) -> LinkEmulator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- commands, callable from any thread --------------------------------------------------------------------

    def cut(self, mode: str = "stall") -> None:
        self._on_loop(self._cut_now, mode)

    def restore(self) -> None:
        self._on_loop(self._restore_now)

    def set_profile(self, profile: LinkProfile | str) -> None:
        self._on_loop(setattr, self, "profile", get_link_profile(profile))

    def stats(self) -> dict:
        """{"profile", "cut", "up"/"down": {"bytes", "chunks"} delivered, "connections": {"active", "accepted",
        "refused" (during a reset cut), "upstream_errors"}}."""
        return self._on_loop(self._stats_now)

    def close(self) -> None:
        """Stop the loop, close every socket and join the thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        loop, stop = getattr(self, "_loop", None), getattr(self, "_stop", None)
        if loop is not None and stop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop already ended
                loop.call_soon_threadsafe(stop.set)
        self._thread.join(COMMAND_TIMEOUT_S)

    def _on_loop(self, fn, *args):
        if self._closed:
            raise RuntimeError("link emulator is closed")

        async def call():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(call(), self._loop).result(COMMAND_TIMEOUT_S)

    # -- on the loop thread ------------------------------------------------------------------------------------

    def _cut_now(self, mode: str) -> None:
        if mode not in CUT_MODES:
            raise ValueError(f"cut mode must be one of {CUT_MODES}, got {mode!r}")
        self._cut = mode
        self._link_up.clear()
        if mode == "reset":
            for conn in list(self._conns):
                conn.close(reset=True)

    def _restore_now(self) -> None:
        self._cut = None
        self._link_up.set()

    def _stats_now(self) -> dict:
        return {"profile": self.profile.name, "cut": self._cut,
                **{d.name: {"bytes": d.bytes, "chunks": d.chunks, "losses": d.losses} for d in self._dirs.values()},
                "connections": {"active": len(self._conns), **self._counts}}

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:  # reported to the constructor if it happened while starting
            self._error = e
            if self._ready.is_set():
                log.exception("link emulator %s stopped", self.profile.name)
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._link_up = asyncio.Event()
        self._link_up.set()
        servers = []
        try:
            servers.append(await asyncio.start_server(_ending_quietly(self._serve_client), *self._listen))
            self.host, self.port = servers[0].sockets[0].getsockname()[:2]
            if self._control is not None:
                servers.append(await asyncio.start_server(_ending_quietly(self._serve_control), *self._control))
                self.control_address = tuple(servers[1].sockets[0].getsockname()[:2])
            self._ready.set()
            await self._stop.wait()
        finally:
            for server in servers:
                server.close()
            for conn in list(self._conns):
                conn.close(reset=True)
            for writer in list(self._control_writers):
                writer.transport.abort()

    async def _serve_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._cut == "reset":
            self._counts["refused"] += 1
            _reset(writer)
            return
        self._counts["accepted"] += 1
        conn = _Connection([writer])
        self._conns.add(conn)
        clean = False
        try:
            await self._link_up.wait()  # a stalled link completes no handshake
            if writer.is_closing():     # reset while it waited
                return
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(*self.upstream), self._connect_timeout_s)
            except (OSError, asyncio.TimeoutError) as e:
                self._counts["upstream_errors"] += 1
                log.warning("link %s: upstream %s:%d unreachable (%s); resetting the client connection",
                            self.profile.name, *self.upstream, str(e) or "timed out")
                return
            conn.writers.append(up_writer)
            conn.tasks = [asyncio.ensure_future(self._pump(reader, up_writer, self._dirs["up"])),
                          asyncio.ensure_future(self._pump(up_reader, writer, self._dirs["down"]))]
            done, pending = await asyncio.wait(conn.tasks, return_when=asyncio.FIRST_EXCEPTION)
            errors = [t.exception() for t in done if not t.cancelled() and t.exception() is not None]
            clean = not pending and not errors and not any(t.cancelled() for t in done)
            if errors:
                log.debug("link %s: connection ended: %r", self.profile.name, errors[0])
        finally:
            self._conns.discard(conn)
            conn.close(reset=not clean)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, d: _Direction) -> None:
        """Read one direction of one connection, serialize it on `d` and hand it to _deliver with its arrival time."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue(MAX_IN_FLIGHT_CHUNKS)  # (arrival loop time, bytes; b"" = EOF)
        deliverer = asyncio.ensure_future(self._deliver(queue, writer, d))
        try:
            last = 0.0  # arrival time of the previous chunk of this connection
            while True:
                await self._sleep_until(d.busy_until - MAX_QUEUE_S)  # back-pressure: a bounded transmit queue
                data = await reader.read(CHUNK_BYTES)
                await self._link_up.wait()
                now, p = loop.time(), self.profile
                d.busy_until = max(now, d.busy_until) + len(data) / p.rate(d.name)
                arrive = d.busy_until + p.delay_s + self._rng.uniform(-p.jitter_s, p.jitter_s)
                if p.loss > 0 and data:
                    segments = -(-len(data) // MSS_BYTES)
                    if self._rng.random() < 1.0 - (1.0 - p.loss) ** segments:
                        arrive += max(TCP_MIN_RTO_S, 4.0 * p.delay_s)  # a retransmission after the timeout
                        d.losses += 1
                last = max(last, arrive)
                await queue.put((last, data))
                if not data:
                    break
            await deliverer
        finally:
            deliverer.cancel()

    async def _deliver(self, queue: asyncio.Queue, writer: asyncio.StreamWriter, d: _Direction) -> None:
        while True:
            arrival, data = await queue.get()
            await self._sleep_until(arrival)
            await self._link_up.wait()
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            d.bytes += len(data)
            d.chunks += 1
            await writer.drain()

    async def _sleep_until(self, when: float) -> None:
        """Sleep until loop time `when`, aiming early by the running mean of timer lateness (epoll rounds timeouts up
        to whole ms and VM timers add more), so wake-ups are on time on average instead of always ~1 ms late."""
        aim = when - self._timer_late_s
        if aim > self._loop.time():
            await asyncio.sleep(aim - self._loop.time())
            late = min(max(self._loop.time() - aim, 0.0), TIMER_LATE_MAX_S)
            self._timer_samples += 1
            self._timer_late_s += max(TIMER_LATE_GAIN, 1 / self._timer_samples) * (late - self._timer_late_s)

    async def _serve_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One JSON line per command line: {"ok": true, ...} or {"ok": false, "error": "..."}."""
        self._control_writers.add(writer)
        try:
            while line := await reader.readline():
                try:
                    reply = {"ok": True, **self._command(line.decode("utf-8", "replace"))}
                except ValueError as e:
                    reply = {"ok": False, "error": str(e)}
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except (OSError, ValueError) as e:  # ValueError: a line over the StreamReader limit
            log.debug("link %s: control connection ended: %r", self.profile.name, e)
        finally:
            self._control_writers.discard(writer)
            writer.close()

    def _command(self, line: str) -> dict:
        """Run one control line (`cut [stall|reset]`, `restore`, `profile NAME`, `stats`); fields for the reply."""
        words = line.split()
        if words == ["stats"]:
            return {"stats": self._stats_now()}
        if words == ["restore"]:
            self._restore_now()
            return {}
        if words[:1] == ["cut"] and len(words) <= 2:
            self._cut_now(words[1] if len(words) == 2 else "stall")
            return {}
        if words[:1] == ["profile"] and len(words) == 2:
            self.profile = get_link_profile(words[1])
            return {}
        raise ValueError(f"unknown command {line.strip()[:80]!r}; "
                         "expected: cut [stall|reset], restore, profile NAME, stats")


def send_control(address: tuple[str, int], command: str, timeout_s: float = COMMAND_TIMEOUT_S) -> dict:
    """Send one command line to a LinkEmulator's control port; its JSON reply, or RuntimeError if it refused."""
    with socket.create_connection(address, timeout=timeout_s) as sock:
        sock.sendall(command.strip().encode() + b"\n")
        with sock.makefile("rb") as f:
            line = f.readline(1 << 20)
    if not line:
        raise ConnectionError(f"link control {address} closed without replying to {command!r}")
    reply = json.loads(line)
    if not reply.get("ok"):
        raise RuntimeError(f"link control refused {command!r}: {reply.get('error')}")
    return reply


def _ending_quietly(serve):
    """A start_server callback that ends normally when cancelled at shutdown (Python 3.11's start_server calls
    task.exception() on it, which raises for a cancelled task)."""
    async def run(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await serve(reader, writer)
    return run


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with an RST (SO_LINGER 0), as a dropped link or a refusing server would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
