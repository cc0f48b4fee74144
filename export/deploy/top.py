"""`hat-fleet top`: the cloud's fleet view in a terminal — the cloud's model, sessions and KV memory, then one row per
device (state, protocol mix, tokens/s, TTFT and TBT medians, acceptance, link rates and drops, power mode, watts,
bundle, age of its last report), read from the cloud's dashboard (`hat-cloud serve --dashboard-port`, GET
/fleet.json; docs/DASHBOARD.md) every `--interval` seconds; `q` quits. `--once` prints the table once, for scripts.

`table_lines` (document → lines, the rightmost columns dropped to fit a width) is pure and is what both views print;
`fetch_view` is the HTTP; `live` the curses loop. Only HTTP and JSON: nothing of the cloud is imported.
"""
from __future__ import annotations

import json
import locale
import time
import urllib.error
import urllib.request
from typing import Any, Callable, List, Optional, Sequence, Tuple

NULL = "–"  # a figure nothing measured (null in the document); the page shows the same
SEPARATOR = "  "


class FetchError(RuntimeError):
    """The fleet view could not be read: one line saying from where and why."""


# -- formatting (pure) ----------------------------------------------------------------------------------------------
def _num(x: Any) -> Optional[float]:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _text(x: Any) -> str:
    return str(x) if isinstance(x, str) and x else NULL


def fmt_seconds(x: Any) -> str:
    """A latency: ms below a second, else seconds."""
    v = _num(x)
    if v is None:
        return NULL
    if v < 1.0:
        return f"{v * 1e3:.1f} ms" if v < 0.01 else f"{v * 1e3:.0f} ms"
    return f"{v:.2f} s"


def fmt_rate(x: Any) -> str:
    """Bits per second with an SI prefix: 850, 12.3k, 4.5M, 1.2G; 0 (the device measured none) is unknown."""
    v = _num(x)
    if v is None or v <= 0:
        return NULL
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= scale:
            return f"{v / scale:.1f}{prefix}" if v < 100 * scale else f"{v / scale:.0f}{prefix}"
    return f"{v:.0f}"


def fmt_bytes(x: Any) -> str:
    """Bytes in binary units: 512 B, 3.0 KiB, 1.5 GiB."""
    v = _num(x)
    if v is None:
        return NULL
    for unit in ("B", "KiB", "MiB", "GiB"):
        if v < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return NULL  # not reached


def fmt_age(x: Any) -> str:
    """How long ago: seconds, minutes, hours."""
    v = _num(x)
    if v is None:
        return NULL
    v = max(v, 0.0)
    if v < 60:
        return f"{v:.0f} s"
    return f"{v / 60:.0f} min" if v < 3600 else f"{v / 3600:.1f} h"


def fmt_protocols(protocols: Any) -> str:
    """The protocol mix: each protocol's share of the requests, the most used first ("sd 75% hat 25%")."""
    if not isinstance(protocols, dict):
        return NULL
    counts = [(str(k), n) for k, n in protocols.items() if _num(n) and n > 0]
    total = sum(n for _, n in counts)
    if not total:
        return NULL
    return " ".join(f"{k} {100 * n / total:.0f}%" for k, n in sorted(counts, key=lambda kv: (-kv[1], kv[0])))


def fmt_state(d: dict) -> str:
    state = _text(d.get("state"))
    return state if d.get("connected", True) else f"{state} (offline)"


def _fixed(x: Any, digits: int, suffix: str = "", scale: float = 1.0) -> str:
    v = _num(x)
    return NULL if v is None else f"{v * scale:.{digits}f}{suffix}"


