#!/usr/bin/env python3
"""Follow a dflash-supervise run's metrics.jsonl (and train.jsonl) and log them to W&B.

    scripts/wandb_bridge.py RUN_DIR [--project P] [--name N] [--no-follow]

Every metrics window becomes one W&B log call (nested keys flattened with "/"), every
training step another, with the step number as the W&B step. It follows the files as they
grow until the run ends (its supervisor releases RUN_DIR/.lock), or reads what is there and
exits with --no-follow. Works offline: WANDB_MODE=offline writes the run under ./wandb for
a later `wandb sync`.
"""

import argparse
import fcntl
import json
import os
import sys
import time


def flatten(obj, path="", out=None):
    """{"a": {"b": 1}, "gpus": [{"index": 0, "x": 2}]} -> {"a/b": 1, "gpus/0/x": 2}."""
    out = {} if out is None else out
    if isinstance(obj, bool):
        out[path] = int(obj)
    elif isinstance(obj, (int, float)):
        out[path] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            flatten(v, f"{path}/{k}" if path else str(k), out)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            key = v.get("index", i) if isinstance(v, dict) else i
            flatten(v, f"{path}/{key}" if path else str(key), out)
    return out


class Tail:
    """New complete lines of a file, from where we left off."""

    def __init__(self, path):
        self.path, self.pos, self.partial = path, 0, ""

    def lines(self):
        try:
            with open(self.path, encoding="utf-8") as f:
                f.seek(self.pos)
                data = f.read()
                self.pos = f.tell()
        except FileNotFoundError:
            return []
        data = self.partial + data
        *complete, self.partial = data.split("\n")
        return [l for l in complete if l.strip()]


def supervisor_alive(run_dir):
    try:
        with open(os.path.join(run_dir, ".lock")) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return True
            return False
    except FileNotFoundError:
        return False


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--project", default="dflash", help="W&B project (default: dflash)")
    ap.add_argument("--name", default=None, help="W&B run name (default: the run dir's name)")
    ap.add_argument("--no-follow", action="store_true", help="log what is there and exit")
    ap.add_argument("--poll", type=float, default=1.0, help="seconds between looks at the files")
    a = ap.parse_args(argv)
    if not os.path.isfile(os.path.join(a.run_dir, "state.json")):
        print(f"wandb_bridge: {a.run_dir}: not a dflash-supervise run directory (no state.json)", file=sys.stderr)
        return 2
    try:
        import wandb
    except ImportError:
        print("wandb_bridge: the wandb package is not installed (pip install wandb)", file=sys.stderr)
        return 2
    name = a.name or os.path.basename(os.path.abspath(a.run_dir))
    config = {}
    try:
        with open(os.path.join(a.run_dir, "run.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        pass
    run = wandb.init(project=a.project, name=name, config=config)
    metrics = Tail(os.path.join(a.run_dir, "metrics.jsonl"))
    train = Tail(os.path.join(a.run_dir, "train.jsonl"))
    logged = 0
    last_step = 0
    while True:
        ended = not supervisor_alive(a.run_dir)
        for line in train.lines():
            rec = json.loads(line)
            last_step = rec.get("step", last_step)
            run.log({f"train/{k}": v for k, v in flatten(rec).items()}, step=last_step)
            logged += 1
        for line in metrics.lines():
            rec = json.loads(line)
            step = (rec.get("train") or {}).get("step", last_step)
            last_step = max(last_step, step)
            run.log({f"metrics/{k}": v for k, v in flatten(rec).items()}, step=last_step)
            logged += 1
        if a.no_follow or ended:
            break
        time.sleep(a.poll)
    run.finish()
    print(f"wandb_bridge: logged {logged} records from {a.run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
