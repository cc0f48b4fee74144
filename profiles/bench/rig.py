"""The rig every benchmark, the demo and the soak run on: a real `hat-cloud serve` process, user-space link
emulators in front of it (the link testbed's, testbed.link_emulator), CurveZMQ keys made for the run, and the devices
(edge runtimes, agents) that reach it.

    with Rig("smollm2-135m", cloud_args=["--dtype", "float32"], link="wifi-near") as bed:
        rt = bed.runtime(EdgeConfig(model="smollm2-135m", link=bed.link_config()))
        rt.generate(...)

A device process of a fleet reaches a cloud that another process started: `Rig(upstream=(host, port))` starts no
cloud and gives that process its own link emulators and devices, with the same lifetimes.

Lifetimes (STYLE lesson 11): everything the rig starts goes on one ExitStack and is closed in the reverse order of
starting — devices (and whatever was handed to `defer`), then link emulators, then the cloud process, then the run's
directory (keys, the cloud's log) — when the `with` ends, when its body raises, and when starting fails half way.
A runtime or link may also be closed earlier by the caller (`with bed.add_link(...) as link:`); closing is idempotent.
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from typing import Callable, Dict, Optional, Sequence, Tuple

from cloud_runtime.process import CloudProcess
from edge_runtime.api.agent import Agent, AgentConfig
from edge_runtime.config import EdgeConfig, LinkConfig
from edge_runtime.runtime import EdgeRuntime
from hat_split.net.security import LinkSecurity, ephemeral
from testbed.link_emulator import LinkEmulator
from testbed.links import LinkProfile

AGENT_JOIN_S = 30.0  # s an agent's thread gets to finish its requests and report "stopped" at teardown


class Rig:
    """Context manager: the cloud (or the address of one), its links and its devices for one run.

    model: the cloud's model (registry name, HF directory or .gguf), started as `hat-cloud serve` on a free loopback
        port with `cloud_args` and `threads`; or upstream: (host, port) of a cloud started elsewhere (no process here).
    link: a link profile (or its name) for one emulator in front of the cloud from the start: `link`, `endpoint`.
    secure: CurveZMQ with keys made for this run, the cloud's allow-list holding every name in `devices`; otherwise
        plaintext. With `upstream`, `keys` gives the devices' settings made by the rig that started the cloud.
    status_interval_s: the cloud rewrites its counters and sessions to `status_path` this often (None: never).
    cloud_cpus: the cores the cloud process is pinned to (empty: any), e.g. to leave the others to a device here.
    """

    def __init__(self, model: str = "", *, upstream: Optional[Tuple[str, int]] = None, cloud_args: Sequence[str] = (),
                 threads: int = 0, link: LinkProfile | str | None = None, devices: Sequence[str] = (),
                 secure: bool = False, keys: Optional[Dict[str, LinkSecurity]] = None,
                 status_interval_s: Optional[float] = None, ready_timeout_s: float = 900.0,
                 cloud_cpus: Sequence[int] = ()):
        if bool(model) == (upstream is not None):
            raise ValueError("give the model of a cloud to start, or the upstream (host, port) of a running one")
        if secure and (upstream is not None or not devices):
            raise ValueError("secure: the rig that starts the cloud makes the keys, for the named devices")
        if status_interval_s is not None and (upstream is not None or not status_interval_s > 0):
            raise ValueError("status_interval_s: seconds > 0, for a cloud the rig starts")
        self.model, self.cloud_args, self.threads = model, list(cloud_args), threads
        self.cloud_cpus = tuple(cloud_cpus)  # the cores the cloud process is pinned to (empty: any)
        self.ready_timeout_s = ready_timeout_s  # s for the cloud to load its model and bind
        self.status_interval_s = status_interval_s  # s between the cloud's status-file rewrites; None: no file
        self._link_profile, self._devices, self._secure = link, list(devices), secure
        self.keys: Dict[str, LinkSecurity] = dict(keys or {})  # device name -> its link security
        self.cloud: Optional[CloudProcess] = None
        self.upstream: Optional[Tuple[str, int]] = upstream
        self.link: Optional[LinkEmulator] = None
        self.dir = ""  # the run's directory: keys, the cloud's log, whatever the caller keeps for the run
        self._stack: Optional[contextlib.ExitStack] = None

    # -- lifetime ------------------------------------------------------------------------------------------------

    def __enter__(self) -> Rig:
        with contextlib.ExitStack() as stack:
            self.dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="hatspec-rig-"))
            cloud_security = None  # None: --plaintext
            if self._secure:
                cloud_security, self.keys = ephemeral(os.path.join(self.dir, "keys"), self._devices)
            if self.model:
                status = [] if self.status_interval_s is None else [
                    "--status-file", self.status_path, "--status-interval", str(self.status_interval_s)]
                self.cloud = stack.enter_context(CloudProcess(
                    self.model, extra_args=[*self.cloud_args, *status], threads=self.threads, security=cloud_security,
                    log_path=os.path.join(self.dir, "cloud.log"), ready_timeout_s=self.ready_timeout_s,
                    cpus=self.cloud_cpus))
                self.upstream = ("127.0.0.1", self.cloud.port)
            self._stack = stack.pop_all()
        if self._link_profile is not None:
            try:
                self.link = self.add_link(self._link_profile)
            except BaseException:
                self.close()
                raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close everything in the reverse order of starting; idempotent."""
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()

    def _own(self) -> contextlib.ExitStack:
        if self._stack is None:
            raise RuntimeError("the rig is not running (use it as a context manager)")
        return self._stack

    @property
    def status_path(self) -> str:
        """The cloud's status file (`hat-cloud serve --status-file`), written when status_interval_s is given."""
        return os.path.join(self.dir, "cloud-status.json")

    # -- what devices reach --------------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The ZeroMQ endpoint of the rig's first link, or of the cloud itself when there is no link."""
        if self.link is not None:
            return self.link.address
        host, port = self.upstream
        return f"tcp://{host}:{port}"

    def security(self, device: str = "") -> LinkSecurity:
        """The link security of `device` (one of `devices`) on a secure rig, else plaintext."""
        if not self.keys:
            return LinkSecurity.plaintext()
        if device not in self.keys:
            raise KeyError(f"no keys for device {device!r}: the rig made keys for {', '.join(self.keys)}")
        return self.keys[device]

    def link_config(self, device: str = "", server: str = "", **fields) -> LinkConfig:
        """How `device` reaches the cloud: `server` (default `endpoint`; a link of `add_link` for a device of its
        own), its keys, and any other LinkConfig `fields` (timeouts, link policy)."""
        named = {"device_id": device} if device else {}
        return LinkConfig(server=server or self.endpoint, security=self.security(device), **named, **fields)

    # -- what the rig starts and owns ----------------------------------------------------------------------------

    def add_link(self, profile: LinkProfile | str, *, control: bool = False,
                 seed: Optional[int] = None) -> LinkEmulator:
        """A new link emulator in front of the cloud (`address` for a device); `control`: also a loopback control
        port (`control_address`, testbed.link_emulator.send_control) for cuts from other processes."""
        stack = self._own()
        emu = LinkEmulator(profile, upstream=self.upstream, control=("127.0.0.1", 0) if control else None, seed=seed)
        stack.callback(emu.close)
        return emu

    def runtime(self, config: EdgeConfig, loaded=None) -> EdgeRuntime:
        """An edge runtime for `config` (its `link.server` one of this rig's endpoints), closed at teardown."""
        stack = self._own()
        rt = EdgeRuntime(config, loaded)
        stack.callback(rt.close)
        return rt

    def agent(self, config: AgentConfig, loaded=None) -> Agent:
        """A `hat-edge serve` agent serving from its own thread; stopped and joined at teardown."""
        stack = self._own()
        agent = Agent(config, loaded)
        thread = threading.Thread(target=agent.serve_forever, daemon=True, name=config.edge.link.device_id)
        thread.start()
        stack.callback(thread.join, AGENT_JOIN_S)
        stack.callback(agent.stop)
        return agent

    def defer(self, fn: Callable, *args) -> None:
        """Call fn(*args) at teardown, before what the rig started earlier (e.g. stopping device processes)."""
        self._own().callback(fn, *args)
