"""DFlash drafter exported by dflash-supervise, for transformers (4.5x and 5.x).

This file is written into every export directory by dflash-supervise; config.json's
``auto_map`` points transformers at it, so the drafter loads with

    import torch
    from transformers import AutoModel
    drafter = AutoModel.from_pretrained(EXPORT_DIR, trust_remote_code=True, dtype=torch.bfloat16)

(``torch_dtype=`` on transformers older than 4.56). Every layer is plain torch: no
attention backend, kernel or transformers-internal helper is needed.

Architecture (the same computation as the Rust trainer):

    ctx = hidden_norm(fc(target_hidden))              # [B, S, H], once per call
    h   = noise_embedding                              # [B, M, H]
    per layer:
        x = input_layernorm(h)
        Q = q_norm(q_proj(x))                          # per head, RoPE at the block positions
        K = k_norm(k_proj([ctx ; x]))                  # RoPE at [context ; block] positions
        V = v_proj([ctx ; x])
        h = h + o_proj(softmax(Q Kᵀ/√d + mask) V)      # GQA, non-causal, a fully masked row gives 0
        h = h + down_proj(silu(gate_proj(y)) * up_proj(y)),  y = post_attention_layernorm(h)
    return norm(h)                                     # logits = target lm_head(norm(h))

Forward signature (keyword names as in z-lab's DFlashDraftModel, so inference loops
written for it can call this class)::

    drafter(
        position_ids,            # LongTensor [B, S + M]: positions of the S context tokens,
                                 #   then of the M block tokens (a block at anchor a: a .. a+bs-1)
        attention_mask=None,     # bool [B|1, 1|heads, M, S + M] (True = may attend), or an
                                 #   additive float mask of that shape, or [B, S + M] key padding;
                                 #   None: every block token sees every key (inference: one block)
        noise_embedding=None,    # [B, M, H] the target's input embeddings of the block tokens
                                 #   ([token at anchor, MASK x (bs - 1)] per block)
        target_hidden=None,      # [B, S, L*H] the target's tapped hidden states, concatenated
        past_key_values=None,    # optional transformers Cache (e.g. DynamicCache): the new
                                 #   keys/values are appended and attention runs over all of them
        use_cache=False,
        anchors=None,            # LongTensor [B, N]: training layout (M = N * block_size);
                                 #   builds DFlash's mask when attention_mask is None (block n
                                 #   sees context keys < anchors[n] and its own block), and the
                                 #   positions when position_ids is None
        block_keep=None,         # bool [B, N]: blocks to keep with `anchors` (default all)
    ) -> Tensor [B, M, H]        # final-normed hidden states

``compute_logits(hidden, lm_head)`` applies the target's output head.

``spec_generate`` decodes with a transformers target, with z-lab's calling convention::

    target = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.bfloat16)
    out = drafter.spec_generate(input_ids=ids, max_new_tokens=256, temperature=0.0,
                                target=target, stop_token_ids=[tokenizer.eos_token_id])
    # out: LongTensor [1, prompt + new tokens], the prompt first, the stop token included

Greedy speculative decoding, lossless: the tokens are ``target.generate(do_sample=False)``'s.
Batch size 1; ``temperature > 0`` is refused (ValueError).

Attributes
``target_layer_ids``, ``block_size`` and ``mask_token_id`` come from config.json's
``dflash_config``. ``dflash_attention_mask(anchors, context_len, block_size, block_keep)``
is the training mask as a function.

Rotary embeddings follow config.json's ``rope_theta`` and ``rope_scaling`` (or
transformers 5's ``rope_parameters``): types ``default``, ``linear``, ``llama3`` and ``yarn`` (whose
``attention_factor`` scales cos and sin, as in transformers).
"""

import inspect
import math
from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel

try:
    from transformers import Qwen3Config
