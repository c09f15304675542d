"""Unit checks of dflash_drafter.py against transformers itself (run by
tests/tests/export.rs; needs torch and transformers). Prints one line per check; exits 1
on the first failure.

- rotary inverse frequencies and attention factors (linear, llama3, yarn) equal
  transformers' ROPE_INIT_FUNCTIONS;
- rope settings are read from both config layouts (transformers 4 and 5);
- the DFlash mask builder follows DFLASH.md (strict `<` on the anchor, blocks apart);
- with a transformers DynamicCache, drafting in two calls (context then more context and a
  block, the cache cropped between them as inference loops do) equals one call.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import LlamaConfig, Qwen3Config  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

import dflash_drafter as m  # noqa: E402


def check(name, ok, detail=""):
    print(f"{'ok' if ok else 'FAIL'}: {name}{(' (' + detail + ')') if detail else ''}")
    if not ok:
        sys.exit(1)


HEAD_DIM = 128
THETA = 500000.0
SCALINGS = {
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0},
}
for kind, scaling in SCALINGS.items():
    cfg = LlamaConfig(
        hidden_size=HEAD_DIM * 4, num_attention_heads=4, num_key_value_heads=4, head_dim=HEAD_DIM,
        rope_theta=THETA, rope_scaling=dict(scaling),
        # factor × original: transformers versions that derive YaRN's settings from
        # max_position_embeddings (4.51) agree with those that read them (4.57, 5.x).
        max_position_embeddings=16384,
    )
    ref, ref_factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    theta, parsed = m.rope_settings(cfg)
    ours = m.rope_inv_freq(HEAD_DIM, theta, parsed).to(torch.float32)
    rel = ((ours - ref.to(torch.float32)).abs() / ref.abs()).max().item()
    check(f"{kind} inv_freq equals transformers' ROPE_INIT_FUNCTIONS[{kind!r}]", rel < 1e-6, f"max relative difference {rel:.1e}")
    af = m.rope_attention_factor(parsed)
    check(f"{kind} attention factor equals transformers'", abs(af - float(ref_factor)) < 1e-9, f"{af} vs {ref_factor}")
    check(f"{kind} scaling changes some frequencies", (ours - m.rope_inv_freq(HEAD_DIM, THETA, None).float()).abs().max().item() > 0)

# Both layouts: top-level rope_theta/rope_scaling (transformers 4) and rope_parameters (5).
q = Qwen3Config(rope_theta=1234.0, rope_scaling=dict(SCALINGS["linear"]))
check("rope settings of a Qwen3Config", m.rope_settings(q)[0] == 1234.0 and m.rope_settings(q)[1]["factor"] == 4.0)


class Layout5:
    rope_parameters = {"rope_type": "llama3", "rope_theta": 77.0, **{k: v for k, v in SCALINGS["llama3"].items() if k != "rope_type"}}


theta5, sc5 = m.rope_settings(Layout5())
check("rope settings from rope_parameters", theta5 == 77.0 and sc5["rope_type"] == "llama3")


class Dynamic:
    rope_parameters = {"rope_type": "dynamic", "rope_theta": 1.0, "factor": 2.0}


try:
    m.rope_settings(Dynamic())
    check("an unsupported rope type is refused", False)
except ValueError as e:
    check("an unsupported rope type is refused", "dynamic" in str(e))

# YaRN's attention factor from mscale/mscale_all_dim (DeepSeek style), as transformers derives it.
ds = dict(SCALINGS["yarn"], mscale=0.707, mscale_all_dim=0.707)
cfg = LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM, rope_theta=THETA, rope_scaling=ds, max_position_embeddings=16384)
_, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
check("yarn attention factor from mscale", abs(m.rope_attention_factor(m.rope_settings(cfg)[1]) - float(ref_factor)) < 1e-9)

# The mask: S=6 context tokens, blocks of 2 at anchors 0 and 3.
mask = m.dflash_attention_mask(torch.tensor([[0, 3]]), 6, 2)[0, 0]
want = torch.zeros(4, 10, dtype=torch.bool)
want[0:2, 6:8] = True  # block 0: no context (anchor 0), itself
want[2:4, 0:3] = True  # block 1: context 0..2 (strictly before anchor 3)
want[2:4, 8:10] = True
check("DFlash mask", torch.equal(mask, want))
keep = m.dflash_attention_mask(torch.tensor([[0, 3]]), 6, 2, torch.tensor([[True, False]]))[0, 0]
check("a dropped block sees nothing", not keep[2:].any() and torch.equal(keep[:2], want[:2]))

# A small random drafter; DynamicCache inference equals a single call.
torch.manual_seed(0)
cfg = Qwen3Config(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=64, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=50,
)
cfg.dflash_config = {"target_layer_ids": [0, 1], "mask_token_id": 49}
cfg.block_size = 4
model = m.DFlashDraftModel(cfg).eval()
with torch.no_grad():
    for p in model.parameters():
        p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
s1, s, bs = 5, 9, 4
ctx = torch.randn(1, s, 64)
noise = torch.randn(1, bs, 32)
with torch.no_grad():
    full = model(position_ids=torch.arange(s + bs)[None], noise_embedding=noise, target_hidden=ctx)
    cache = transformers.DynamicCache()
    # First call: context 0..s1 and a throwaway block at s1..s1+bs; keep only the context.
    model(position_ids=torch.arange(s1 + bs)[None], noise_embedding=torch.randn(1, bs, 32), target_hidden=ctx[:, :s1], past_key_values=cache, use_cache=True)
    cache.crop(-(cache.get_seq_length() - s1))  # a negative count: both transformers 4 and 5
    step = model(position_ids=torch.arange(s1, s + bs)[None], noise_embedding=noise, target_hidden=ctx[:, s1:], past_key_values=cache, use_cache=True)
diff = (step - full).abs().max().item()
check("drafting with a DynamicCache equals one call", diff < 1e-5, f"max |diff| {diff:.1e}")
print(f"all checks passed (transformers {transformers.__version__})")