# (title, cell of a device, right-aligned): the order both the page and the terminal show
COLUMNS: Tuple[Tuple[str, Callable[[dict], str], bool], ...] = (
    ("device", lambda d: _text(d.get("device")), False),
    ("state", fmt_state, False),
    ("protocols", lambda d: fmt_protocols(d.get("protocols")), False),
    ("tok/s", lambda d: _fixed(d.get("tokens_per_s"), 1), True),
    ("TTFT p50", lambda d: fmt_seconds(d.get("ttft_p50_s")), True),
    ("TBT p50", lambda d: fmt_seconds(d.get("tbt_p50_s")), True),
    ("accept", lambda d: _fixed(d.get("acceptance"), 0, "%", 100.0), True),
    ("up/down bit/s", lambda d: f"{fmt_rate(d.get('up_bps'))}/{fmt_rate(d.get('down_bps'))}", True),
    ("drops", lambda d: _fixed(d.get("link_drops"), 0), True),
    ("power mode", lambda d: _text(d.get("power_mode")), False),
    ("watts", lambda d: _fixed(d.get("watts"), 1, " W"), True),
    ("bundle", lambda d: _text(d.get("bundle")), False),
    ("report", lambda d: fmt_age(d.get("last_report_s")), True),
)


def check_view(doc: Any, where: str = "the fleet view") -> dict:
    """The document's shape (a cloud object and a list of device objects), else ValueError saying what is wrong."""
    if not isinstance(doc, dict):
        raise ValueError(f"{where}: not a fleet view (a JSON object with cloud and devices)")
    if not isinstance(doc.get("cloud"), dict):
        raise ValueError(f"{where}: no `cloud` object")
    devices = doc.get("devices")
    if not isinstance(devices, list) or not all(isinstance(d, dict) for d in devices):
        raise ValueError(f"{where}: `devices` is not a list of objects")
    return doc


def cloud_line(doc: dict) -> str:
    """The header: the cloud's model and engine, sessions, KV memory held of its budget, devices connected."""
    c = doc["cloud"]
    used, budget = _num(c.get("kv_bytes")), _num(c.get("kv_budget_bytes"))
    share = f" ({100 * used / budget:.0f}%)" if used is not None and budget else ""
    return (f"cloud: {_text(c.get('model'))} ({_text(c.get('engine'))})  sessions {_fixed(c.get('sessions'), 0)}/"
            f"{_fixed(c.get('max_sessions'), 0)}  KV {fmt_bytes(used)} / {fmt_bytes(budget)}{share}  "
            f"devices {_fixed(c.get('devices'), 0)}  steps {_fixed(c.get('steps'), 0)}")


def rows(doc: dict) -> List[List[str]]:
    """The cells of each device, in the document's order (sorted by device id), for COLUMNS."""
    return [[cell(d) for _, cell, _ in COLUMNS] for d in doc["devices"]]


def table_lines(doc: dict, width: Optional[int] = None) -> List[str]:
    """The cloud line, the column titles, then one line per device; with `width`, the rightmost columns that do not
    fit are left out (the device column is always shown, cut to the width) and every line is at most `width` long."""
    check_view(doc)
    cells = rows(doc)
    widths = [max([len(title)] + [len(r[i]) for r in cells]) for i, (title, _, _) in enumerate(COLUMNS)]
    shown, used = 0, -len(SEPARATOR)
    for w in widths:
        if width is not None and shown and used + len(SEPARATOR) + w > width:
            break
        shown, used = shown + 1, used + len(SEPARATOR) + w

    def line(values: Sequence[str]) -> str:
        out = SEPARATOR.join(v.rjust(widths[i]) if COLUMNS[i][2] else v.ljust(widths[i])
                             for i, v in enumerate(values[:shown])).rstrip()
        return out if width is None else out[:width]

    lines = [cloud_line(doc), line([title for title, _, _ in COLUMNS]), *(line(r) for r in cells)]
    if not cells:
        lines.append("(no device has connected)")
    return lines if width is None else [x[:width] for x in lines]


# -- I/O ------------------------------------------------------------------------------------------------------------
def view_url(url: str) -> str:
    """The fleet view's address from the dashboard's (http://HOST:PORT, with or without /fleet.json)."""
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--url must be the dashboard's http://HOST:PORT, got {url!r}")
    url = url.rstrip("/")
    return url if url.endswith("/fleet.json") else url + "/fleet.json"