except ImportError:  # pragma: no cover - very old transformers
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_settings(config):
    """(theta, scaling dict or None) from a config in either transformers layout."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get("full_attention"), dict):
        params = params["full_attention"]
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        theta = float(params["rope_theta"])
        scaling = params
    else:
        theta = float(getattr(config, "rope_theta", None) or 10000.0)
        scaling = getattr(config, "rope_scaling", None)
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope type {kind!r} is not supported by this drafter (expected one of {SUPPORTED_ROPE_TYPES})")
        elif kind == "yarn" and scaling.get("original_max_position_embeddings") is None:
            scaling = dict(scaling, original_max_position_embeddings=getattr(config, "max_position_embeddings", None))
    return theta, scaling


def rope_attention_factor(scaling):
    """What cos and sin are multiplied by: YaRN's attention factor (as given, else from
    factor, mscale and mscale_all_dim as transformers derives it), 1 otherwise."""
    if scaling is None or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor"):
        return float(scaling["attention_factor"])

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = float(scaling["factor"])
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, float(m)) / mscale(factor, float(m_all))
    return mscale(factor)


def rope_inv_freq(head_dim, theta, scaling=None):
    """Inverse rotary frequencies (float64), with linear, Llama 3 or YaRN scaling."""
    kind = None if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if kind == "yarn":
        # Dimensions below `low` keep their frequency, above `high` are interpolated
        # (divided by factor), a linear ramp in between.
        def correction(rotations):
            orig = float(scaling["original_max_position_embeddings"])
            return head_dim * math.log(orig / (rotations * 2.0 * math.pi)) / (2.0 * math.log(theta))

        low = correction(float(scaling.get("beta_fast") or 32.0))
        high = correction(float(scaling.get("beta_slow") or 1.0))
        if scaling.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0.0), min(high, head_dim - 1.0)
        if low == high:
            high += 0.001
    out = []
    for i in range(head_dim // 2):
        f = 1.0 / theta ** (2.0 * i / head_dim)
        if kind == "linear":
            f = f / float(scaling["factor"])
        elif kind == "llama3":
            factor = float(scaling["factor"])
            low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
            orig = float(scaling["original_max_position_embeddings"])
            wavelen = 2.0 * math.pi / f
            if wavelen > orig / low:
                f = f / factor
            elif wavelen >= orig / high:
                smooth = (orig / wavelen - low) / (high - low)
                f = (1.0 - smooth) * f / factor + smooth * f
        elif kind == "yarn":
            keep = 1.0 - min(max((i - low) / (high - low), 0.0), 1.0)
            f = f / float(scaling["factor"]) * (1.0 - keep) + f * keep
        out.append(f)
    return torch.tensor(out, dtype=torch.float64)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def dflash_attention_mask(anchors, context_len, block_size, block_keep=None):
    """DFlash's training mask, bool [B, 1, N*bs, S + N*bs]: block n's tokens see the
    context keys strictly before anchors[n] and the tokens of block n (both ways)."""
    anchors = torch.as_tensor(anchors)
    b, n = anchors.shape
    m = n * block_size
    device = anchors.device
    q_block = torch.arange(m, device=device) // block_size  # [M]
    kv = torch.arange(context_len + m, device=device)  # [S+M]
    anchor_of_q = anchors[:, q_block]  # [B, M]
    ctx_ok = (kv[None, None, :] < context_len) & (kv[None, None, :] < anchor_of_q[:, :, None])
    kv_block = torch.where(kv >= context_len, (kv - context_len) // block_size, torch.full_like(kv, -1))
    blk_ok = kv_block[None, None, :] == q_block[None, :, None]
    allowed = ctx_ok | blk_ok
    if block_keep is not None:
        keep = torch.as_tensor(block_keep, device=device).bool()[:, q_block]  # [B, M]
        allowed = allowed & keep[:, :, None]
    return allowed[:, None, :, :]


def dflash_position_ids(anchors, context_len, block_size):
    """Positions [B, S + N*bs]: 0..S-1 for the context, anchors[n] + k for block slot k."""
    anchors = torch.as_tensor(anchors)
    b = anchors.shape[0]
    ctx = torch.arange(context_len, device=anchors.device).expand(b, context_len)
    blk = (anchors[:, :, None] + torch.arange(block_size, device=anchors.device)).reshape(b, -1)
    return torch.cat([ctx, blk], dim=1)


class DFlashRMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class DFlashMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _head_dim(config):
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class DFlashAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = _head_dim(config)
        self.n_heads = config.num_attention_heads
        self.n_kv = config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, ctx, cos, sin, mask, past_key_values=None):
        b, m, _ = x.shape
        s = ctx.shape[1]
        hd = self.head_dim
        q = self.q_norm(self.q_proj(x).view(b, m, self.n_heads, hd)).transpose(1, 2)
        k = torch.cat([self.k_proj(ctx), self.k_proj(x)], dim=1).view(b, s + m, self.n_kv, hd)
        v = torch.cat([self.v_proj(ctx), self.v_proj(x)], dim=1).view(b, s + m, self.n_kv, hd)
        k = self.k_norm(k).transpose(1, 2)
        v = v.transpose(1, 2)
        # cos/sin: [B, 1, S+M, hd]; queries use the block positions (the last M).
        q = q * cos[:, :, -m:] + rotate_half(q) * sin[:, :, -m:]
        k = k * cos + rotate_half(k) * sin
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        groups = self.n_heads // self.n_kv
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * (hd ** -0.5)
        if mask is not None:
            if mask.shape[-1] != scores.shape[-1]:
                raise ValueError(f"attention_mask covers {mask.shape[-1]} keys, the layer has {scores.shape[-1]}")
            scores = scores.masked_fill(~mask, float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1)
            # A query that may see no key outputs 0 (softmax of all -inf is NaN).
            probs = torch.where(mask.any(-1, keepdim=True), probs, torch.zeros_like(probs)).to(v.dtype)
        else:
            probs = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, m, self.n_heads * hd)
        return self.o_proj(out)


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, ctx, cos, sin, mask, past_key_values=None):
        h = h + self.self_attn(self.input_layernorm(h), ctx, cos, sin, mask, past_key_values)
        return h + self.mlp(self.post_attention_layernorm(h))


def _as_bool_mask(mask):
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        out = mask
    elif mask.is_floating_point():
        # Additive: 0 allowed, a large negative number (or -inf) forbidden.
        out = mask > torch.finfo(mask.dtype).min / 2
    else:
        out = mask != 0
    if out.dim() == 2:  # [B, keys] key padding
        out = out[:, None, None, :]
    elif out.dim() == 3:  # [B, queries, keys]
        out = out[:, None]
    if out.dim() != 4:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}; expected [B, 1|heads, M, keys], [B, M, keys] or [B, keys]")
    return out


class DFlashDraftModel(PreTrainedModel):
    """The DFlash drafter (see the module docstring for the forward signature)."""

    config_class = Qwen3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config):
        super().__init__(config)
        dflash = getattr(config, "dflash_config", None) or {}
        self.target_layer_ids = list(dflash.get("target_layer_ids") or [])
        if not self.target_layer_ids:
            raise ValueError("config.json has no dflash_config.target_layer_ids: not a DFlash drafter export")
        self.mask_token_id = dflash.get("mask_token_id")
        self.block_size = int(getattr(config, "block_size", None) or dflash.get("block_size") or 16)
        h = config.hidden_size
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = DFlashRMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = DFlashRMSNorm(h, config.rms_norm_eps)
        # Validated now, computed on first use: not a buffer, so there is nothing to load,
        # and nothing transformers builds on its "meta" device and initialises.
        self._rope = rope_settings(config)
        self._attention_factor = rope_attention_factor(self._rope[1])
        self._inv_freq = None
        self.post_init()

    def rotary(self, position_ids, dtype):
        """cos, sin [B, 1, T, head_dim] at `position_ids` [B, T]: angles in float32."""
        if self._inv_freq is None or self._inv_freq.device != position_ids.device:
            inv = rope_inv_freq(_head_dim(self.config), *self._rope).to(torch.float32)
            self._inv_freq = inv.to(position_ids.device)
        inv = self._inv_freq
        angles = position_ids.to(torch.float32)[..., None] * inv
        emb = torch.cat([angles, angles], dim=-1)[:, None]
        af = self._attention_factor
        return (emb.cos() * af).to(dtype), (emb.sin() * af).to(dtype)

    def forward(
        self,
        position_ids=None,
        attention_mask=None,
        noise_embedding=None,
        target_hidden=None,
        past_key_values=None,
        use_cache=False,
        anchors=None,
        block_keep=None,
        **kwargs,
    ):
        if noise_embedding is None or target_hidden is None:
            raise ValueError("noise_embedding [B, M, H] and target_hidden [B, S, L*H] are required")
        s = target_hidden.shape[1]
        if attention_mask is None and anchors is not None:
            attention_mask = dflash_attention_mask(anchors, s, self.block_size, block_keep).to(noise_embedding.device)
        if position_ids is None:
            if anchors is None:
                raise ValueError("position_ids is required (or anchors, to derive them)")
            position_ids = dflash_position_ids(anchors, s, self.block_size).to(noise_embedding.device)
        if position_ids.dim() == 1:
            position_ids = position_ids[None].expand(noise_embedding.shape[0], -1)
        if position_ids.shape[-1] != s + noise_embedding.shape[1]:
            raise ValueError(
                f"position_ids cover {position_ids.shape[-1]} tokens, expected context {s} + block {noise_embedding.shape[1]}"
            )
        mask = _as_bool_mask(attention_mask)
        if mask is not None:
            mask = mask.to(noise_embedding.device)
        ctx = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))
        h = noise_embedding.to(self.fc.weight.dtype)
        cos, sin = self.rotary(position_ids, h.dtype)
        for layer in self.layers:
            h = layer(h, ctx, cos, sin, mask, past_key_values)
        return self.norm(h)

    def compute_logits(self, hidden, output_head):
        return output_head(hidden)

    def target_taps(self, hidden_states):
        """The drafter's context features from a target forward's ``hidden_states``
        (``output_hidden_states=True``): tap ``id`` is ``hidden_states[id + 1]``, the output
        of decoder layer ``id``, concatenated over ``target_layer_ids`` -> [B, T, L*H]."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    @torch.no_grad()
    def spec_generate(
        self,
        target,
        input_ids,
        max_new_tokens,
        stop_token_ids=None,
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        return_stats=False,
    ):
        """Greedy speculative decoding of ``input_ids`` with ``target``, a transformers causal
        LM (the one this drafter was trained against), z-lab's calling convention.

        ``input_ids``: LongTensor [1, P] (or [P], or a tokenizer's output holding
        ``input_ids``); ``stop_token_ids``: ids that end decoding
        (kept in the output), None for none; ``max_new_tokens``: the limit of new tokens.
        Returns LongTensor [1, P + n] on the target's device: the prompt, then the new tokens,
        exactly those of ``target.generate(input_ids, do_sample=False, max_new_tokens=...,
        eos_token_id=stop_token_ids)``. With ``return_stats=True``: a namespace with
        ``output_ids``, ``num_input_tokens``, ``num_output_tokens`` and
        ``acceptance_lengths`` (per verify step, the tokens it committed: the accepted
        guesses + the target's own next token, before the cut at a stop token or the limit).

        Each step the drafter proposes the block [last committed token, MASK x (bs - 1)]
        from the taps of every position before that token; the target runs the last token
        and the guesses in one forward over its KV cache; the longest prefix of guesses equal
        to the target's argmax is kept, plus the target's token after it, and both caches
        are cropped back to the committed positions, whose taps join the drafter's context.

        Only greedy decoding (``temperature=0``) is implemented: ``temperature > 0`` raises
        ValueError (``top_p`` and ``top_k`` are accepted for z-lab's signature and, as
        there, have no effect at temperature 0).
        """
        if temperature is not None and float(temperature) > 0:
            raise ValueError(
                f"spec_generate decodes greedily only (temperature=0.0), got temperature={temperature}: "
                "sampling needs rejection-sampling verification, which this module does not implement; "
                "serve the drafter with SGLang or vLLM to sample"
            )
        if self.mask_token_id is None:
            raise ValueError("config.json has no dflash_config.mask_token_id: the drafter cannot build a block")
        self._check_target(target)
        if hasattr(input_ids, "keys") and "input_ids" in input_ids:
            # A tokenizer's output (transformers 5's apply_chat_template returns a BatchEncoding).
            input_ids = input_ids["input_ids"]
        ids = torch.as_tensor(input_ids)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
            raise ValueError(f"spec_generate takes one prompt, input_ids [1, P] with P >= 1; got shape {tuple(ids.shape)}")
        if isinstance(stop_token_ids, int):
            stop_token_ids = [stop_token_ids]
        stops = {int(t) for t in (stop_token_ids or [])}
        max_new = int(max_new_tokens)
        device = _module_device(target)
        ids = ids.to(device=device, dtype=torch.long)
        prompt_len = ids.shape[1]
        stats = SimpleNamespace(num_input_tokens=prompt_len, acceptance_lengths=[])

        def finish(new_tokens):
            tail = torch.tensor([new_tokens], dtype=torch.long, device=device).reshape(1, -1)
            out = torch.cat([ids, tail], dim=1)
            if not return_stats:
                return out
            stats.output_ids = out
            stats.num_output_tokens = len(new_tokens)
            return stats

        if max_new <= 0:
            return finish([])
        cache_kw = _cache_keyword(target)
        embed = target.get_input_embeddings()
        head = target.get_output_embeddings()
        t_cache = _new_cache()
        d_cache = _new_cache()
        my_device = self.fc.weight.device

        prefill_kw = {cache_kw: t_cache, "use_cache": True, "output_hidden_states": True}
        if "logits_to_keep" in inspect.signature(target.forward).parameters:
            prefill_kw["logits_to_keep"] = 1
        out = target(input_ids=ids, position_ids=torch.arange(prompt_len, device=device)[None], **prefill_kw)
        new = [int(out.logits[0, -1].argmax())]
        # Taps of positions ctx_from.. not yet in the drafter's cache.
        ctx = self.target_taps(out.hidden_states).to(my_device)
        ctx_from = 0
        stopped = new[0] in stops
        while not stopped and len(new) < max_new:
            last_pos = prompt_len + len(new) - 1  # the last committed token, not yet run by the target
            # The verify block commits at most its length: no longer than the tokens still allowed.
            k = min(self.block_size, max_new - len(new))
            guesses = []
            if k > 1:
                block = torch.full((1, self.block_size), int(self.mask_token_id), dtype=torch.long, device=device)
                block[0, 0] = new[-1]
                noise = embed(block).to(my_device)
                pos = torch.arange(ctx_from, last_pos + self.block_size, device=my_device)[None]
                hidden = self(
                    position_ids=pos, noise_embedding=noise, target_hidden=ctx, past_key_values=d_cache, use_cache=True
                )
                # Keep the context's keys (positions < last_pos), drop the block's.
                _crop(d_cache, last_pos)
                ctx, ctx_from = ctx[:, :0], last_pos
                w = head.weight
                logits = self.compute_logits(hidden[:, 1:k].to(device=w.device, dtype=w.dtype), head)
                guesses = logits[0].argmax(-1).tolist()
            verify = torch.tensor([[new[-1]] + guesses], dtype=torch.long, device=device)
            out = target(
                input_ids=verify,
                position_ids=torch.arange(last_pos, last_pos + verify.shape[1], device=device)[None],
                **{cache_kw: t_cache, "use_cache": True, "output_hidden_states": True},
            )
            best = out.logits[0].argmax(-1).tolist()
            n = 0
            while n < len(guesses) and guesses[n] == best[n]:
                n += 1
            stats.acceptance_lengths.append(n + 1)
            committed = guesses[:n] + [best[n]]
            new.extend(committed)
            stopped = any(t in stops for t in committed)
            # The target keeps the keys of last_pos .. last_pos + n (right inputs); the new
            # last token has not been run.
            _crop(t_cache, last_pos + n + 1)
            ctx = torch.cat([ctx, self.target_taps(out.hidden_states)[:, : n + 1].to(my_device)], dim=1)
        # A stop token ends the output; the limit cuts it.
        for i, t in enumerate(new):
            if t in stops:
                new = new[: i + 1]
                break
        return finish(new[:max_new])

    def _check_target(self, target):
        """Refuse a target other than the one this drafter was trained against."""
        cfg = getattr(target, "config", None)
        if cfg is None or not hasattr(target, "get_input_embeddings") or target.get_output_embeddings() is None:
            raise ValueError("target must be a transformers causal LM (AutoModelForCausalLM) with an output head")
        tcfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        layers, hidden = getattr(tcfg, "num_hidden_layers", None), getattr(tcfg, "hidden_size", None)
        want_layers = getattr(self.config, "num_target_layers", None)
        if want_layers is not None and layers is not None and int(want_layers) != int(layers):
            raise ValueError(f"the target has {layers} layers, this drafter was trained against one with {want_layers}")
        if hidden is not None and int(hidden) != int(self.config.hidden_size):
            raise ValueError(f"the target's hidden size is {hidden}, this drafter's {self.config.hidden_size}")
        if layers is not None and max(self.target_layer_ids) >= int(layers):
            raise ValueError(f"tapped layer {max(self.target_layer_ids)} is past the target's {layers} layers")


def _module_device(model):
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    return next(model.parameters()).device


def _cache_keyword(target):
    """The name a target's forward takes its KV cache under: ``cache`` (transformers 5.2x),
    else ``past_key_values``."""
    params = inspect.signature(target.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _new_cache():
    from transformers import DynamicCache

    return DynamicCache()


def _crop(cache, length):
    """Cut a transformers cache to its first `length` positions. A negative count is
    "remove that many" in both transformers 4 and 5; zero is skipped (4.x reads 0 as a length)."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)
