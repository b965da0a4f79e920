"""`python -m strata_jax.bench.profile TRACE [HLO]`: where a compiled step's device time goes.

TRACE is the Perfetto trace (`perfetto_trace.json.gz`) that `python -m strata_jax.bench --mode step --profile DIR`
writes; HLO is the same step's compiled HLO text (`--dump-hlo DIR`).

With HLO, kernel time adds up per model component: every kernel event names the HLO instruction it ran, and the
instruction's `op_name` carries the named scopes the decoder puts around each part of a layer (`linear_layer` /
`attention_layer`, then `ple`, `hyper`, `mixer` (an attention layer's QSA indexer apart: `mixer/indexer`), `mlp`). A
prefill trace reads the same way (`python -m tools.profile_prefill` does it). On a GPU, kernels inside XLA's command
buffers carry the buffer (`command_buffer_1`) as their `hlo_op`; their event name is the instruction's name with `_`
for `.` (`loop_add_fusion_85` runs `loop_add_fusion.85`), which is used instead. Kernels no instruction explains
(Pallas kernels are named after their Python function, library kernels after themselves) are listed as `other:
NAME`.

Without HLO (or with `--by-kernel`), kernel time adds up per kernel name, numeric suffix dropped. With `--gemms`
(HLO needed), the matrix products alone (`gemm`/`dot` instructions: XLA's Triton GEMM fusions, cuBLAS calls) add up
per output shape and op, to see which projection runs how far from its bytes.

With `--host`, the host's side instead: every event off the device, per name (XLA's `command_buffer::update` when a
CUDA graph is updated before its launch, `cuGraphLaunch`, the executable's `Execute`, ...), with its calls and time
per step and per call. Nested events each count in full (an update inside an `Execute` counts in both). The Python
tracer's frames (`$file.py:line function`) come only with `--python`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from collections import defaultdict

_OP_NAME = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?metadata=\{[^}]*?op_name="([^"]*)"')
_SHAPED = re.compile(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\w+\[[\d,]*\])')
_GEMM = re.compile(r"gemm|dot|cublas")
_LAYER = re.compile(r"(linear_layer|attention_layer)")
_PART = re.compile(r"/(ple|hyper|mixer|mlp)/")


def component(op_name: str, instruction: str) -> str:
    """'linear_layer/mixer', 'attention_layer/mlp', ..., or 'other' (embedding, LM head, sampling, glue)."""
    layer = _LAYER.search(op_name)
    if not layer:
        return "other"
    part = _PART.search(op_name[layer.end():] + "/")
    name = f"{layer.group(1)}/{part.group(1) if part else 'rest'}"
    if part and part.group(1) == "mixer" and "/indexer/" in op_name[layer.end():] + "/":
        name += "/indexer"  # QSA's block scoring and selection, apart from the attention it selects for
    if part and part.group(1) == "mlp" and "pallas" in instruction:
        name += " (1-bit expert kernels)"
    return name


def op_components(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> component, from the instructions' op_name metadata."""
    out = {}
    for line in hlo_text.splitlines():
        m = _OP_NAME.match(line)
        if m:
            out[m.group(1)] = component(m.group(2), m.group(1))
    return out


def kernel_events(trace: dict) -> list[dict]:
    """The kernel events of a Perfetto/Chrome trace: every event on a device, else (no device in the trace, as on
    a CPU) the events that name an HLO instruction."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    processes = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in processes.items() if "GPU" in name or "device" in name.lower()}
    timed = [e for e in events if e.get("ph") == "X"]
    return [e for e in timed if e.get("pid") in device] or [e for e in timed if "hlo_op" in e.get("args", {})]


_SUFFIX = re.compile(r"_(\d+)$")


def kernel_family(name: str) -> str:
    """A kernel's name without its numeric suffix (`loop_add_fusion_85` -> `loop_add_fusion`), at most 60 chars."""
    return _SUFFIX.sub("", name)[:60]


def event_component(event: dict, comps: dict[str, str]) -> str:
    """The component of one kernel event: through its `hlo_op`, else through its own name as an instruction."""
    for inst in (event.get("args", {}).get("hlo_op", ""), _SUFFIX.sub(r".\1", event["name"]), event["name"]):
        if inst in comps:
            return comps[inst]
    return f"other: {kernel_family(event['name'])}"


def summarize(trace: dict, hlo_text: str | None, steps: int) -> list[tuple[str, int, float]]:
    """(component -- or kernel name without HLO --, kernels per step, microseconds per step), largest first."""
    comps = op_components(hlo_text) if hlo_text is not None else None
    kernels: dict[str, int] = defaultdict(int)
    micros: dict[str, float] = defaultdict(float)
    for e in kernel_events(trace):
        name = event_component(e, comps) if comps is not None else kernel_family(e["name"])
        kernels[name] += 1
        micros[name] += float(e.get("dur", 0.0))
    rows = [(name, round(kernels[name] / steps), micros[name] / steps) for name in kernels]
    return sorted(rows, key=lambda r: -r[2])


