"""Unit checks of dflash_drafter.py against transformers itself (run by
tests/tests/export.rs; needs torch and transformers). Prints one line per check; exits 1
on the first failure.

- rotary inverse frequencies and attention factors (linear, llama3, yarn) equal
  transformers' ROPE_INIT_FUNCTIONS;
- rope settings are read from both config layouts (transformers 4 and 5);
- the DFlash mask builder follows DFLASH.md (strict `<` on the anchor, blocks apart);
- with a transformers DynamicCache, drafting in two calls (context then more context and a
  block, the cache cropped between them as inference loops do) equals one call;
- spec_generate with a random drafter and a random transformers target writes
  target.generate(do_sample=False)'s tokens, stops at a stop token, refuses temperature > 0
  and batches; with guesses steered to the target's own tokens for a chosen number of slots
  it accepts exactly that many (the caches cropped right), and the drafter's context is
  the target's hidden_states[id + 1] of every committed position.

With arguments ``--spec-generate EXPORT TARGET PROMPTS EVAL_JSON MAX_NEW`` it checks an
exported drafter instead (run by tests/tests/export.rs): loaded with
AutoModel.from_pretrained(EXPORT, trust_remote_code=True), spec_generate on each prompt
of PROMPTS (one JSON list of ids a line) writes target.generate's tokens and those of
`dflash-supervise eval --json` (EVAL_JSON), with the same accepted lengths per verify step.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import json  # noqa: E402

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

import dflash_drafter as m  # noqa: E402

# Every model here is tiny: a thread pool's overhead would dominate (4x slower on 2 busy cores).
torch.set_num_threads(1)


def check(name, ok, detail=""):
    print(f"{'ok' if ok else 'FAIL'}: {name}{(' (' + detail + ')') if detail else ''}")
    if not ok:
        sys.exit(1)


def greedy(target, prompt, max_new, stops=None):
    """transformers' own greedy decoding: the reference spec_generate must equal."""
    return target.generate(
        prompt, do_sample=False, max_new_tokens=max_new, eos_token_id=stops, pad_token_id=0,
        attention_mask=torch.ones_like(prompt),
    )


def same(got, want):
    """(equal, what differs) for token tensors or lists."""
    if isinstance(got, torch.Tensor):
        ok = isinstance(want, torch.Tensor) and got.shape == want.shape and torch.equal(got, want)
        got, want = got.tolist(), want.tolist() if isinstance(want, torch.Tensor) else want
    else:
        ok = got == want
    return ok, "" if ok else f"got {got}, want {want}"


def stop_inside_a_step(new_tokens, acceptance):
    """(token, index) of a new token that ends no verify step and first occurs there (the
    first new token comes from the prefill, then each step commits acceptance[i]), or None."""
    ends, at = set(), 0
    for a in acceptance:
        at += a
        ends.add(at)
    for i, t in enumerate(new_tokens):
        if i > 0 and i not in ends and t not in new_tokens[:i]:
            return t, i
    return None


