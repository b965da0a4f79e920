"""`python -m strata_jax.bench --mode fuzz`: thousands of hostile bodies against a real `serve` process.

Starts `python -m strata_jax serve` (the bundled demo model by default, 4 slots, an API key) on a free port, or
uses `--url` (then `--api-key` must be its key). While one client streams the same greedy request over and over
(the first answer is the reference), `--bodies` seeded hostile bodies (strata_jax/bench/fuzz_bodies.py) go to
/v1/messages, /v1/messages/count_tokens and /v1/chat/completions from `--clients` connections at once. Then: bad
credentials (every one must be a 401), and a disconnect soak (streams dropped after their first bytes beside streams
read to the end), after which no slot may stay busy. Reported: status classes, problems (5xx, error bodies out of
the API's shape, 200 streams with an error event or without their end), streams alongside that failed or changed
(engine errors leaked to other requests), leaked slots; `--json` for a machine-readable line.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import http.client
import json
import os
import random
import re
import subprocess
import sys
import threading
import time
import urllib.parse

from strata_jax.bench.fuzz_bodies import CHAT, COUNT, MESSAGES, SEED, check_response, hostile_request, parse_sse

KEY = "fuzz-key"
REFERENCE = {"model": "m", "max_tokens": 48, "stream": True, "temperature": 0,
             "messages": [{"role": "user", "content": "Write a Python function that reverses a string."}]}


def fuzz_args(p: argparse.ArgumentParser) -> None:
    """The fuzz mode's flags."""
    g = p.add_argument_group("fuzz mode")
    g.add_argument("--bodies", type=int, default=2000, help="hostile bodies to send (default 2000)")
    g.add_argument("--seed", type=int, default=SEED, help=f"seed of the body generator (default {SEED})")
    g.add_argument("--clients", type=int, default=4, help="connections sending bodies at once (default 4)")
    g.add_argument("--url", default=None, help="fuzz a running server instead of starting one (needs --api-key; "
                   "default: start one)")
    g.add_argument("--api-key", default=None, help="the running server's key (with --url; default: none)")
    g.add_argument("--soak", type=int, default=48, help="streams dropped after their first bytes (default 48)")


class _Server:
    """A `serve` subprocess on a free port (the demo model unless `model`), stopped with SIGTERM."""

    def __init__(self, model: str | None, slots: int = 4):
        cmd = [sys.executable, "-m", "strata_jax", "serve", "--port", "0", "--slots", str(slots), "--api-key", KEY]
        if model:
            cmd += ["--model", model]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.log: list[str] = []
        self.url = None
        for line in self.proc.stdout:
            self.log.append(line)
            print(f"  serve: {line.rstrip()}", file=sys.stderr, flush=True)
            if m := re.match(r"listening on (http://\S+)", line):
                self.url = m.group(1)
                break
        if self.url is None:
            raise RuntimeError("the server did not start:\n" + "".join(self.log[-20:]))
        threading.Thread(target=lambda: [self.log.append(x) for x in self.proc.stdout], daemon=True).start()

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def _post(url: str, path: str, body: bytes, headers: dict[str, str], timeout: float = 600.0
          ) -> tuple[int, str, str]:
    """(status, content type, text) of one POST on a fresh connection."""
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/json", **headers})
        r = conn.getresponse()
        return r.status, r.getheader("content-type", ""), r.read().decode("utf-8", "replace")
    finally:
        conn.close()


def _get(url: str, path: str) -> str:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        conn.request("GET", path, headers={"x-api-key": KEY})
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def _stream_text(status: int, text: str) -> str | None:
    """The answer text of a complete 200 Anthropic stream, else None."""
    if status != 200:
        return None
    frames = parse_sse(text)
    if not frames or frames[-1][0] != "message_stop":
        return None
    return "".join(d["delta"].get("text", "") for name, d in frames if name == "content_block_delta")


def _slots_busy(url: str) -> float:
    m = re.search(r"^strata_slots_busy\s+(\S+)", _get(url, "/metrics"), re.M)
    return float(m.group(1)) if m else float("nan")