def gemm_rows(trace: dict, hlo_text: str, steps: int) -> list[tuple[str, str, int, float]]:
    """(output shape, op name without the jit prefix, kernels per step, microseconds per step) of the kernels that
    run a `gemm` / `dot` instruction, largest first."""
    shapes, ops = {}, {}
    for line in hlo_text.splitlines():
        if m := _SHAPED.match(line):
            shapes[m.group(1)] = m.group(2)
        if m := _OP_NAME.match(line):
            ops[m.group(1)] = m.group(2).split("/", 1)[-1]
    kernels: dict[tuple[str, str], int] = defaultdict(int)
    micros: dict[tuple[str, str], float] = defaultdict(float)
    for e in kernel_events(trace):
        for inst in (e.get("args", {}).get("hlo_op", ""), _SUFFIX.sub(r".\1", e["name"]), e["name"]):
            if inst in shapes and _GEMM.search(inst):
                key = (shapes[inst], ops.get(inst, "?"))
                kernels[key] += 1
                micros[key] += float(e.get("dur", 0.0))
                break
    rows = [(shape, op, round(kernels[(shape, op)] / steps), micros[(shape, op)] / steps) for shape, op in kernels]
    return sorted(rows, key=lambda r: -r[3])


def occupancy(trace: dict, steps: int) -> dict:
    """Per step: kernels, those launched inside a command buffer (a CUDA graph: `hlo_op` names the buffer), the
    microseconds the device spent in kernels and the span from the first kernel's start to the last one's end (busy
    far below the span: the device waits for launches or the host)."""
    events = kernel_events(trace)
    if not events:
        return dict(kernels=0, in_graphs=0, busy_us=0.0, span_us=0.0)
    graphed = sum(1 for e in events if str(e.get("args", {}).get("hlo_op", "")).startswith("command_buffer"))
    start = min(float(e["ts"]) for e in events)
    end = max(float(e["ts"]) + float(e.get("dur", 0.0)) for e in events)
    return dict(kernels=len(events) / steps, in_graphs=graphed / steps,
                busy_us=sum(float(e.get("dur", 0.0)) for e in events) / steps, span_us=(end - start) / steps)


def host_rows(trace: dict, steps: int, python: bool = False) -> list[tuple[str, float, float, float]]:
    """(event name, calls per step, microseconds per step, microseconds per call) of the timed events off the
    device (on a trace without a device: those that name no HLO instruction), largest time first. The profiler's
    Python frames (`$file.py:line function`) are left out unless `python`: they nest around everything and would
    crowd XLA's and CUDA's events out of any top-N."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    on_device = {id(e) for e in kernel_events(trace)}
    calls: dict[str, int] = defaultdict(int)
    micros: dict[str, float] = defaultdict(float)
    for e in events:
        if e.get("ph") == "X" and id(e) not in on_device and (python or not str(e.get("name", "")).startswith("$")):
            calls[e["name"]] += 1
            micros[e["name"]] += float(e.get("dur", 0.0))
    rows = [(name, calls[name] / steps, micros[name] / steps, micros[name] / calls[name]) for name in calls]
    return sorted(rows, key=lambda r: -r[2])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata_jax.bench.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace", help="perfetto_trace.json.gz written by `bench --mode step --profile DIR`")
    p.add_argument("hlo", nargs="?", help="the step's HLO text written by `bench --mode step --dump-hlo DIR` "
                                          "(without it: time per kernel name)")
    p.add_argument("--steps", type=int, default=2, help="steps the trace holds (bench --profile traces 2)")
    p.add_argument("--by-kernel", action="store_true", help="sum by kernel name even when HLO is given")
    p.add_argument("--gemms", action="store_true", help="the matrix products only, per output shape and op (needs HLO)")
    p.add_argument("--host", action="store_true", help="the host's events instead (graph updates, launches, ...), "
                   "per name")
    p.add_argument("--top", type=int, default=25, help="with --host: the names with the most time (default 25)")
    p.add_argument("--python", action="store_true", help="with --host: the Python frames too (`$file.py:line "
                   "function`; left out by default, they would fill the top rows)")
    args = p.parse_args(argv)
    if args.gemms and not args.hlo:
        p.error("--gemms needs the step's HLO text")
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        trace = json.load(f)
    if args.host:
        print("| host event | calls per step | us per step | us per call |")
        print("| --- | --- | --- | --- |")
        for name, n, us, per_call in host_rows(trace, args.steps, args.python)[:args.top]:
            print(f"| {name[:80]} | {n:.1f} | {us:.0f} | {per_call:.1f} |")
        return 0
    hlo_text = None
    if args.hlo and not args.by_kernel:
        with open(args.hlo) as f:
            hlo_text = f.read()
    if args.gemms:
        print("| output shape | op | kernels per step | us per step |")
        print("| --- | --- | --- | --- |")
        for shape, op, n, us in gemm_rows(trace, hlo_text, args.steps):
            print(f"| {shape} | {op} | {n} | {us:.0f} |")
        return 0
    rows = summarize(trace, hlo_text, args.steps)
    total = sum(r[2] for r in rows) or 1.0
    print(f"| {'component' if hlo_text is not None else 'kernel'} | kernels per step | us per step | share |")
    print("| --- | --- | --- | --- |")
    for name, n, us in rows:
        print(f"| {name} | {n} | {us:.0f} | {us / total:.0%} |")
    print(f"| all kernels | {sum(r[1] for r in rows)} | {total:.0f} | 100% |")
    occ = occupancy(trace, args.steps)
    print(f"\nper step: {occ['kernels']:.0f} kernels, {occ['in_graphs']:.0f} of them in command buffers; device busy "
          f"{occ['busy_us']:.0f} us of a {occ['span_us']:.0f} us span ({occ['busy_us'] / max(occ['span_us'], 1):.0%})")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # piped into head: the reader has what it wanted
        sys.stderr.close()
        sys.exit(0)
