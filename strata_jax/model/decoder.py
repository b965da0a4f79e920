"""The decoder: embedding, the layer stack (Gated DeltaNet / gated attention + MoE, joined by hyper-connections or a
plain pre-norm residual), the final mixer or norm, the LM head and the MTP module.

All functions are pure with respect to the cache: `forward(tokens, cache, ...) -> (hidden, new_cache)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx, struct

from strata_jax.model.config import ExpertQuantization, ModelConfig
from strata_jax.model.attention import Attention
from strata_jax.model.cache import LayerCache, ModelCache, put_rows, take_rows
from strata_jax.model.deltanet import DeltaNetReplay, GatedDeltaNet, replay_deltanet
from strata_jax.model.hyper import HyperConnection, inject
from strata_jax.model.layers import MLP, Embedding, Linear, RMSNorm
from strata_jax.model.moe import HostExpertsFactory, SparseMoe
from strata_jax.model.ple import PleLayer, replay_ple


class DecoderLayer(nnx.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        index: int,
        dtype: jnp.dtype,
        linear: bool,
        has_ple: bool,
        quant: ExpertQuantization | None = None,
        host_experts: HostExpertsFactory | None = None,
    ):
        self.cfg = cfg
        self.linear = linear
        if linear:
            self.linear_attn = GatedDeltaNet(cfg, dtype)
        else:
            self.self_attn = Attention(cfg, dtype)
        self.sparse = index not in cfg.dense_mlp_layers
        if self.sparse:
            self.mlp = SparseMoe(cfg, dtype, quant, host_experts)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype)
        self.ple = PleLayer(cfg, dtype) if has_ple else None
        if cfg.hyper_connections:
            self.attn_hyper_connection = HyperConnection(cfg, dtype)
            self.mlp_hyper_connection = HyperConnection(cfg, dtype)
        else:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def _mix(self, x, cache: LayerCache, start, n_valid, with_replay):
        if self.linear:
            return self.linear_attn(x, cache.mixer, n_valid, with_replay)
        out, mixer_cache = self.self_attn(x, cache.mixer, start, n_valid)
        return out, mixer_cache, None

    def _mlp(self, x: jax.Array, real: jax.Array) -> jax.Array:
        return self.mlp(x, real) if self.sparse else self.mlp(x)

    def __call__(
        self,
        h: jax.Array,
        cache: LayerCache,
        start: jax.Array,
        n_valid: jax.Array,
        ple_rows: jax.Array | None,
        with_replay: bool = False,
        real: jax.Array | None = None,
    ) -> tuple[jax.Array, LayerCache, LayerReplay | None]:
        """`real` (bool [B, T], default from `n_valid`) marks the real tokens: padding and idle slots neither count
        as routing nor cost host expert work in the MoE. The caller computes it once for all layers."""
        # Named scopes label the compiled kernels (HLO op_name), so a profile can be read by component.
        if real is None:
            real = real_tokens(h.shape[1], n_valid)
        ple_cache = cache.ple
        ple_in = None
        if self.ple is not None:
            with jax.named_scope("ple"):
                h, ple_cache, ple_in = self.ple(h, ple_rows, cache.ple, n_valid)
        if self.cfg.hyper_connections:
            with jax.named_scope("hyper"):
                x, w, h = self.attn_hyper_connection(h)
            with jax.named_scope("mixer"):
                out, mixer_cache, replay = self._mix(x, cache, start, n_valid, with_replay)
            with jax.named_scope("hyper"):
                # The attention output's injection runs inside the MLP hyper-connection (one kernel less on a GPU).
                x, w, h = self.mlp_hyper_connection(h, pending=(out, w))
            with jax.named_scope("mlp"):
                y = self._mlp(x, real)
            with jax.named_scope("hyper"):
                h = inject(h, y, w)
        else:
            with jax.named_scope("mixer"):
                out, mixer_cache, replay = self._mix(self.input_layernorm(h), cache, start, n_valid, with_replay)
            h = h + out
            with jax.named_scope("mlp"):
                h = h + self._mlp(self.post_attention_layernorm(h), real)
        layer_replay = LayerReplay(mixer=replay, ple=ple_in) if with_replay else None
        return h, LayerCache(mixer=mixer_cache, ple=ple_cache), layer_replay


def real_tokens(width: int, n_valid: jax.Array) -> jax.Array:
    """bool [B, width]: the first n_valid[b] positions of each row."""
    return jnp.arange(width)[None, :] < n_valid[:, None]


@struct.dataclass
class LayerReplay:
    mixer: DeltaNetReplay | None
    ple: jax.Array | None


def rollback(before: ModelCache, after: ModelCache, replays: tuple[LayerReplay, ...], n_keep: jax.Array) -> ModelCache:
    """The cache as if, of the window a verify pass fed, only the first n_keep[b] tokens had been fed: attention
    keeps its KV (entries past the length are masked) and its QSA block keys (a block that a rejected token completed
    is incomplete again, never selected, and pooled anew when real tokens complete it), recurrent and conv state are
    rebuilt from the replay."""
    layers = []
    for b, a, r in zip(before.layers, after.layers, replays):
        mixer = replay_deltanet(b.mixer, r.mixer, n_keep) if r.mixer is not None else a.mixer
        ple = replay_ple(b.ple, r.ple, n_keep) if r.ple is not None else a.ple
        layers.append(LayerCache(mixer=mixer, ple=ple))
    return after.replace(layers=tuple(layers), lengths=before.lengths + n_keep)


class TextModel(nnx.Module):
    """The `model.*` (or `model.language_model.*`) part of a checkpoint."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, quant: ExpertQuantization | None = None,
                 host_experts: HostExpertsFactory | None = None):
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nnx.List(
            [
                DecoderLayer(cfg, i, dtype, cfg.layer_is_linear(i), i in cfg.ple_layers, quant, host_experts)
                for i in range(cfg.num_layers)
            ]
        )
        if cfg.hyper_connections:
            self.hyper_connection_mixer = HyperConnection(cfg, dtype, combine=False)
        else:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def __call__(
        self,
        tokens: jax.Array,
        cache: ModelCache,
        n_valid: jax.Array,
        ple_rows: tuple[jax.Array, ...] = (),
        with_replay: bool = False,
        cache_rows: jax.Array | None = None,
    ) -> tuple[jax.Array, ModelCache] | tuple[jax.Array, ModelCache, tuple[LayerReplay, ...]]:
        """tokens [B, T] (row b's first n_valid[b] are real) -> final hidden [B, T, H] and the advanced cache
        (+ per-layer replay inputs with `with_replay`, for `rollback`).

        `cache_rows` [B]: the cache has more rows than the batch and row b's state is its row cache_rows[b]; the
        other rows are left as they are (rows are written back in batch order: of two equal rows the later wins).
        Each layer reads its rows and writes them back before the next layer runs, so a donated cache is updated in
        place and only one layer's rows are ever copied (a copy of the rows' whole cache first would hold every
        layer's at once)."""
        cfg = self.cfg
        h = self.embed_tokens(tokens)
        if cfg.hyper_connections:
            h = jnp.tile(h, (1, 1, cfg.hc_count))
        start = cache.lengths if cache_rows is None else take_rows(cache.lengths, cache_rows)
        real = real_tokens(tokens.shape[1], n_valid)
        new_layers, replays = [], []
        for i, layer in enumerate(self.layers):
            rows = ple_rows[cfg.ple_layers.index(i)] if i in cfg.ple_layers else None
            layer_cache = cache.layers[i]
            if cache_rows is not None:
                # The barriers order the copies: this layer's rows are read once the previous layer is done and
                # written back before the next one starts (XLA would otherwise read every layer's rows first).
                h, layer_cache = jax.lax.optimization_barrier((h, layer_cache))
                layer_cache = take_rows(layer_cache, cache_rows)
            with jax.named_scope("linear_layer" if layer.linear else "attention_layer"):
                h, layer_cache, replay = layer(h, layer_cache, start, n_valid, rows, with_replay, real)
            if cache_rows is not None:
                h, layer_cache = jax.lax.optimization_barrier((h, put_rows(cache.layers[i], cache_rows, layer_cache)))
            new_layers.append(layer_cache)
            replays.append(replay)
        if cfg.hyper_connections:
            h, _, _ = self.hyper_connection_mixer(h)
        else:
            h = self.norm(h)
        lengths = start + n_valid if cache_rows is None else put_rows(cache.lengths, cache_rows, start + n_valid)
        new_cache = cache.replace(layers=tuple(new_layers), lengths=lengths)
        if with_replay:
            return h, new_cache, tuple(replays)
        return h, new_cache