def run_fuzz(args: argparse.Namespace) -> dict:
    """Runs the fuzz benchmark (see the module docstring); returns the report."""
    server = None if args.url else _Server(args.model_dir)
    url, key = (args.url, args.api_key) if args.url else (server.url, KEY)
    auth = {"x-api-key": key}
    started = time.monotonic()
    report: dict = {"bodies": args.bodies, "seed": args.seed, "clients": args.clients}
    try:
        reference = _stream_text(*_post(url, MESSAGES, json.dumps(REFERENCE).encode(), auth)[::2])
        if reference is None:
            raise RuntimeError("the reference stream failed before fuzzing")
        stop, alongside = threading.Event(), collections.Counter()

        def stream_alongside():
            while not stop.is_set():
                status, _, text = _post(url, MESSAGES, json.dumps(REFERENCE).encode(), auth)
                got = _stream_text(status, text)
                alongside["ok" if got == reference else "failed" if got is None else "changed"] += 1

        side = threading.Thread(target=stream_alongside, daemon=True)
        side.start()
        rng = random.Random(args.seed)
        requests = []
        for _ in range(args.bodies):
            path = rng.choice([MESSAGES, MESSAGES, COUNT, CHAT, CHAT])
            requests.append((path, *hostile_request(rng, path)))
        counts: collections.Counter = collections.Counter()
        problems: list[str] = []
        lock, done = threading.Lock(), [0]

        def send(item):
            path, data, headers, cls = item
            try:
                status, ctype, text = _post(url, path, data, {**auth, **headers})
            except Exception as exc:  # noqa: BLE001 - a dropped connection is a finding, not a crash
                status, ctype, text = 599, "", f"connection failed: {exc}"
            with lock:
                check_response(path, status, ctype, text, cls, counts, problems)
                done[0] += 1
                if done[0] % 250 == 0:
                    print(f"  fuzz: {done[0]}/{args.bodies} bodies, {time.monotonic() - started:.0f}s, "
                          f"{dict((k, v) for k, v in sorted(counts.items()) if k.endswith('xx'))}", file=sys.stderr,
                          flush=True)

        with concurrent.futures.ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(send, requests))
        stop.set()
        side.join(600)
        report.update(status_classes={k: v for k, v in sorted(counts.items()) if k.endswith("xx")},
                      server_errors=sum(v for k, v in counts.items() if k in ("5xx",)),
                      problems=len(problems), problem_examples=problems[:10],
                      alongside_streams=sum(alongside.values()),
                      leaked_engine_errors=alongside["failed"] + alongside["changed"])
        # Credentials: none, wrong key, wrong scheme.
        bad = [{}, {"x-api-key": "wrong"}, {"authorization": "Bearer wrong"}, {"authorization": "Basic " + key}]
        refused = sum(_post(url, MESSAGES, json.dumps(REFERENCE).encode(), h)[0] == 401 for h in bad * 25)
        report.update(auth_refused=f"{refused}/{len(bad) * 25}")
        # Disconnect soak: half the streams are dropped after their first bytes, half read to the end.
        def soak(i: int) -> bool:
            body = json.dumps({**REFERENCE, "max_tokens": 200}).encode()
            if i % 2:
                return _stream_text(*_post(url, MESSAGES, body, auth)[::2]) is not None
            u = urllib.parse.urlsplit(url)
            conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
            conn.request("POST", MESSAGES, body=body, headers={"content-type": "application/json", **auth})
            conn.getresponse().read(64)
            conn.close()
            return True

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            completed = sum(pool.map(soak, range(2 * args.soak)))
        deadline = time.monotonic() + 30
        while (busy := _slots_busy(url)) and time.monotonic() < deadline:
            time.sleep(0.5)
        after = _stream_text(*_post(url, MESSAGES, json.dumps(REFERENCE).encode(), auth)[::2])
        report.update(soak_streams=2 * args.soak, soak_dropped=args.soak, soak_completed=completed - args.soak,
                      leaked_slots=busy, greedy_unchanged_after_soak=after == reference)
    finally:
        if server is not None:
            report["server_exit_code"] = server.stop()
    report["seconds"] = round(time.monotonic() - started, 1)
    return report


def print_fuzz_report(report: dict) -> None:
    """The report as a few readable lines."""
    print(f"fuzz: {report['bodies']} bodies (seed {report['seed']}, {report['clients']} clients) in "
          f"{report['seconds']}s")
    print(f"  status classes: {report.get('status_classes')}; 5xx: {report.get('server_errors')}; problems: "
          f"{report.get('problems')}")
    for example in report.get("problem_examples", []):
        print(f"    {example}")
    print(f"  streams alongside: {report.get('alongside_streams')}, failed or changed (engine errors leaked to other "
          f"requests): {report.get('leaked_engine_errors')}")
    print(f"  bad credentials refused: {report.get('auth_refused')}")
    print(f"  disconnect soak: {report.get('soak_streams')} streams, {report.get('soak_dropped')} dropped; leaked "
          f"slots: {report.get('leaked_slots')}; greedy output unchanged after: "
          f"{report.get('greedy_unchanged_after_soak')}")
