"""Llama-3.x / Qwen2 / Qwen3 decoder in plain PyTorch, reading and writing a slot-based KV cache.

Weight names follow Hugging Face (`model.layers.N.self_attn.q_proj.weight`, ...), so a Hugging Face
state dict loads directly and GGUF tensors are renamed to it by the loader.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ssd.kernels import cpu as cpu_kernels
from ssd.workers.models.config import ModelConfig
from ssd.workers.models.fused import FusedLayers
from ssd.workers.models.fused import signature as fused_signature
from ssd.workers.models.fused import why_not as fused_why_not


class RMSNorm(nn.Module):
    # Set by quantize_model for the block-quantised CPU modes: one C call (ssd.kernels.cpu.rmsnorm,
    # same formula, row-independent) instead of ~8 small torch ops.
    use_cpu_kernel = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use_cpu_kernel and x.dtype == self.weight.dtype and x.dtype in (torch.float32, torch.bfloat16):
            # Always this path, whatever the layout: Qwen3's q/k norms get strided views for a block of tokens
            # but contiguous ones for a single token, and the torch formula below rounds differently.
            return cpu_kernels.rmsnorm(x.contiguous(), self.weight, self.eps)
        # Normalise in fp32 (as the reference implementations do), scale in the model dtype.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with llama3-style scaling when the config asks for it."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rs = cfg.rope_scaling or {}
    rope_type = rs.get("rope_type", rs.get("type", "default"))
    if rope_type == "llama3":
        factor = rs["factor"]
        low_freq_factor = rs.get("low_freq_factor", 1.0)
        high_freq_factor = rs.get("high_freq_factor", 4.0)
        old_ctx = rs.get("original_max_position_embeddings", 8192)
        low_freq_wavelen = old_ctx / low_freq_factor
        high_freq_wavelen = old_ctx / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif rope_type == "linear":
        inv_freq = inv_freq / rs["factor"]
    elif rope_type not in ("default",):
        raise ValueError(f"unsupported rope_scaling type {rope_type!r}")
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        d, hd = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(d, self.n_heads * hd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(d, self.n_kv * hd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(d, self.n_kv * hd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps) if cfg.qk_norm else None
        # quant.fuse_projections may replace q/k/v_proj by one layer (one matmul per step, not three).
        self.qkv_proj: nn.Module | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVView) -> torch.Tensor:
        B, n, _ = x.shape  # x: [B, n, D]
        H, Hkv, hd = self.n_heads, self.n_kv, self.head_dim
        # Heads stay in the [B, n, heads, hd] layout of the projections (RoPE is elementwise, so the
        # layout changes no value); cos/sin [B, 1, n, hd] are viewed as [B, n, 1, hd].
        cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)
        if self.qkv_proj is not None and self.q_norm is None:
            qkv = self.qkv_proj(x)  # one matmul; q and k adjacent, so one RoPE for both
            qk = qkv[..., : (H + Hkv) * hd].view(B, n, H + Hkv, hd)
            qk = qk * cos + rotate_half(qk) * sin
            q, k = qk[:, :, :H], qk[:, :, H:]
            v = qkv[..., (H + Hkv) * hd :].view(B, n, Hkv, hd)
        else:
            if self.qkv_proj is not None:
                q, k, v = self.qkv_proj(x).split((H * hd, Hkv * hd, Hkv * hd), dim=-1)
            else:
                q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            q, k, v = q.view(B, n, H, hd), k.view(B, n, Hkv, hd), v.view(B, n, Hkv, hd)
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        keys, values = kv.write_and_read(k.transpose(1, 2), v.transpose(1, 2))
        if kv.rows is not None:  # keys/values: this layer's whole cache [S, Hkv, max_len, hd]
            return self.o_proj(self._attend_rows(q, keys, values, kv.rows, kv.row_plan, kv.write_src))
        out = F.scaled_dot_product_attention(  # keys/values [B, Hkv, Lmax, hd]
            q.transpose(1, 2), keys, values, attn_mask=kv.mask, enable_gqa=H != Hkv
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, n, H * hd))

    def _attend_rows(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: list[tuple[int, int, int, Any]],
        plan: cpu_kernels.RowPlan | None = None, src: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention one new token at a time, each over exactly the keys it may see, with no mask.

        A token's output then depends only on its own query and keys: the same call (same shapes,
        same strides) whether it is decoded alone or scored among K+1 tokens, so it gets the same
        bits. The query heads sharing a KV head are the rows of one SDPA problem. q: [B, n, H, hd].
        With `plan` (CPU, bf16/fp32, kernel built) every token goes through `ssd.kernels.cpu.attend_rows`
        in one call instead: the same per-token independence, far less per-call overhead.
        """
        B, n, H, hd = q.shape
        if plan is not None:  # the C kernel: all tokens in one call, same per-token math
            q_rows = q.reshape(B * n, H, hd)
            if len(rows) == B * n:
                return cpu_kernels.attend_rows(q_rows, k_cache, v_cache, plan).view(B, n, H * hd)
            assert src is not None  # rows are in write_src order: their flat [B * n] indices
            out = q.new_zeros(B * n, H * hd)
            out[src] = cpu_kernels.attend_rows(q_rows[src], k_cache, v_cache, plan).view(len(rows), H * hd)
            return out.view(B, n, H * hd)
        out = q.new_zeros(B, n, H * hd) if len(rows) < B * n else q.new_empty(B, n, H * hd)
        group = H // self.n_kv
        for b, i, slot, sel in rows:
            qr = q[b, i].reshape(1, self.n_kv, group, hd)
            if isinstance(sel, int):  # cache positions 0..sel-1 of the slot: a view, no copy
                kr, vr = k_cache[slot : slot + 1, :, :sel], v_cache[slot : slot + 1, :, :sel]
            else:  # tree: the prefix and this node's ancestors, gathered
                kr, vr = k_cache[slot : slot + 1, :, sel], v_cache[slot : slot + 1, :, sel]
            out[b, i] = F.scaled_dot_product_attention(qr, kr, vr).view(H * hd)
        return out


