"""Replays Claude Code's captured Messages requests against a running server and times them.

    python -m strata_jax serve &                      # the quick start; wait for "listening on ..."
    python -m tools.replay_claude_code                # Claude Code's first turn, then a second one on it
    python -m tools.replay_claude_code --turns claude_code_first_turn.json continue claude_code_after_tool_use.json

Each turn is a captured request (`tests/fixtures/claude_code/`, posted as Claude Code sent it: the first turn is
~26,500 prompt tokens with the demo's tokenizer) or `continue`: the previous request with the answer it got and a
new user message appended (tool results for its tool calls, then `--follow-up`), as `claude -p --continue` sends
it, so its prompt starts with the previous one and the prefix cache serves that part. (The after-tool-use fixture
was captured in another session, its text scrambled independently: it shares no prefix with the first turn.)
Prints per request: the time to the first content event (the first token), the total time, prompt tokens (and how
many the prefix cache served), answer tokens, the answer's tok/s, and the machine's load average (a shared
machine's numbers mean little without it). Standard library only: it runs from any Python >= 3.11 without the
package installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import sys
import time
import urllib.parse
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "claude_code"
CONTINUE = "continue"
DEFAULT_TURNS = ("claude_code_first_turn.json", CONTINUE)
FOLLOW_UP = "Now add a docstring and a test for it."


@dataclasses.dataclass(frozen=True)
class TurnResult:
    """One replayed request: seconds to the first content event and to the end, the usage the server reported,
    the stop reason, and the 1-minute load average when it ended."""

    fixture: str
    first_token_s: float
    total_s: float
    prompt_tokens: int
    cached_tokens: int
    answer_tokens: int
    stop_reason: str | None
    load_1m: float

    @property
    def answer_tok_s(self) -> float:
        """Answer tokens per second after the first token (0 when there was at most one)."""
        span = self.total_s - self.first_token_s
        return (self.answer_tokens - 1) / span if self.answer_tokens > 1 and span > 0 else 0.0

    def line(self) -> str:
        """The result as one printed line."""
        return (f"{self.fixture}: first token {self.first_token_s:.2f} s, total {self.total_s:.2f} s, prompt "
                f"{self.prompt_tokens:,} tokens ({self.cached_tokens:,} cached), answer {self.answer_tokens:,} "
                f"tokens ({self.answer_tok_s:.1f} tok/s), stop {self.stop_reason}, load {self.load_1m:.2f}")


def sse_events(response: http.client.HTTPResponse):
    """(event name, data dict) for each server-sent event of a streamed response."""
    name, data = None, []
    for raw in response:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                yield name, json.loads("\n".join(data))
            name, data = None, []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].strip())


def fixture_body(fixture: Path) -> dict:
    """A captured request's body."""
    return dict(json.loads(fixture.read_text())["body"])


def continued(body: dict, answer: list[dict], follow_up: str) -> dict:
    """`body` with the assistant's `answer` (content blocks) and the next user message: a result for each tool
    call, then `follow_up`."""
    results = [{"type": "tool_result", "tool_use_id": block["id"], "content": "done"}
               for block in answer if block["type"] == "tool_use"]
    messages = list(body["messages"])
    if answer:
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": results + [{"type": "text", "text": follow_up}]})
    return body | {"messages": messages}


class AnswerBlocks:
    """The answer's content blocks, rebuilt from its stream's events (text, thinking, tool calls)."""

    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self._json: dict[int, str] = {}

    def feed(self, name: str, data: dict) -> None:
        """Takes one content_block_* event."""
        if name == "content_block_start":
            self.blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            block, delta = self.blocks[data["index"]], data["delta"]
            kind = delta.get("type")
            if kind == "text_delta":
                block["text"] = block.get("text", "") + delta["text"]
            elif kind == "thinking_delta":
                block["thinking"] = block.get("thinking", "") + delta["thinking"]
            elif kind == "signature_delta":
                block["signature"] = delta["signature"]
            elif kind == "input_json_delta":
                self._json[data["index"]] = self._json.get(data["index"], "") + delta["partial_json"]
        elif name == "content_block_stop" and data["index"] in self._json:
            self.blocks[data["index"]]["input"] = json.loads(self._json.pop(data["index"]) or "{}")