def spec_generate_export_checks(export, target_dir, prompts_path, eval_json, max_new):
    """An exported drafter through AutoModel, against transformers and the Rust eval."""
    from transformers import AutoModel

    dtype_kw = "dtype" if tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 56) else "torch_dtype"
    drafter = AutoModel.from_pretrained(export, trust_remote_code=True, **{dtype_kw: torch.float32}).eval()
    check("AutoModel loads the export's DFlashDraftModel", type(drafter).__name__ == "DFlashDraftModel", type(drafter).__name__)
    target = AutoModelForCausalLM.from_pretrained(target_dir, **{dtype_kw: torch.float32}).eval()
    with open(prompts_path) as f:
        prompts = [json.loads(line) for line in f if line.strip()]
    with open(eval_json) as f:
        rust = json.load(f)["per_prompt"]
    check("the Rust eval decoded every prompt", len(rust) == len(prompts), f"{len(rust)} of {len(prompts)}")
    longest, stop_case, steps, multi = 1, None, 0, 0
    for i, (ids, r) in enumerate(zip(prompts, rust)):
        prompt = torch.tensor([ids])
        ref = greedy(target, prompt, max_new)
        if i == 0:  # z-lab's call, as its README writes it
            out = drafter.spec_generate(input_ids=prompt, max_new_tokens=max_new, temperature=0.0, target=target, stop_token_ids=None)
            check("spec_generate(input_ids=..., target=...) returns target.generate's tokens", *same(out, ref))
        st = drafter.spec_generate(target, prompt, max_new, None, return_stats=True)
        check(f"prompt {i}: spec_generate returns target.generate's tokens", *same(st.output_ids, ref))
        new = st.output_ids[0, len(ids):].tolist()
        check(f"prompt {i}: the Rust eval wrote the same tokens", *same(new, r["tokens"]))
        acc = st.acceptance_lengths
        # The last step may verify a shorter block (only the tokens still allowed); the
        # Rust eval verifies a whole block and cuts.
        agree = acc[:-1] == r["accepted"][:-1] and len(acc) == len(r["accepted"]) and acc[-1] <= r["accepted"][-1]
        check(f"prompt {i}: accepted lengths equal the Rust eval's", agree, f"{acc}" if agree else f"{acc} vs {r['accepted']}")
        check(f"prompt {i}: every new token comes from the prefill or a verify step", 1 + sum(acc) == len(new), f"{sum(acc)} + 1 vs {len(new)}")
        longest = max(longest, max(acc))
        steps, multi = steps + len(acc), multi + sum(a > 1 for a in acc)
        found = stop_inside_a_step(new, acc)
        if found and stop_case is None:
            stop_case = (prompt, *found)
    check("some verify step accepted guesses (the drafter's taps are the trainer's)", longest > 1, f"longest step {longest}")
    check("a prompt has a token to stop at inside a verify step", stop_case is not None)
    prompt, stop, at = stop_case
    ref = greedy(target, prompt, max_new, [stop])
    out = drafter.spec_generate(input_ids=prompt, max_new_tokens=max_new, temperature=0.0, target=target, stop_token_ids=[stop, 10**6])
    check(
        f"a stop token ({stop}, new token {at}) ends the output as it ends target.generate",
        same(out, ref)[0] and out.shape[1] == prompt.shape[1] + at + 1 and int(out[0, -1]) == stop,
        same(out, ref)[1],
    )
    print(
        f"all spec_generate checks passed (transformers {transformers.__version__}; "
        f"{multi} of {steps} verify steps accepted guesses, the longest committed {longest} tokens)"
    )


if sys.argv[1:2] == ["--spec-generate"]:
    if len(sys.argv) != 7:
        print("usage: test_dflash_drafter.py --spec-generate EXPORT TARGET PROMPTS EVAL_JSON MAX_NEW", file=sys.stderr)
        sys.exit(2)
    with torch.no_grad():
        spec_generate_export_checks(*sys.argv[2:6], int(sys.argv[6]))
    sys.exit(0)

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

