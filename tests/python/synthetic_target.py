"""A tiny Qwen3 target trained on a low-entropy synthetic language, for the tests that need
a target that has learned something (a random one makes greedy continuations near-ties and
τ ≈ 1). Deterministic from its seed; a few seconds on a laptop core.

The language: tokens 2..63; each token is followed by succ(t) = 2 + (7(t - 2) + 5) mod 62
nine times in ten, else by a random token; token 9 is followed by EOS (1) nine times in
ten. Sequences start at a random token and are packed with EOS between them.

    python3 synthetic_target.py OUT_DIR [--steps N] [--seed S]

Writes a transformers checkpoint (config.json, model.safetensors in bfloat16, and
generation_config.json) and prints one JSON line: {"loss": final training loss}.
"""
import argparse
import json
import random

import torch
from transformers import AutoModelForCausalLM, Qwen3Config

VOCAB, EOS = 64, 1


def succ(t):
    return 2 + (7 * (t - 2) + 5) % 62


def stream(rng, n):
    out = []
    while len(out) < n:
        t = rng.randrange(2, VOCAB)
        out.append(t)
        for _ in range(rng.randrange(8, 40)):
            if t == 9 and rng.random() < 0.9:
                break
            t = succ(t) if rng.random() < 0.9 else rng.randrange(2, VOCAB)
            out.append(t)
        out.append(EOS)
    return out[:n]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    torch.set_num_threads(2)
    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
        bos_token_id=EOS, eos_token_id=EOS, pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss = None
    for _ in range(a.steps):
        batch = torch.tensor([stream(rng, 64) for _ in range(16)])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.to(torch.bfloat16).save_pretrained(a.out)
    print(json.dumps({"loss": loss.item()}))


if __name__ == "__main__":
    main()