def replay(url: str, name: str, body: dict, *, api_key: str, max_tokens: int | None,
           timeout: float) -> tuple[TurnResult, list[dict]]:
    """Posts one request (streamed; `max_tokens` replaced when given) to `url`/v1/messages and times its stream.
    Returns the result and the answer's content blocks."""
    body = body | {"stream": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    parts = urllib.parse.urlsplit(url)
    conn_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_type(parts.hostname, parts.port, timeout=timeout)
    headers = {"Content-Type": "application/json", "anthropic-version": "2023-06-01", "x-api-key": api_key,
               "Authorization": f"Bearer {api_key}", "Accept": "text/event-stream"}
    started = time.perf_counter()
    conn.request("POST", parts.path.rstrip("/") + "/v1/messages", body=json.dumps(body).encode(), headers=headers)
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{name}: HTTP {response.status}: {response.read()[:2000].decode(errors='replace')}")
    first = None
    usage: dict = {}
    stop = None
    answer = AnswerBlocks()
    for event, data in sse_events(response):
        if event.startswith("content_block_"):
            first = time.perf_counter() - started if first is None else first
            answer.feed(event, data)
        elif event == "message_start":
            usage = data["message"].get("usage", {})
        elif event == "message_delta":
            usage = data.get("usage", usage)
            stop = data.get("delta", {}).get("stop_reason")
        elif event == "error":
            raise RuntimeError(f"{name}: the stream ended with an error: {data}")
    total = time.perf_counter() - started
    conn.close()
    cached = usage.get("cache_read_input_tokens", 0)
    result = TurnResult(name, total if first is None else first, total,
                        usage.get("input_tokens", 0) + cached + usage.get("cache_creation_input_tokens", 0), cached,
                        usage.get("output_tokens", 0), stop, os.getloadavg()[0])
    return result, answer.blocks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=os.environ.get("ANTHROPIC_BASE_URL", "http://127.0.0.1:8080"),
                    help="the server's base URL (default: $ANTHROPIC_BASE_URL, else http://127.0.0.1:8080)")
    ap.add_argument("--api-key", default=os.environ.get("ANTHROPIC_AUTH_TOKEN", "local"),
                    help="sent as x-api-key and bearer token (default: $ANTHROPIC_AUTH_TOKEN, else 'local')")
    ap.add_argument("--turns", nargs="+", default=list(DEFAULT_TURNS), metavar="TURN",
                    help=f"the requests, in order: captured ones (names under {FIXTURES}, or paths) or "
                    f"'{CONTINUE}' (the previous request, its answer and --follow-up; default: "
                    f"{' '.join(DEFAULT_TURNS)})")
    ap.add_argument("--follow-up", default=FOLLOW_UP, help=f"the user's message of a '{CONTINUE}' turn (default: "
                    f"{FOLLOW_UP!r})")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="replace each request's max_tokens (default: as captured, 32,000: the answer runs to its "
                    "end of turn)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds without a byte before giving up "
                    "(default 900)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    paths = {t: Path(t) if Path(t).exists() else FIXTURES / t for t in args.turns if t != CONTINUE}
    for path in paths.values():
        if not path.exists():
            ap.error(f"no such fixture: {path}")
    if args.turns[0] == CONTINUE:
        ap.error(f"'{CONTINUE}' continues the turn before it: name a captured request first")
    results, body, answer = [], {}, []
    try:
        for turn in args.turns:
            body = continued(body, answer, args.follow_up) if turn == CONTINUE else fixture_body(paths[turn])
            name = CONTINUE if turn == CONTINUE else paths[turn].name
            result, answer = replay(args.url, name, body, api_key=args.api_key, max_tokens=args.max_tokens,
                                    timeout=args.timeout)
            print(result.line(), flush=True)
            results.append(result)
    except (OSError, RuntimeError) as exc:
        print(f"replay failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        Path(args.json).write_text(json.dumps([dataclasses.asdict(r) | {"answer_tok_s": r.answer_tok_s}
                                               for r in results], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