# spec_generate with that drafter and a random target of its width (taps 0 and 1 of 3 layers).
tcfg = Qwen3Config(
    hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=64, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=50, tie_word_embeddings=False,
)
target = AutoModelForCausalLM.from_config(tcfg).eval()
with torch.no_grad():
    for p in target.parameters():
        p.copy_(torch.randn_like(p) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
prompts = [torch.tensor([[3, 17, 5, 9, 22, 41]]), torch.tensor([[7]]), torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])]
N = 23
with torch.no_grad():
    refs = [greedy(target, p, N) for p in prompts]
    for i, (p, ref) in enumerate(zip(prompts, refs)):
        out = model.spec_generate(input_ids=p, max_new_tokens=N, temperature=0.0, target=target, stop_token_ids=None)
        check(f"spec_generate equals target.generate (random drafter, prompt {i})", *same(out, ref))
    out = model.spec_generate(target, prompts[0][0], 5)
    check("a 1-D prompt gives [1, P + new]", torch.equal(out, refs[0][:, : prompts[0].shape[1] + 5]))
    out = model.spec_generate(target, transformers.BatchEncoding({"input_ids": prompts[0]}), 5)
    check("a tokenizer's output (BatchEncoding) is taken for its input_ids", torch.equal(out, refs[0][:, : prompts[0].shape[1] + 5]))
    out = model.spec_generate(target, prompts[0], 0)
    check("max_new_tokens=0 returns the prompt", torch.equal(out, prompts[0]))

    # Steer the guesses: at each step, slots 1..j guess the target's own tokens (of `ref`)
    # and slot j+1 a wrong one, j cycling through 0..bs-1, so every acceptance length
    # occurs; record the context the drafter is given.
    ref = refs[2]
    plen = prompts[2].shape[1]
    plain_forward, plain_logits = model.forward, model.compute_logits

    def steered(*args, **kw):
        seen = {"steps": 0, "ctx": [], "pos": []}

        def recording_forward(**fw):
            seen["ctx"].append(fw["target_hidden"].clone())
            seen["pos"].append(fw["position_ids"][0, -bs].item())
            return plain_forward(**fw)

        def steered_logits(hidden, head):
            j = seen["steps"] % bs
            seen["steps"] += 1
            last = seen["pos"][-1]
            logits = torch.zeros(1, hidden.shape[1], 50)
            for slot in range(hidden.shape[1]):
                right = int(ref[0, last + 1 + slot])
                logits[0, slot, right if slot < j else (right + 1) % 50] = 1.0
            return logits

        model.forward, model.compute_logits = recording_forward, steered_logits
        try:
            return model.spec_generate(*args, **kw), seen
        finally:
            model.forward, model.compute_logits = plain_forward, plain_logits

    st, seen = steered(target, prompts[2], N, return_stats=True)
    check("steered guesses: the output is still target.generate's", *same(st.output_ids, ref))
    acc = st.acceptance_lengths
    want = [min(k % bs + 1, N - 1 - sum(acc[:k])) for k in range(len(acc))]
    check("steered guesses: each step accepts the guesses that are right, plus one", *same(acc, want))
    check("steered guesses: every acceptance length occurs", set(range(1, bs + 1)) <= set(acc), str(acc))
    # The drafter's context over all steps = hidden_states[id + 1] of the positions before
    # each block, from one forward over the whole output.
    full_hs = target(input_ids=ref, output_hidden_states=True).hidden_states
    want_ctx = torch.cat([full_hs[i + 1] for i in cfg.dflash_config["target_layer_ids"]], dim=-1)
    given = torch.cat(seen["ctx"], dim=1)
    last = seen["pos"][-1]
    check(
        "the drafter's context is the target's hidden_states[id + 1] of each committed position",
        given.shape[1] == last and torch.allclose(given, want_ctx[:, :last], atol=1e-4),
        f"{tuple(given.shape)} for {last} positions",
    )

    # A stop token among a step's accepted guesses: the output ends where target.generate's does.
    found = stop_inside_a_step(ref[0, plen:].tolist(), acc)
    check("the steered output has a token to stop at inside a verify step", found is not None)
    stop, at = found
    (out, _) = steered(target, prompts[2], N, [49, stop])
    check(f"a stop token ({stop}, new token {at}) ends the output as it ends target.generate",
          same(out, greedy(target, prompts[2], N, [49, stop]))[0] and out.shape[1] == plen + at + 1, f"{out.tolist()}")
    narrow = AutoModelForCausalLM.from_config(Qwen3Config(
        hidden_size=16, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        intermediate_size=32, vocab_size=50,
    ))
    for bad, what in (
        (dict(temperature=0.7), "temperature"),
        (dict(input_ids=torch.ones(2, 3, dtype=torch.long)), "one prompt"),
        (dict(target=narrow), "hidden size"),
    ):
        kw = dict(target=target, input_ids=prompts[0], max_new_tokens=4, stop_token_ids=None)
        kw.update(bad)
        try:
            model.spec_generate(**kw)
            check(f"spec_generate refuses {bad}", False)
        except ValueError as e:
            check(f"spec_generate refuses {what} with a ValueError saying so", what in str(e), str(e))
print(f"all checks passed (transformers {transformers.__version__})")