class MLP(nn.Module):
    # Set with RMSNorm's: SiLU(gate) * up in one C call (ssd.kernels.cpu.silu_mul), the code the fused
    # layers run, so the torch path and the fused path give the same bits.
    use_cpu_kernel = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate and up in one layer (quant.fuse_projections)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            if self.use_cpu_kernel and gate_up.dtype in (torch.float32, torch.bfloat16):
                return self.down_proj(cpu_kernels.silu_mul(gate_up.contiguous()))
            gate, up = gate_up.chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVView) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class KVView:
    """What one forward needs from the KV cache, per layer: where to write the new keys and what to attend.

    Built by the model runner; `layer` is advanced by the model as it walks its layers.
    """

    def __init__(
        self,
        k_cache: torch.Tensor,  # [L, S, Hkv, max_len, hd]
        v_cache: torch.Tensor,
        slot_index: torch.Tensor | slice,  # rows of the cache used by this batch
        write_b: torch.Tensor,  # [T] batch row of each valid new token
        write_slot: torch.Tensor,  # [T] cache slot of each valid new token
        write_pos: torch.Tensor,  # [T] cache position of each valid new token
        write_src: torch.Tensor,  # [T] flat index into [B * n] of each valid new token
        read_len: int,  # Lmax: positions attended (max over the batch of len + n)
        mask: torch.Tensor | None,  # [B, 1, n, Lmax] bool, True = may attend (None: set_rows plans instead)
        rope_len: int | None = None,  # > every position (known on the host: saves a device sync)
    ) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache
        self.slot_index = slot_index
        self.write_slot, self.write_pos, self.write_src = write_slot, write_pos, write_src
        self.write_b = write_b
        self.read_len = read_len
        self.mask = mask
        self.rope_len = rope_len
        self.layer = 0
        # Set by set_rows or plan_rows (DecoderModel.batch_invariant): per new token (b, i, cache slot, keys),
        # keys = L for cache positions 0..L-1 or a LongTensor of positions; attention then runs
        # token by token straight on the cache (write_and_read returns the layer's whole cache).
        self.rows: list[tuple[int, int, int, Any]] | None = None
        self.row_plan: cpu_kernels.RowPlan | None = None  # `rows` for the C attention kernel, when usable

    def plan_rows(self) -> None:
        """Derive each valid new token's attended cache positions from the mask (once per forward). The
        ModelRunner plans from the tree structure instead (ModelRunner._rows); this is the reference."""
        if self.mask is None:
            raise ValueError("plan_rows needs the attention mask")
        m = self.mask[:, 0]  # [B, n, L]
        B, n, L = m.shape
        if isinstance(self.slot_index, slice):
            slots = list(range(self.slot_index.start, self.slot_index.start + B))
        else:
            slots = self.slot_index.tolist()
        if B == 1 and n == 1 and bool(m.all()):  # plain decode: attends the whole prefix
            self.set_rows([(0, 0, slots[0], L)])
            return
        cnt = m.sum(-1)  # [B, n]
        prefix = (m == (torch.arange(L, device=m.device) < cnt[..., None])).all(-1)  # attends 0..cnt-1
        cnt_l, prefix_l = cnt.tolist(), prefix.tolist()
        rows: list[tuple[int, int, int, Any]] = []
        for f in self.write_src.tolist():
            b, i = divmod(f, n)
            rows.append((b, i, slots[b], cnt_l[b][i] if prefix_l[b][i] else m[b, i].nonzero().squeeze(1)))
        self.set_rows(rows)

    def set_rows(self, rows: list[tuple[int, int, int, Any]]) -> None:
        """Attend token by token: `rows` as described in __init__, one per valid new token, in write order."""
        self.rows = rows
        kc = self.k_cache
        if kc.device.type == "cpu" and kc.dtype in (torch.float32, torch.bfloat16) and cpu_kernels.available():
            self.row_plan = cpu_kernels.RowPlan.from_rows(rows)

    def write_and_read(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys/values [B, Hkv, n, hd]; return what to attend: [B, Hkv, Lmax, hd], or the
        layer's whole cache [S, Hkv, max_len, hd] when `rows` is set (attention indexes it per token)."""
        B, Hkv, n, hd = k.shape
        kc, vc = self.k_cache[self.layer], self.v_cache[self.layer]  # [S, Hkv, max_len, hd]
        k_flat = k.transpose(1, 2).reshape(B * n, Hkv, hd)  # [B * n, Hkv, hd]
        v_flat = v.transpose(1, 2).reshape(B * n, Hkv, hd)
        if self.write_src.numel() != B * n:  # padding rows: keep the valid tokens only
            k_flat, v_flat = k_flat[self.write_src], v_flat[self.write_src]  # [T, Hkv, hd]
        kc[self.write_slot, :, self.write_pos] = k_flat
        vc[self.write_slot, :, self.write_pos] = v_flat
        if self.rows is not None:
            return kc, vc
        if isinstance(self.slot_index, slice):
            keys = kc[self.slot_index, :, : self.read_len]  # a view, no copy
            values = vc[self.slot_index, :, : self.read_len]
        else:
            keys = kc[self.slot_index, :, : self.read_len]
            values = vc[self.slot_index, :, : self.read_len]
        return keys, values


class DecoderModel(nn.Module):
    """Decoder-only transformer. `forward` returns final hidden states; `logits` applies the LM head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._rope_table: tuple[tuple, torch.Tensor, torch.Tensor] | None = None
        self._fused: FusedLayers | None = None
        self._fused_refused: tuple | None = None

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001 - nn.Module's signature
        """`.to(bfloat16)` and the like: the RoPE frequencies stay fp32 (rounded to bf16 they would put
        positions ~1000 off by a whole radian), on the device the weights went to."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32:
            self.inv_freq = rope_inv_freq(self.config).to(self.inv_freq.device)
        return self

    # Batch-invariant numerics: when True (set by quantize_model once every linear layer runs a
    # row-independent kernel), every forward runs attention token by token (Attention._attend_rows),
    # so a token gets the same bits whichever tokens share its forward: scoring K+1 tokens in one pass
    # equals decoding them one by one, and a prompt prefilled in pieces (the split prefill on borrowed
    # cores) equals the prompt prefilled whole. Prefill included: a masked SDPA over a whole prompt
    # gives its tokens other bits than the same tokens fed in pieces.
    batch_invariant = False
    # On the row path, run every layer in one C call when the model allows it (workers/models/fused.py).
    use_fused_layers = True

    def rope_tables(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin tables [>= length, hd] in `dtype`, grown in fixed chunks of positions.

        Each chunk is always computed with the same shapes, so a position's values never depend on
        which positions were asked for together (elementwise cos/sin may take a scalar or a
        vector path depending on the tensor's size).
        """
        chunk = 256
        key = (dtype, self.inv_freq.device, self.inv_freq.data_ptr())
        have = self._rope_table if self._rope_table is not None and self._rope_table[0] == key else None
        cur = 0 if have is None else have[1].shape[0]
        if cur >= length:
            return have[1], have[2]  # type: ignore[index]
        new_len = max(length, 2 * cur)
        new_len = -(-new_len // chunk) * chunk
        inv = self.inv_freq.float()
        cos_parts, sin_parts = ([have[1]], [have[2]]) if have is not None else ([], [])
        for s in range(cur, new_len, chunk):
            pos = torch.arange(s, s + chunk, device=inv.device, dtype=torch.float32)
            freqs = pos[:, None] * inv[None]  # [chunk, hd/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [chunk, hd]
            cos_parts.append(emb.cos().to(dtype))
            sin_parts.append(emb.sin().to(dtype))
        self._rope_table = (key, torch.cat(cos_parts), torch.cat(sin_parts))
        return self._rope_table[1], self._rope_table[2]

    def rope(
        self, positions: torch.Tensor, dtype: torch.dtype, length: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, 1, n, hd] at `positions`; `length` (> every position) saves reading them back."""
        cos_t, sin_t = self.rope_tables(length or int(positions.max()) + 1, dtype)
        return F.embedding(positions, cos_t)[:, None], F.embedding(positions, sin_t)[:, None]  # [B, 1, n, hd]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVView) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [B, n, D]
        if self.batch_invariant and kv.rows is None:
            kv.plan_rows()
        if kv.row_plan is not None and self.use_fused_layers:
            fused = self.fused_layers(kv.k_cache, kv.v_cache)
            if fused is not None:
                return self.norm(self._forward_fused(fused, x, positions, kv))
        cos, sin = self.rope(positions, x.dtype, kv.rope_len)
        for i, layer in enumerate(self.layers):
            kv.layer = i
            x = layer(x, cos, sin, kv)
        return self.norm(x)

    def fused_layers(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> FusedLayers | None:
        """The C descriptors of this model's layers for these caches, (re)built when needed; None when
        the model cannot run them (a refusal is remembered: later forwards only compare the signature)."""
        f = self._fused
        if f is not None and f.matches(self, k_cache, v_cache):
            return f
        self._fused = None
        key = fused_signature(self, k_cache, v_cache)
        if self._fused_refused == key:  # checked before, nothing changed since
            return None
        if fused_why_not(self, k_cache, v_cache) is not None:
            self._fused_refused = key
            return None
        self._fused = FusedLayers(self, k_cache, v_cache)
        return self._fused

    def _forward_fused(self, fused: FusedLayers, x: torch.Tensor, positions: torch.Tensor, kv: KVView) -> torch.Tensor:
        """x [B, n, D] embeddings -> final-layer hidden states [B, n, D] (padding rows stay zero)."""
        B, n, D = x.shape
        src = kv.write_src  # valid tokens, in the order of kv.row_plan
        cos_t, sin_t = self.rope_tables(kv.rope_len or int(positions.max()) + 1, x.dtype)
        pos = positions.reshape(-1)[src]
        rows = x.reshape(B * n, D)[src]  # [T, D], a copy the C code updates in place
        rows = fused.run(rows, cos_t[pos], sin_t[pos], kv.write_slot, kv.write_pos, kv.row_plan)
        if src.numel() == B * n:
            return rows.view(B, n, D)
        out = x.new_zeros(B * n, D)
        out[src] = rows
        return out.view(B, n, D)

    def logits(self, hidden: torch.Tensor, full_vocab: bool = False, compact: bool = False) -> torch.Tensor:
        """full_vocab: the whole vocabulary's logits even when the output layer is restricted (SubsetHead);
        compact: a restricted layer's logits on its own columns only (SubsetHead.compact)."""
        if compact and hasattr(self.lm_head, "compact"):
            return self.lm_head.compact(hidden)
        head = self.lm_head.full if full_vocab and hasattr(self.lm_head, "full") else self.lm_head
        return head(hidden).float()
