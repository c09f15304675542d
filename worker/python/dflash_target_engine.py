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

With `--mode decode` (what `eval` runs) it loads the whole model and decodes over a KV
cache instead; the exchange file (`--exchange`) carries the floats both ways:

    -> {"op": "forward", "past": 12, "ids": [5, 9, 7]}
    <- {"ok": true, "argmax": [9, 7, 3], "margin": 0.41, "max_abs": 12.5}

(with `"logits": "last"`, the last row's logits follow the taps, f32) keeps the cache's
first `past` positions (cropped where every cache layer is plain full
attention; otherwise the cache is rebuilt from the kept tokens: sliding-window and
linear-attention states cannot be rolled back), runs `ids` after them, answers each row's
greedy token (and the last row's top-2 margin and largest |logit|), and writes the rows'
taps (f32, `[rows, taps x hidden]`) at offset 0 of the exchange file;

    -> {"op": "head", "rows": 4}
    <- {"ok": true, "argmax": [17, 2, 2, 90]}

reads `[rows, hidden]` f32 final-normed hidden states (a drafter's) from offset 0 of the
exchange file and answers the target's lm_head's greedy token for each.

Errors go to stderr (the worker keeps the last lines) and end the process with status 1.
Written for this tool from transformers' public API (no code copied).
"""

import argparse
import json
import mmap
import os
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
    """The ModuleList of decoder layers, wherever the architecture keeps it: the layers of
    the decoder transformers names (get_decoder(): a multimodal wrapper's language model),
    else the longest `...layers` list outside vision and audio towers."""
    import torch

    try:
        layers = getattr(model.get_decoder(), "layers", None)
    except Exception:  # get_decoder is best effort; some architectures raise
        layers = None
    if isinstance(layers, torch.nn.ModuleList) and len(layers) > 0:
        return layers
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


def auto_class(cfg):
    """The Auto class that loads `cfg`: a causal LM, or a multimodal wrapper transformers
    maps only as image-text-to-text (Mistral 3, Qwen3-VL, ...), whose language model is
    what runs."""
    from transformers import AutoModelForCausalLM

    if type(cfg) not in AutoModelForCausalLM._model_mapping:
        from transformers import AutoModelForImageTextToText

        if type(cfg) in AutoModelForImageTextToText._model_mapping:
            return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load(args):
    import torch
    import transformers
    from transformers import AutoConfig

    taps = [int(t) for t in args.taps.split(",")]
    cfg = AutoConfig.from_pretrained(args.target)
    # Decoding needs every layer (and the lm_head); capture alone stops at the last tap.
    total = text_config(cfg).num_hidden_layers
    if args.mode == "taps":
        truncate(cfg, max(taps) + 1)
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
    auto = auto_class(cfg)
    if args.devices:
        # Over several GPUs (--gpus-per-target): contiguous ranges of layers, one per device.
        kw["device_map"] = device_map(cfg, args.devices.split(","))
    try:
        model = auto.from_pretrained(args.target, config=cfg, **kw)
    except Exception as e:  # one line: what could not be loaded
        die(f"transformers {transformers.__version__} cannot load {args.target}: {e}".replace("\n", " "))
    model.eval()
    if gpu and not args.devices:
        model.to("cuda")
    layers = decoder_layers(model)
    want = max(taps) + 1 if args.mode == "taps" else total
    if len(layers) != want:
        die(f"loaded {len(layers)} decoder layers, expected {want}")
    captured = {}

    def hook(k):
        def f(_mod, _inp, out):
            captured[k] = out[0] if isinstance(out, (tuple, list)) else out

        return f

    for k in sorted(set(taps)):
        layers[k].register_forward_hook(hook(k))
    tc = text_config(model.config)
    return model, taps, captured, tc.hidden_size, total


def split_layers(sizes, n, first=0):
    """The device (0..n-1) of each layer: contiguous ranges in order, one per device (as
    many devices as there are layers at most), the largest device's bytes (device 0 also
    holding `first`, the embedding) as small as any such split makes it."""
    if n < 1:
        raise ValueError("no devices")
    count = len(sizes)
    k = min(n, count)
    pre = [0]
    for size in sizes:
        pre.append(pre[-1] + size)

    def load(a, b):
        return pre[b] - pre[a] + (first if a == 0 else 0)

    # best[j][i]: the least largest load of layers 0..i split into j ranges.
    inf = float("inf")
    best = [[inf] * (count + 1) for _ in range(k + 1)]
    cut = [[0] * (count + 1) for _ in range(k + 1)]
    best[0][0] = 0
    for j in range(1, k + 1):
        for i in range(j, count + 1):
            for a in range(j - 1, i):
                c = max(best[j - 1][a], load(a, i))
                if c < best[j][i]:
                    best[j][i], cut[j][i] = c, a
    out, i = [0] * count, count
    for j in range(k, 0, -1):
        a = cut[j][i]
        for x in range(a, i):
            out[x] = j - 1
        i = a
    return out


def device_map(cfg, devices):
    """transformers' device_map for `cfg` over `devices`: the decoder layers split by
    [split_layers] (by parameter bytes), every other module on the first device."""
    import torch
    from accelerate import init_empty_weights

    with init_empty_weights():
        skel = auto_class(cfg).from_config(cfg)
    layers = decoder_layers(skel)
    prefix = next(name for name, mod in skel.named_modules() if mod is layers)

    def nbytes(mod):
        return sum(p.numel() * p.element_size() for p in mod.parameters())

    embed = skel.get_input_embeddings()
    where = split_layers([nbytes(layer) for layer in layers], len(devices), nbytes(embed))
    dmap = {f"{prefix}.{i}": devices[d] for i, d in enumerate(where)}
    for name, mod in skel.named_modules():
        if name == prefix or name.startswith(prefix + "."):
            continue
        own = list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False))
        if own and name:
            dmap[name] = devices[0]
    del skel, torch
    return dmap


class Decoder:
    """Greedy decoding's target side: a KV cache over the tokens `ids`."""

    def __init__(self, model, taps, captured, dev, exchange):
        self.model, self.taps, self.captured, self.dev = model, taps, captured, dev
        self.fd = exchange
        self.ids = []
        self.cache = None
        # transformers >= 5.2x names the cache argument `cache`; earlier ones
        # `past_key_values`.
        import inspect

        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    def keep(self, past):
        """Forget every position from `past` on."""
        if past > len(self.ids):
            die(f"asked to keep {past} positions of a cache of {len(self.ids)}")
        cut = len(self.ids) - past
        self.ids = self.ids[:past]
        if cut == 0 or self.cache is None:
            return
        layers = getattr(self.cache, "layers", None)
        # Only plain full-attention layers can be cut back exactly; anything else (sliding
        # windows, linear attention, quantised layers) is rebuilt from the kept tokens.
        if layers and all(type(layer).__name__ == "DynamicLayer" for layer in layers):
            self.cache.crop(-cut)
            if self.cache.get_seq_length() == past:
                return
        self.cache = None

    def forward(self, past, ids, last_logits=False):
        import torch

        self.keep(past)
        # A cache dropped by keep() is rebuilt: the kept tokens run again before `ids`.
        skip = len(self.ids) if self.cache is None else 0
        run = self.ids + ids if self.cache is None else ids
        self.captured.clear()
        with torch.no_grad():
            out = self.model(
                input_ids=torch.tensor([run], device=self.dev),
                use_cache=True,
                **{self.cache_arg: self.cache},
            )
        self.cache = getattr(out, "cache", None)
        if self.cache is None:
            self.cache = getattr(out, "past_key_values", None)
        self.ids = self.ids + ids
        logits = out.logits[0, skip:].float()
        rows = torch.cat([self.captured[k][0, skip:].to(self.dev) for k in self.taps], dim=-1)
        taps = rows.float().contiguous().cpu().numpy().tobytes()
        os.pwrite(self.fd, taps, 0)
        if last_logits:
            # The last row's logits after the taps: what sampling the next token needs.
            os.pwrite(self.fd, logits[-1].contiguous().cpu().numpy().tobytes(), len(taps))
        top = torch.topk(logits[-1], 2) if logits.shape[-1] > 1 else None
        margin = float(top.values[0] - top.values[1]) if top is not None else 0.0
        return {
            "ok": True,
            "vocab": int(logits.shape[-1]),
            "argmax": logits.argmax(dim=-1).tolist(),
            "margin": margin,
            "max_abs": float(logits[-1].abs().max()),
        }

    def head(self, rows):
        import numpy
        import torch

        head = self.model.get_output_embeddings()
        hidden = head.weight.shape[1]
        data = os.pread(self.fd, rows * hidden * 4, 0)
        if len(data) != rows * hidden * 4:
            die(f"the exchange file holds {len(data)} bytes, not {rows} rows of {hidden}")
        h = torch.from_numpy(numpy.frombuffer(data, dtype=numpy.float32).copy()).view(rows, hidden)
        with torch.no_grad():
            logits = head(h.to(device=self.dev, dtype=head.weight.dtype))
        return {"ok": True, "argmax": logits.float().argmax(dim=-1).tolist()}


def decode(model, taps, captured, dev, args, proto):
    """The decode mode's loop: one request per stdin line."""
    d = Decoder(model, taps, captured, dev, os.open(args.exchange, os.O_RDWR))
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("op") == "forward":
            r = d.forward(int(req["past"]), [int(t) for t in req["ids"]], req.get("logits") == "last")
        elif req.get("op") == "head":
            r = d.head(int(req["rows"]))
        else:
            die(f"unknown request {line.strip()!r}")
        print(json.dumps(r), file=proto, flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--taps", required=True)
    p.add_argument("--mode", default="taps", choices=["taps", "decode"])
    p.add_argument("--pool", help="taps: the hidden-state pool (a memfd path)")
    p.add_argument("--exchange", help="decode: the file the floats go through")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--devices", help="several devices (cuda:0,cuda:1,...): the layers split over them")
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
    dev = next(model.parameters()).device
    body = getattr(model, "model", model)
    print(
        json.dumps(
            {
                "ready": True,
                "hidden_size": hidden,
                "num_hidden_layers": total,
                "loaded_layers": max(taps) + 1 if args.mode == "taps" else total,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "device": str(dev),
            }
        ),
        file=proto,
        flush=True,
    )
    if args.mode == "decode":
        return decode(model, taps, captured, dev, args, proto)
    f = open(args.pool, "r+b")
    pool = mmap.mmap(f.fileno(), 0)
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
                row = torch.cat([captured[k][0].to(dev) for k in taps], dim=-1).to(out_dtype).contiguous()
                data = row.cpu().view(torch.uint8).numpy().tobytes()
                if off + len(data) > len(pool):
                    die(f"row of {len(data)} bytes at {off} passes the pool's {len(pool)} bytes")
                pool[off : off + len(data)] = data
        ms = (time.perf_counter() - t0) * 1000.0
        print(json.dumps({"id": req["id"], "ok": True, "ms": ms}), file=proto, flush=True)


if __name__ == "__main__":
    main()
