#!/usr/bin/env python3
"""Follow a dflash-supervise run's metrics.jsonl (and train.jsonl) and log them to W&B.

    scripts/wandb_bridge.py RUN_DIR [--project P] [--name N] [--no-follow]

The supervisor starts it itself with --wandb-project (and keeps it running); it also runs
by hand. Every metrics window becomes one W&B log call (nested keys flattened with "/"),
every training step another. W&B's x axis is `global_step`, which counts every record
logged and never goes back, so the steps a rollback trains again are logged too (their
optimizer step is `train/step`); each rollback is also a `events/rollback_to` value and a
W&B alert. The W&B run id and how far the files were logged are kept in RUN_DIR/wandb.json,
so a bridge started again (after a crash, or a --resume of the run) continues the same W&B
run where it stopped. It follows the files as they grow until the run ends (its supervisor
releases RUN_DIR/.lock), or reads what is there and exits with --no-follow. Works offline:
WANDB_MODE=offline writes the run under ./wandb (or WANDB_DIR) for a later `wandb sync`.
"""

import argparse
import fcntl
import json
import os
import secrets
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
    """New complete lines of a file, from byte offset `pos` on."""

    def __init__(self, path, pos=0):
        self.path, self.pos, self.partial = path, pos, ""

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

    def done(self):
        """Byte offset of the last complete line read."""
        return self.pos - len(self.partial.encode("utf-8"))


def load_state(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def save_state(path, state):
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(state, f)
    os.replace(tmp, path)


def without_nulls(obj):
    """The run's settings as W&B shows them: unset (null) settings left out."""
    if isinstance(obj, dict):
        return {k: without_nulls(v) for k, v in obj.items() if v is not None}
    return obj


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
    run_json = load_state(os.path.join(a.run_dir, "run.json"))
    config = without_nulls(run_json.get("resolved") or run_json)
    state_path = os.path.join(a.run_dir, "wandb.json")
    state = load_state(state_path)
    if not state.get("id"):
        state = {"id": secrets.token_hex(6), "project": a.project, "name": name,
                 "global_step": 0, "train_pos": 0, "metrics_pos": 0}
        save_state(state_path, state)
    run = wandb.init(project=state.get("project", a.project), name=state.get("name", name),
                     id=state["id"], resume="allow", config=config)
    run.define_metric("global_step")
    run.define_metric("*", step_metric="global_step")
    metrics = Tail(os.path.join(a.run_dir, "metrics.jsonl"), state.get("metrics_pos", 0))
    train = Tail(os.path.join(a.run_dir, "train.jsonl"), state.get("train_pos", 0))
    logged = 0
    gstep = state.get("global_step", 0)

    def log(rec):
        nonlocal gstep, logged
        gstep += 1
        rec["global_step"] = gstep
        run.log(rec)
        logged += 1

    while True:
        ended = not supervisor_alive(a.run_dir)
        for line in train.lines():
            rec = json.loads(line)
            if isinstance(rec.get("rollback"), dict):
                rb = rec["rollback"]
                log({"events/rollback_to": rb.get("to", 0), "events/rollback_from": rb.get("from", rb.get("to", 0))})
                try:
                    run.alert(title="dflash-supervise: rollback", text=f"{name}: {json.dumps(rb)}")
                except Exception:  # alerts need an online run; the value above stays
                    pass
                continue
            log({f"train/{k}": v for k, v in flatten(rec).items()})
        for line in metrics.lines():
            log({f"metrics/{k}": v for k, v in flatten(json.loads(line)).items()})
        state.update(global_step=gstep, train_pos=train.done(), metrics_pos=metrics.done())
        save_state(state_path, state)
        if a.no_follow or ended:
            break
        time.sleep(a.poll)
    run.finish()
    state["finished_global_step"] = gstep
    save_state(state_path, state)
    print(f"wandb_bridge: logged {logged} records from {a.run_dir} (W&B run {state['id']}, global_step {gstep})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
