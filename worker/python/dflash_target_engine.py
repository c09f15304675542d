"""The torch target engine: the child a target worker starts with `--target-engine torch`.

It loads the target with transformers (AutoModelForCausalLM; float32 on the CPU, bfloat16 on
a GPU; transformers' attention choice, flash-attention on a GPU where installed; only the
layers up to the last tap), maps the worker's hidden-state pool (a memfd,
opened through /proc/<worker>/fd/<fd>), and answers one request per stdin line by running
each row through the model and writing the tapped layers' outputs straight into the pool:

    -> {"id": 7, "rows": [[151644, 872, ...], ...], "offsets": [4096, ...], "dtype": "bf16"}
    <- {"id": 7, "ok": true, "ms": 12.5}

Row r's taps go to byte offset offsets[r] of the pool, as `[len, taps x hidden]` row-major
(for each token its taps' hidden states one after the other, in the order of --taps), in
bf16 (or f32 for `inspect`): exactly where the native engine writes them. "Layer k" is the
output of decoder layer k (transformers' hidden_states[k + 1]), before any final norm,
taken with a forward hook on the layer. The first stdout line says the model is ready:

    <- {"ready": true, "hidden_size": 4096, "num_hidden_layers": 36, "loaded_layers": 34, ...}

Errors go to stderr (the worker keeps the last lines) and end the process with status 1.
Written for this tool from transformers' public API (no code copied).
"""

import argparse
import json
import mmap
import sys
import time


def die(msg):
    print(f"dflash_target_engine: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(1)


def text_config(cfg):
    """The language model's config (multimodal wrappers nest it)."""
    for name in ("text_config", "language_config", "llm_config"):
        sub = getattr(cfg, name, None)
        if sub is not None and getattr(sub, "num_hidden_layers", None):
            return sub
    return cfg


def truncate(cfg, layers):
    """Keep the first `layers` decoder layers in `cfg` (and its per-layer lists)."""
    tc = text_config(cfg)
    total = tc.num_hidden_layers
    tc.num_hidden_layers = layers
    for name in ("layer_types", "mlp_only_layers_types"):
        v = getattr(tc, name, None)
        if isinstance(v, list) and len(v) == total:
            setattr(tc, name, v[:layers])
    return total


def decoder_layers(model):
    """The ModuleList of decoder layers, wherever the architecture keeps it."""
    import torch

    best = None
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and name.endswith("layers") and len(mod) > 0:
            if "vision" in name or "visual" in name or "audio" in name:
                continue
            if best is None or len(mod) > len(best[1]):
                best = (name, mod)
    if best is None:
        die("no decoder layers found in the model")
    return best[1]


def load(args):
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    taps = [int(t) for t in args.taps.split(",")]
    cfg = AutoConfig.from_pretrained(args.target)
    total = truncate(cfg, max(taps) + 1)
    if max(taps) >= total:
        die(f"tap {max(taps)} is not below the target's {total} layers")
    gpu = args.device == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    kw = {"dtype": dtype} if hasattr(transformers, "__version__") and int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": dtype}
    # transformers' own choice (sdpa where the architecture supports it, else eager, as
    # gpt-oss's attention sinks need); flash-attention on a GPU when it is installed.
    if gpu:
        try:
            import flash_attn  # noqa: F401

            kw["attn_implementation"] = "flash_attention_2"
        except ImportError:
            pass
    try:
        model = AutoModelForCausalLM.from_pretrained(args.target, config=cfg, **kw)
    except Exception as e:  # one line: what could not be loaded
        die(f"transformers {transformers.__version__} cannot load {args.target}: {e}".replace("\n", " "))
    model.eval()
    if gpu:
        model.to("cuda")
    layers = decoder_layers(model)
    if len(layers) != max(taps) + 1:
        die(f"loaded {len(layers)} decoder layers, expected {max(taps) + 1}")
    captured = {}

    def hook(k):
        def f(_mod, _inp, out):
            captured[k] = out[0] if isinstance(out, (tuple, list)) else out

        return f

    for k in sorted(set(taps)):
        layers[k].register_forward_hook(hook(k))
    tc = text_config(model.config)
    return model, taps, captured, tc.hidden_size, total


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--taps", required=True)
    p.add_argument("--pool", required=True, help="the hidden-state pool (a memfd path)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    # stdout is the protocol: whatever a library prints goes to stderr (the worker's log).
    proto = sys.stdout
    sys.stdout = sys.stderr
    import torch
    import transformers

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    model, taps, captured, hidden, total = load(args)
    f = open(args.pool, "r+b")
    pool = mmap.mmap(f.fileno(), 0)
    dev = next(model.parameters()).device
    body = getattr(model, "model", model)
    print(
        json.dumps(
            {
                "ready": True,
                "hidden_size": hidden,
                "num_hidden_layers": total,
                "loaded_layers": max(taps) + 1,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "device": str(dev),
            }
        ),
        file=proto,
        flush=True,
    )
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        t0 = time.perf_counter()
        out_dtype = torch.float32 if req.get("dtype") == "f32" else torch.bfloat16
        with torch.no_grad():
            for ids, off in zip(req["rows"], req["offsets"]):
                if not ids:
                    continue
                captured.clear()
                # The decoder without the lm_head: the taps are all that is needed.
                body(input_ids=torch.tensor([ids], device=dev), use_cache=False)
                row = torch.cat([captured[k][0] for k in taps], dim=-1).to(out_dtype).contiguous()
                data = row.cpu().view(torch.uint8).numpy().tobytes()
                if off + len(data) > len(pool):
                    die(f"row of {len(data)} bytes at {off} passes the pool's {len(pool)} bytes")
                pool[off : off + len(data)] = data
        ms = (time.perf_counter() - t0) * 1000.0
        print(json.dumps({"id": req["id"], "ok": True, "ms": ms}), file=proto, flush=True)


if __name__ == "__main__":
    main()