def inventory_url(cloud: Any) -> str:
    """The dashboard of an inventory's cloud host (its `hatspec_dashboard_port`, at its ansible_host, loopback for
    a local connection, else its name); ValueError when the host has no dashboard port."""
    port = cloud.get("hatspec_dashboard_port")
    if not port:
        raise ValueError(f"the cloud host {cloud.name} has no hatspec_dashboard_port (the --dashboard-port it serves); "
                         "set it in the inventory or give --url http://HOST:PORT")
    host = cloud.get("ansible_host") or ("127.0.0.1" if cloud.get("ansible_connection") == "local" else cloud.name)
    host = f"[{host}]" if ":" in str(host) else host
    return f"http://{host}:{int(port)}"


def fetch_view(url: str, timeout_s: float = 5.0) -> dict:
    """GET the fleet view at `url` (view_url's); FetchError in one line when it cannot be read or is not one."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            body = r.read()
    except urllib.error.HTTPError as exc:
        raise FetchError(f"{url}: HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        reason = getattr(exc.reason, "strerror", None) or exc.reason
        raise FetchError(f"cannot reach {url}: {reason}") from None
    except (OSError, ValueError) as exc:  # a timeout while reading, a malformed address
        raise FetchError(f"cannot reach {url}: {exc}") from None
    try:
        return check_view(json.loads(body), url)
    except ValueError as exc:  # JSONDecodeError is one
        raise FetchError(str(exc) if str(exc).startswith(url) else f"{url}: not JSON: {exc}") from None


def once(url: str, width: Optional[int], out: Callable[[str], None] = print) -> None:
    """Print the table once (FetchError when the view cannot be read)."""
    for text in table_lines(fetch_view(url), width):
        out(text)


def live(url: str, interval_s: float, fetch: Callable[[str], dict] = fetch_view) -> int:
    """The curses view: refetched every `interval_s`; an unreachable cloud is shown in the status line and retried;
    `q` quits."""
    import curses

    locale.setlocale(locale.LC_ALL, "")  # so that curses writes UTF-8 where the terminal takes it
    try:
        return curses.wrapper(_loop, url, interval_s, fetch)
    except KeyboardInterrupt:  # Ctrl-C quits as q does (the terminal is restored by then)
        return 0


def _loop(scr: Any, url: str, interval_s: float, fetch: Callable[[str], dict]) -> int:
    import curses

    try:
        curses.curs_set(0)
    except curses.error:  # a terminal without cursor visibility
        pass
    scr.timeout(100)  # ms: how often a key is looked for
    utf8 = "utf" in locale.getpreferredencoding(False).lower()
    doc: Optional[dict] = None
    status, next_at = "", 0.0
    while True:
        now = time.monotonic()
        if now >= next_at:
            try:
                doc = fetch(url)
                status = f"{url}  updated {time.strftime('%H:%M:%S')}  every {interval_s:g} s  q: quit"
            except FetchError as exc:
                status = f"{exc}  (retrying every {interval_s:g} s)  q: quit"
            next_at = now + interval_s
            _draw(scr, doc, status, utf8)
        key = scr.getch()
        if key in (ord("q"), ord("Q")):
            return 0
        if key == curses.KEY_RESIZE:
            _draw(scr, doc, status, utf8)


def _draw(scr: Any, doc: Optional[dict], status: str, utf8: bool) -> None:
    import curses

    height, width = scr.getmaxyx()
    lines = table_lines(doc, width - 1) if doc is not None else []
    scr.erase()
    for y, text in enumerate(lines[:max(height - 2, 0)]):
        _put(scr, y, text, width, curses.A_BOLD if y == 1 else 0, utf8)
    _put(scr, height - 1, status, width, curses.A_REVERSE, utf8)
    scr.refresh()


def _put(scr: Any, y: int, text: str, width: int, attr: int, utf8: bool) -> None:
    import curses

    try:
        scr.addnstr(y, 0, text if utf8 else text.replace(NULL, "-"), max(width - 1, 0), attr)
    except curses.error:  # a terminal smaller than one line
        pass
