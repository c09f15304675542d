"""Parity gate of a dflash-supervise export (run by `dflash-supervise export-check DIR`).

Loads DIR with transformers' AutoModel (trust_remote_code: the export's own
dflash_drafter.py) on the CPU in float32, checks that every tensor of model.safetensors
was used (no missing, unexpected or mismatched keys), runs the probe batch stored at export
(DIR.probe.safetensors, beside the export) with the explicit mask and again with the anchors (the module builds
DFlash's mask itself), and compares with the Rust drafter's output stored beside it.

Exit 0: within tolerance. 1: over tolerance, keys missing/unexpected, or the model fails
to load or run. 2: DIR is not an export, or Python packages are missing.
Arguments: DIR TOLERANCE.
"""

import json
import os
import sys

# Both sides compute in f32 from the same bf16 weights: only summation order differs.
if len(sys.argv) != 4:
    print("usage: export_check.py DIR PROBE TOLERANCE", file=sys.stderr)
    sys.exit(2)
export_dir, probe_path, tolerance = sys.argv[1], sys.argv[2], float(sys.argv[3])

missing = []
for mod in ("torch", "transformers", "safetensors"):
    try:
        __import__(mod)
    except Exception as e:  # ImportError, or a broken install
        missing.append(f"{mod} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})")
if missing:
    print(
        f"export-check needs the Python packages torch and transformers; missing or broken: {', '.join(missing)} "
        f"(install the CPU build with: {sys.executable} -m pip install torch transformers)",
        file=sys.stderr,
    )
    sys.exit(2)

# Nothing to fetch: the model and its code are local.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoModel  # noqa: E402

try:
    with open(os.path.join(export_dir, "config.json")) as f:
        config = json.load(f)
except Exception as e:
    print(f"{export_dir}/config.json: {' '.join(str(e).split())} (not a dflash-supervise export)", file=sys.stderr)
    sys.exit(2)
auto = (config.get("auto_map") or {}).get("AutoModel")
if not auto:
    print(f"{export_dir}/config.json has no auto_map.AutoModel (not a dflash-supervise export, or one written before model code was exported)", file=sys.stderr)
    sys.exit(2)
try:
    probe = load_file(probe_path)
except Exception as e:
    print(f"{probe_path}: {' '.join(str(e).split())}", file=sys.stderr)
    sys.exit(2)
needed = ("target_hidden", "noise_embedding", "position_ids", "anchors", "attention_mask", "hidden_states")
absent = [k for k in needed if k not in probe]
if absent:
    print(f"{probe_path} lacks {', '.join(absent)}", file=sys.stderr)
    sys.exit(2)


def fail(msg):
    # One line, whatever the exception's text holds.
    print("FAIL: " + " ".join(str(msg).split()))
    sys.exit(1)


def version_tuple(v):
    out = []
    for part in v.split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


# transformers 5 loads in the config's dtype (bf16) unless told; 4.56+ takes `dtype`,
# older 4.x `torch_dtype`.
dtype_kw = "dtype" if version_tuple(transformers.__version__) >= (4, 56) else "torch_dtype"
try:
    model, info = AutoModel.from_pretrained(
        export_dir, trust_remote_code=True, output_loading_info=True, **{dtype_kw: torch.float32}
    )
except Exception as e:
    fail(f"transformers {transformers.__version__} cannot load {export_dir}: {type(e).__name__}: {e}")
model.eval()
cls = type(model).__name__
expected_cls = auto.rsplit(".", 1)[-1]
print(f"loaded {cls} with transformers {transformers.__version__}, torch {torch.__version__}")
if cls != expected_cls:
    fail(f"AutoModel built {cls}, not {expected_cls} (auto_map or trust_remote_code not honoured)")
problems = []
for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
    vals = list(info.get(key) or [])
    if vals:
        problems.append(f"{key.replace('_', ' ')}: {', '.join(str(v) for v in vals[:5])}" + (f" (+{len(vals) - 5})" if len(vals) > 5 else ""))
if problems:
    fail("; ".join(problems))
params = dict(model.named_parameters())
bad_dtype = [n for n, p in params.items() if p.dtype != torch.float32]
if bad_dtype:
    fail(f"parameters not in float32 after loading: {', '.join(bad_dtype[:5])}")
print(f"all {len(params)} tensors loaded (no missing, unexpected or mismatched keys)")

ref = probe["hidden_states"].to(torch.float32)
scale = ref.abs().max().item()
if not scale > 0:
    print(f"{probe_path}: the reference output is all zeros", file=sys.stderr)
    sys.exit(2)
worst = 0.0
with torch.no_grad():
    runs = {
        "explicit mask": dict(
            position_ids=probe["position_ids"],
            attention_mask=probe["attention_mask"].bool(),
            noise_embedding=probe["noise_embedding"],
            target_hidden=probe["target_hidden"],
        ),
        "mask from anchors": dict(
            anchors=probe["anchors"],
            noise_embedding=probe["noise_embedding"],
            target_hidden=probe["target_hidden"],
        ),
    }
    for name, kwargs in runs.items():
        try:
            out = model(**kwargs)
        except Exception as e:
            fail(f"forward ({name}) raised {type(e).__name__}: {e}")
        if tuple(out.shape) != tuple(ref.shape):
            fail(f"forward ({name}) returned shape {tuple(out.shape)}, the probe holds {tuple(ref.shape)}")
        if not torch.isfinite(out).all():
            fail(f"forward ({name}) returned non-finite values")
        err = (out.to(torch.float32) - ref).abs().max().item() / scale
        print(f"{name}: max relative error {err:.3e}")
        worst = max(worst, err)

verdict = "ok" if worst <= tolerance else "FAIL"
print(f"{verdict}: max relative error {worst:.3e} (max |diff| / max |ref|), tolerance {tolerance:.0e}")
sys.exit(0 if worst <= tolerance else 1)