class Mtp(nnx.Module):
    """Multi-token prediction: from the main model's final hidden state at position t and the embedding of token
    t+1, predict token t+2. Checkpoint names follow Qwen3-Next (`mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.norm`,
    `mtp.layers.0.*`: one attention decoder layer with its own KV cache). For hyper-connection models the fused
    input is copied into every stream and the streams are averaged after the layer (our convention: the reference
    implementation does not run an MTP head for qwen4_exp)."""

    def __init__(self, cfg: ModelConfig, dtype: jnp.dtype, quant: ExpertQuantization | None = None,
                 host_experts: HostExpertsFactory | None = None):
        self.cfg = cfg
        h = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps, dtype)
        self.fc = Linear(2 * h, h, dtype)
        self.layers = nnx.List([DecoderLayer(cfg, -1, dtype, linear=False, has_ple=False, quant=quant,
                                             host_experts=host_experts)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps, dtype)

    def __call__(
        self, embeds: jax.Array, hidden: jax.Array, cache: LayerCache, start: jax.Array, n_valid: jax.Array
    ) -> tuple[jax.Array, LayerCache]:
        x = jnp.concatenate([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1)
        x = self.fc(x)
        hc = self.cfg.hc_count if self.cfg.hyper_connections else 1
        x = jnp.tile(x, (1, 1, hc))
        x, cache, _ = self.layers[0](x, cache, start, n_valid, None)
        if hc > 1:
            x = jnp.mean(x.reshape(*x.shape[:-1], hc, -1), axis=-2)
        return self.norm(x), cache


class CausalLM(nnx.Module):
    """Text model + LM head (+ MTP when the checkpoint has `mtp.*` weights). With `quant`, routed experts are
    packed sign bit-planes instead of dense weights; with a device pool smaller than the experts
    (`quant.gpu_experts`), `host_experts` builds each MoE layer's host compute for the others."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: jnp.dtype,
        with_mtp: bool = False,
        quant: ExpertQuantization | None = None,
        host_experts: HostExpertsFactory | None = None,
    ):
        self.cfg = cfg
        self.model = TextModel(cfg, dtype, quant, host_experts)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype)
        self.mtp = Mtp(cfg, dtype, quant, host_experts) if with_mtp else None

    def logits(self, hidden: jax.Array) -> jax.Array:
        """Final hidden [.., H] -> float32 logits [.., V]."""
        if self.cfg.tie_word_embeddings:
            w = self.model.embed_tokens.weight[...]
        else:
            w = self.lm_head.weight[...]
        return jnp.einsum("...h,vh->...v", hidden.astype(w.dtype), w).astype(jnp.float32)

    def __call__(self, tokens, cache, n_valid, ple_rows=()):
        hidden, cache = self.model(tokens, cache, n_valid, ple_rows)
        return self.logits(hidden), hidden, cache

    def verify(self, tokens, cache, n_valid, ple_rows=()):
        """Like __call__, plus the replay inputs `rollback` needs to keep only an accepted prefix."""
        hidden, after, replays = self.model(tokens, cache, n_valid, ple_rows, with_replay=True)
        return self.logits(hidden), hidden, after, replays

    def mtp_forward(
        self, next_tokens: jax.Array, hidden: jax.Array, cache: ModelCache, n_valid: jax.Array
    ) -> tuple[jax.Array, jax.Array, ModelCache]:
        """MTP logits [B, T, V] (and the MTP's own output hidden, for chaining) for positions whose main-model
        hidden states are `hidden` [B, T, H] and whose following tokens are `next_tokens` [B, T]. Uses and advances
        `cache.mtp`: MTP position m holds the pair (hidden of token m, token m+1)."""
        if self.mtp is None:
            raise ValueError("this checkpoint has no MTP weights")
        embeds = self.model.embed_tokens(next_tokens)
        out, mtp_cache = self.mtp(embeds, hidden, cache.mtp, cache.mtp_lengths, n_valid)
        return self.logits(out), out, cache.replace(mtp=mtp_cache, mtp_lengths=cache.mtp_lengths + n_valid)

    def mtp_logits(
        self, next_tokens: jax.Array, hidden: jax.Array, cache: ModelCache, n_valid: jax.Array
    ) -> tuple[jax.Array, ModelCache]:
        """`mtp_forward` without the MTP hidden."""
        logits, _, cache = self.mtp_forward(next_tokens, hidden, cache, n_valid)
        return logits, cache

    def mtp_drafts(
        self, hidden: jax.Array, next_tokens: jax.Array, cache: ModelCache, n_valid: jax.Array, k: int
    ) -> tuple[jax.Array, ModelCache]:
        """Enters the pairs of a step the main model just ran (hidden [B, T, H] of its first n_valid[b] tokens and
        the tokens that followed each) into the MTP cache, then chains the MTP head k times from the last pair:
        returns k greedy guesses [B, k] of the tokens after next_tokens[n_valid-1]. The chained pairs are not kept
        (their cache entries lie past `mtp_lengths`)."""
        logits, out, cache = self.mtp_forward(next_tokens, hidden, cache, n_valid)
        caught_up = cache.mtp_lengths
        last = jnp.maximum(n_valid - 1, 0)[:, None, None]
        guess = jnp.argmax(jnp.take_along_axis(logits, last, axis=1)[:, 0], axis=-1).astype(jnp.int32)
        h = jnp.take_along_axis(out, last, axis=1)
        drafts = [guess]
        one = (n_valid > 0).astype(jnp.int32)
        for _ in range(k - 1):
            logits, h, cache = self.mtp_forward(drafts[-1][:, None], h, cache, one)
            drafts.append(jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32))
        return jnp.stack(drafts, axis=1), cache.replace(mtp_lengths=caught_up)


def enable_fused_decode(model: nnx.Module) -> int:
    """Switches `model` to the fused decode kernels (docs/PERF.md, "Fused decode kernels"): for calls of at most 16
    tokens (decode, verify windows), every MoE block's router (`pallas_kernels.fused_router`) and shared expert (two
    `pallas_kernels.fused_matvec`s), and every Gated DeltaNet's conv + delta rule (`gated_delta_conv_decode`), run
    as Pallas kernels on a GPU and as the XLA path elsewhere. Results equal the XLA path up to the order of float32
    sums. Off by default: 1.25x slower in the decode step on an H100 (docs/PERF.md). Call it before the model is
    split (the switch is part of the graph). Returns how many modules were switched."""
    modules = [node for _, node in nnx.iter_graph(model) if isinstance(node, (SparseMoe, GatedDeltaNet))]
    for module in modules:
        module.fused_decode = True
    return len(modules)
