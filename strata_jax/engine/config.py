"""Serving configuration, fixed at start: everything that decides compiled shapes lives here."""

from __future__ import annotations

import dataclasses

# `serve`'s context per slot when --ctx is not given (strata_jax.engine.planner.choose_context). Coding agents need
# long prompts from the first request (Claude Code's is 34,360 tokens with the demo's tokenizer, and grows).
AGENT_CONTEXT = 65_536  # the least the default aims for where it fits
CPU_CONTEXT = 65_536  # no device statistics to plan with; the demo's caches at 4 slots take 160 MiB
MAX_DEFAULT_CONTEXT = 262_144  # more only on request: prefill attention and its slot copy grow with it


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """slots: concurrent sequences decoded by one step. max_context: tokens per slot (prompt + output).
    prefill_chunks: prompt chunk sizes compiled at warm-up; the largest sets the grid prompts are cut on (and
    bounds how long a prefill chunk stalls running streams), smaller ones serve short remainders.
    prefill_batch: the most prompts prefilled together in one call (each its own chunk, one row of the call): up to
    this many prompts that need a chunk of the same size share a step, in power-of-two groups (each group size is
    compiled for each chunk size). 1 = one prompt per call.
    prefix_cache_mib: host memory for prefix-cache snapshots (0 disables it).
    snapshot_every: prompt tokens between prefix-cache snapshots during prefill (a multiple of the largest chunk).
    draft: speculative drafter for every slot: "none", "ngram" (prompt lookup) or "mtp" (the checkpoint's own MTP
    head, chained draft_k times inside each step); draft_k: tokens guessed per step. adaptive_draft: a request whose
    drafts miss 3 verify windows in a row decodes plainly for the next 8 steps (then drafts again).
    cache_dtype: dtype of KV and conv caches ("bfloat16" / "float32"; None = the model's dtype). Gated DeltaNet
    recurrent state is always float32.
    overlap_steps: while every running request just decodes (no drafter, no PLE layers, nothing to admit or
    prefill), launch step n+1 on step n's sampled tokens, still on the device, before reading them back: the host's
    per-step work (launch, read-back, stop checks, events) then overlaps the device's. A request that stops at step
    n has had one more token computed, which is discarded.
    watchdog_s: an engine iteration (one prefill chunk plus one step) running longer than this is taken as stuck:
    every request fails with a retryable error and `Engine.health()` turns false until the step returns (0 = off).
    progress_min_tokens: a prompt at least this long logs its prefill progress (logger "strata_jax.engine", INFO) at
    most every progress_every_s seconds, and one line when its first token is out (TTFT, prompt tok/s, cached).
    """

    slots: int = 4
    max_context: int = 4096
    prefill_chunks: tuple[int, ...] = (32, 256)
    prefill_batch: int = 1
    prefix_cache_mib: int = 2048
    snapshot_every: int = 1024
    cache_dtype: str | None = None
    draft: str = "none"
    draft_k: int = 4
    adaptive_draft: bool = True
    overlap_steps: bool = True
    watchdog_s: float = 120.0
    progress_min_tokens: int = 4096
    progress_every_s: float = 2.0

    def __post_init__(self):
        if self.slots < 1:
            raise ValueError("slots must be >= 1")
        if self.max_context < 2:
            raise ValueError("max_context must be >= 2")
        if self.cache_dtype not in (None, "bfloat16", "float32"):
            raise ValueError(f"cache_dtype must be bfloat16 or float32, got {self.cache_dtype!r}")
        if self.draft not in ("none", "ngram", "mtp"):
            raise ValueError(f"draft must be 'none', 'ngram' or 'mtp', got {self.draft!r}")
        if not 1 <= self.draft_k <= 15:
            raise ValueError(f"draft_k must be in 1..15, got {self.draft_k}")
        if not self.watchdog_s >= 0:
            raise ValueError(f"watchdog_s must be >= 0 (0 = off), got {self.watchdog_s}")
        if self.progress_min_tokens < 1 or not self.progress_every_s >= 0:
            raise ValueError("progress_min_tokens must be >= 1 and progress_every_s >= 0")
        if not self.prefill_chunks or min(self.prefill_chunks) < 1:
            raise ValueError("prefill_chunks must be positive sizes")
        object.__setattr__(self, "prefill_chunks", tuple(sorted(set(self.prefill_chunks))))
        if self.prefill_batch < 1:
            raise ValueError(f"prefill_batch must be >= 1, got {self.prefill_batch}")
        big = self.prefill_chunks[-1]
        if self.snapshot_every % big:
            object.__setattr__(self, "snapshot_every", max(big, self.snapshot_every // big * big))

    @property
    def prefill_batches(self) -> tuple[int, ...]:
        """The prompt counts a prefill call is compiled for: powers of two up to `prefill_batch` and the slots."""
        most = min(self.prefill_batch, self.slots)
        return tuple(1 << i for i in range(most.bit_length()) if 1 << i <= most)

    @property
    def chunk(self) -> int:
        """The largest prefill chunk: prompts are cut on multiples of it."""
        return self.prefill_chunks[-1]
