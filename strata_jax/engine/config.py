"""Serving configuration, fixed at start: everything that decides compiled shapes lives here."""

from __future__ import annotations

import dataclasses

# `serve`'s context per slot when --ctx is not given (strata_jax.engine.planner.choose_context). Coding agents need
# long prompts from the first request (Claude Code's is 34,360 tokens with the demo's tokenizer, and grows).
AGENT_CONTEXT = 65_536  # the least the default aims for where it fits
CPU_CONTEXT = 65_536  # no device statistics to plan with; the demo's caches at 4 slots take 160 MiB
MAX_DEFAULT_CONTEXT = 262_144  # more only on request: prefill attention and its slot copy grow with it
# EngineConfig.cache_dtype's values (None: the model's dtype); int8 and fp8 quantize the attention K and V only.
CACHE_DTYPES = (None, "bfloat16", "float32", "int8", "fp8")
# The longest draft per drafter (EngineConfig.draft; "none" is a drafter passed to the Engine, e.g. a draft model
# or a benchmark's oracle). A model drafter runs one forward pass per drafted token, each reading the LM head
# (1.27 GB at Flash-Next shapes), and the chance that its k-th guess survives falls as acceptance^k: past 8 the
# chain costs more than it returns. Prompt lookup drafts for free, so long copies get up to 16; a verify window of
# more than 16 tokens (k = 16) leaves the decode kernels (decode attention and the recurrent delta rule take
# T <= 16) for the chunked paths, so k = 16 is the one width past them.
MAX_DRAFT_K = {"none": 16, "ngram": 16, "mtp": 8}
MAX_MODEL_DRAFT_K = 8  # a separate draft model (strata_jax/engine/draft_model.py)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """slots: concurrent sequences decoded by one step. max_context: tokens per slot (prompt + output).
    prefill_chunks: prompt chunk sizes compiled at warm-up; the largest is the longest piece a prompt is cut into
    (and bounds how long a prefill chunk stalls running streams), smaller ones serve short remainders.
    prefill_batch: the most prompts prefilled together in one call (each its own chunk, one row of the call): up to
    this many prompts that need a chunk of the same size share a step, in power-of-two groups (each group size is
    compiled for each chunk size). 1 = one prompt per call.
    prefix_cache_mib: host memory for prefix-cache snapshots (0 disables it). prefix_cache_device_mib: device memory
    for the most recently used snapshots (restored device to device; the others go to the host; 0 = none); the
    engine cuts it after warm-up to what the device holds beside its largest step's workspace.
    snapshot_every: prompt tokens between prefix-cache snapshots during prefill (a multiple of the largest chunk;
    a snapshot follows each prompt piece that passes a multiple of it).
    draft: speculative drafter for every slot: "none", "ngram" (prompt lookup) or "mtp" (the checkpoint's own MTP
    head, chained draft_k times inside each step); draft_k: the most tokens guessed per step for a slot, at most
    `MAX_DRAFT_K[draft]` (16 for n-gram and for a drafter passed to the Engine, 8 for the model drafters).
    adaptive_draft: each slot's draft length grows and shrinks with its acceptance (strata_jax/engine/draft_policy.py:
    a length from `draft_ks` by an acceptance EWMA; none for a few steps while drafts keep missing); the verify
    step is compiled for each of `verify_widths` and a step takes the narrowest that fits its longest draft (shorter
    windows inside it are masked). Off: every slot drafts draft_k tokens every step (one compiled verify width).
    cache_dtype: dtype of KV and conv caches ("bfloat16" (or "bf16") / "float32"; None = the model's dtype), or
    "int8" / "fp8" (e4m3): attention K and V stored in one byte with a float32 scale per position and kv head (half
    a bf16 KV cache), the other caches in the model's dtype. Gated DeltaNet recurrent state is always float32.
    overlap_steps: while the decoding requests ran in the step before (no drafter, no PLE layers, no grammar or
    log-probabilities, nothing to admit), launch step n+1 on step n's sampled tokens, still on the device, before
    reading them back: the host's per-step work (launch, read-back, stop checks, events) then overlaps the
    device's. Other prompts may prefill meanwhile (their calls queue behind the step in flight). A request that
    stops at step n has had one more token computed, which is discarded.
    chain_windows: with overlap_steps and a drafter that also guesses on the device (the MTP head, the benchmarks'
    oracle: `drafters.DeviceDrafter`), verify windows chain the same way: window n+1 is built on the device from
    window n's emitted tokens and the drafter's device guesses and launched before window n is read back (a synced
    window paid ~8.6 ms of launch and host work beside its ~9.3 ms on the device: docs/PERF.md). Windows near a
    request's length limits, and any step with a grammar mask or log-probabilities, run in step with the host.
    Adaptive draft lengths then follow acceptance one window late; a request that stops inside window n has had
    window n+1 computed, which is discarded (and its end-of-turn prefix snapshot is skipped: the slot is ahead).
    donate_counts: a host-tier model's steps consume the routing counters they are given and write the next ones
    in their buffers (on one device; off: new buffers every step, which makes the step's CUDA graphs update
    every step: docs/PERF.md, "Streamed experts").
    watchdog_s: an engine iteration (one prefill chunk plus one step) running longer than this is taken as stuck:
    every request fails with a retryable error and `Engine.health()` turns false until the step returns (0 = off).
    progress_min_tokens: a prompt at least this long logs its prefill progress (logger "strata_jax.engine", INFO) at
    most every progress_every_s seconds, and one line when its first token is out (TTFT, prompt tok/s, cached).
    Prefill beside decoding slots (strata_jax/engine/prefill_policy.py): mixed_step_ms: while any slot decodes, a
    prefill call takes a compiled shape whose warm-up call took at most this long (a decoding stream's longest wait
    for a token, about), the one carrying the most tokens for the prompts waiting; mixed_prefill: the (chunk width,
    prompts) to take instead.
    decode_share: while slots decode, prefill gets at most 1 - this of the engine's time (0 = no pacing).
    share_by_requests: the decoders' share is also at most their part of the requests in slots, D / (D + W) for D
    decoding and W prefilling: four prompts waiting beside four decoders get half the time, not 1 - decode_share
    as one would (meant for many agents arriving together; off until measured on a GPU).
    prefill_burst_ms: prompts whose whole remaining prefill takes at most this long at full width, together in
    shared calls (by warm-up's timed calls; agents' later turns: tool results on cached prefixes) prefill at once,
    beside decoding slots instead of in paced mixed pieces; their time is charged to the share, so decoders get it
    back from the longer prompts after them (0 = off).
    prefill_aging_s: waiting prompts run shortest remaining prefill first, a prompt's remaining tokens divided by
    1 + its seconds since submission / this; one waiting 3x this or longer runs before all others (nothing
    starves).
    share_min_tokens: a prompt admitted while another one prefills the same first (at least this many) tokens waits
    for that one's snapshot at the point they part, then restores it: a prefix common to many conversations is
    computed once (0 = off).
    call_log: keep the engine thread's last this many calls (prefill pieces, steps, restores, snapshots) with their
    times, for `Engine.calls` (strata_jax/engine/call_log.py; 0 = off; `bench --mode agents --trace`).
    """

    slots: int = 4
    max_context: int = 4096
    prefill_chunks: tuple[int, ...] = (32, 256)
    prefill_batch: int = 1
    prefix_cache_mib: int = 2048
    prefix_cache_device_mib: int = 0
    snapshot_every: int = 1024
    cache_dtype: str | None = None
    draft: str = "none"
    draft_k: int = 4
    adaptive_draft: bool = True
    overlap_steps: bool = True
    chain_windows: bool = True
    donate_counts: bool = True
    watchdog_s: float = 120.0
    progress_min_tokens: int = 4096
    progress_every_s: float = 2.0
    mixed_step_ms: float = 100.0
    mixed_prefill: tuple[int, int] | None = None
    decode_share: float = 0.7
    share_by_requests: bool = False
    prefill_burst_ms: float = 500.0
    prefill_aging_s: float = 5.0
    share_min_tokens: int = 1024
    call_log: int = 0

    def __post_init__(self):
        if self.slots < 1:
            raise ValueError("slots must be >= 1")
        if self.max_context < 2:
            raise ValueError("max_context must be >= 2")
        if self.cache_dtype == "bf16":
            object.__setattr__(self, "cache_dtype", "bfloat16")
        if self.cache_dtype not in CACHE_DTYPES:
            raise ValueError(f"cache_dtype must be one of {', '.join(map(str, CACHE_DTYPES[1:]))} (or bf16), got "
                             f"{self.cache_dtype!r}")
        if self.draft not in ("none", "ngram", "mtp"):
            raise ValueError(f"draft must be 'none', 'ngram' or 'mtp', got {self.draft!r}")
        most = MAX_DRAFT_K[self.draft]
        if not 1 <= self.draft_k <= most:
            raise ValueError(f"draft_k must be in 1..{most} for draft={self.draft!r}, got {self.draft_k}")
        if not self.watchdog_s >= 0:
            raise ValueError(f"watchdog_s must be >= 0 (0 = off), got {self.watchdog_s}")
        if self.progress_min_tokens < 1 or not self.progress_every_s >= 0:
            raise ValueError("progress_min_tokens must be >= 1 and progress_every_s >= 0")
        if not self.prefill_chunks or min(self.prefill_chunks) < 1:
            raise ValueError("prefill_chunks must be positive sizes")
        object.__setattr__(self, "prefill_chunks", tuple(sorted(set(self.prefill_chunks))))
        if self.prefill_batch < 1:
            raise ValueError(f"prefill_batch must be >= 1, got {self.prefill_batch}")
        if self.mixed_prefill is not None:
            width, prompts = self.mixed_prefill
            if width not in self.prefill_chunks or prompts not in self.prefill_batches:
                raise ValueError(f"mixed_prefill {self.mixed_prefill} must be a compiled (chunk, prompts) shape: "
                                 f"chunks {self.prefill_chunks}, prompts {self.prefill_batches}")
        if not 0 <= self.decode_share < 1 or not self.mixed_step_ms >= 0 or not self.prefill_aging_s > 0:
            raise ValueError("decode_share must be in [0, 1), mixed_step_ms >= 0 and prefill_aging_s > 0")
        if not self.prefill_burst_ms >= 0:
            raise ValueError(f"prefill_burst_ms must be >= 0 (0 = off), got {self.prefill_burst_ms}")
        if self.call_log < 0:
            raise ValueError(f"call_log must be >= 0 (0 = off), got {self.call_log}")
        if self.share_min_tokens < 0:
            raise ValueError(f"share_min_tokens must be >= 0, got {self.share_min_tokens}")
        big = self.prefill_chunks[-1]
        if self.snapshot_every % big:
            object.__setattr__(self, "snapshot_every", max(big, self.snapshot_every // big * big))

    @property
    def prefill_batches(self) -> tuple[int, ...]:
        """The prompt counts a prefill call is compiled for: powers of two up to `prefill_batch` and the slots."""
        most = min(self.prefill_batch, self.slots)
        return tuple(1 << i for i in range(most.bit_length()) if 1 << i <= most)

    @property
    def draft_ks(self) -> tuple[int, ...]:
        """The draft lengths a slot can take: powers of two below `draft_k` and `draft_k` itself with
        `adaptive_draft`, else `draft_k` alone (each is one compiled verify width)."""
        if not self.adaptive_draft:
            return (self.draft_k,)
        return tuple(sorted({1 << i for i in range(self.draft_k.bit_length()) if 1 << i < self.draft_k}
                            | {self.draft_k}))

    @property
    def verify_widths(self) -> tuple[int, ...]:
        """The verify windows compiled at warm-up (last token + drafts), narrowest first."""
        return tuple(k + 1 for k in self.draft_ks)

    @property
    def chunk(self) -> int:
        """The largest prefill chunk: the widest piece a prefill call takes."""
        return self.prefill_chunks[-1]
