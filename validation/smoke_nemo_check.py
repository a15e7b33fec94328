"""The NeMo smoke run's report and checks (validation/smoke_nemo.sh): ``python smoke_nemo_check.py DIR``.

Reads the runs in DIR (``aligned``, ``stock``, ``lazy``, ``off``, ``fault``, ``resume``;
``dp1``/``dp1_lazy`` when present), prints the alignment report and the losses, and exits 1 listing
every check that does not hold. The tests feed it made-up runs to show each check fails when it
should.
"""

import csv
import glob
import json
import math
import os
import sys
from collections import defaultdict

from nemo_fp8_align.core.telemetry import read_records, record_problems

PP, VP = 2, 2  # the smoke config's shape, not what the telemetry happens to contain
STEPS = 3  # trainer.max_steps of every run
SAVED_AT = 2  # 'aligned' saves NeMo's checkpoint at the validation after this step; 'resume'
#               starts from it
RESUMING = "Resuming training from checkpoint:"  # NeMo's exp_manager (check_resume)
UNLAUNCHED = "without the schedule's all-gather launches"  # the aligner's warning


class Checks:
    def __init__(self, out):
        self.out = out
        self.errors = []

    def path(self, *parts):
        return os.path.join(self.out, *parts)

    # ------------------------------------------------------------------ inputs
    def loss_report(self, name):
        """The example's LossReport rows ({"step", "loss"}), or None where the run wrote none."""
        report = self.path(name, "loss.jsonl")
        if not os.path.exists(report):
            return None
        with open(report, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    def losses(self, name):
        """Per-step training losses: the example's LossReport, or the CSV logger's rows."""
        report = self.loss_report(name)
        if report is not None:
            return [r["loss"] for r in report]
        rows = self.logger_rows(name)
        if rows is not None:
            return [float(r["reduced_train_loss"]) for r in rows if r.get("reduced_train_loss")]
        self.errors.append(f"{name}: no loss report ({self.path(name, 'loss.jsonl')}) and no "
                           "logger metrics.csv")
        return []

    def step_losses(self, name):
        """{global step after the step: loss} from the example's LossReport."""
        report = self.loss_report(name)
        if report is None:
            self.errors.append(f"{name}: no loss report ({self.path(name, 'loss.jsonl')})")
            return {}
        return {r["step"]: r["loss"] for r in report}

    def log(self, name):
        path = self.path(name, "log.txt")
        return open(path, encoding="utf-8").read() if os.path.exists(path) else ""

    def logger_rows(self, name):
        paths = sorted(glob.glob(self.path(name, "exp", "**", "metrics.csv"), recursive=True))
        if not paths:
            return None
        with open(paths[0], encoding="utf-8", newline="") as f:
            return list(csv.DictReader(f))

    def records(self, name):
        return read_records(sorted(glob.glob(self.path(name, "telemetry.rank*.jsonl"))))

    # ------------------------------------------------------------------ checks
    def alignment(self, name, dp_ranks, policy="aligned", want_steps=None):
        """``want_steps``: the telemetry steps the run must cover exactly (default: >= 3)."""
        rows = self.records(name)
        report(name, rows, policy)
        steps = sorted({r["step"] for r in rows})
        if want_steps is None and len(steps) < STEPS:
            self.errors.append(f"{name}: telemetry covers {len(steps)} steps, expected >= {STEPS}")
        elif want_steps is not None and steps != list(want_steps):
            self.errors.append(f"{name}: telemetry covers steps {steps}, "
                               f"expected {list(want_steps)}")
            steps = list(want_steps)
        self.errors.extend(f"{name}: {p}" for p in record_problems(rows, policy=policy))
        seen = {(r["step"], r["chunk"], r["pp_rank"], r["dp_rank"]) for r in rows}
        expected = {(s, c, p, d) for s in steps for c in range(VP) for p in range(PP)
                    for d in dp_ranks}
        missing = sorted(expected - seen)
        if missing:
            self.errors.append(f"{name}: no transposes recorded for (step, chunk, pp rank, dp rank) "
                               f"{missing}")
        return rows

    def logged_metrics(self, name, policy="aligned"):
        """A stock run's logger rows carry the plugin's metrics, gathered over both pipeline
        ranks, for every training step: slot skew 0 under aligned, PP-1 under lazy (each rank at
        its own first use), and the time from slot to valid transposes."""
        want_skew = "0.0" if policy == "aligned" else str(float(PP - 1))
        rows = [r for r in (self.logger_rows(name) or []) if r.get("reduced_train_loss")]
        if len(rows) < 3:
            self.errors.append(f"{name}: {len(rows)} training rows in the logger's metrics.csv, "
                               "expected >= 3")
        for r in rows:
            where = f"{name}: logger step {r.get('step')}"
            if r.get("fp8_align/records") != str(float(PP * VP)):
                self.errors.append(f"{where}: fp8_align/records={r.get('fp8_align/records')!r}, "
                                   f"expected {float(PP * VP)} (chunks x pipeline ranks)")
            for c in range(VP):
                skew = r.get(f"fp8_align/chunk{c}/slot_skew")
                if skew != want_skew:
                    self.errors.append(f"{where}: fp8_align/chunk{c}/slot_skew={skew!r}, expected "
                                       f"{want_skew} under {policy}")
                timed = ("transpose_ms", "slot_to_valid_ms") if policy == "aligned" else \
                    ("slot_to_valid_ms",)
                for key in timed:
                    if not r.get(f"fp8_align/chunk{c}/{key}"):
                        self.errors.append(f"{where}: no fp8_align/chunk{c}/{key}")
        if rows:
            print(f"\nLogger row of run '{name}', last step: " + ", ".join(
                f"{k}={v}" for k, v in rows[-1].items() if k.startswith("fp8_align/") and v))

    def attached_once(self, name, line):
        """The plugin said where it attached, once (global rank 0), in the run's log."""
        text = self.log(name)
        if text.count(line) != 1:
            self.errors.append(f"{name}: {text.count(line)} lines with {line!r} in "
                               f"{self.path(name, 'log.txt')}, expected 1")

    def equal_losses(self, name, baseline):
        a, b = self.losses(name), self.losses(baseline)
        if len(a) < 3 or not all(math.isfinite(x) for x in a):
            self.errors.append(f"{name}: {len(a)} finite step losses reported, expected >= 3")
        elif a != b:
            self.errors.append(f"losses differ between run '{name}' and the baseline run "
                               f"'{baseline}': {a} vs {b}")

    def resumed(self, name, saved, baseline):
        """Run ``name`` started a new process from the checkpoint ``saved`` wrote at step
        SAVED_AT (NeMo's exp_manager resume) and trained the steps after it: their losses equal
        the uninterrupted ``baseline``'s bit for bit, and its telemetry passes the same checks
        (one record per step, chunk and rank: no hook doubled by the restore), placed exactly
        as ``saved`` placed those steps."""
        if not os.path.isdir(self.path(name)):
            self.errors.append(f"{name}: no resumed run in {self.out} (validation/smoke_nemo.sh "
                               f"resumes from the checkpoint '{saved}' saves at step {SAVED_AT})")
            return
        log = self.log(name)
        resuming = [line for line in log.splitlines() if RESUMING in line]
        if not resuming or not all(f"step={SAVED_AT}-" in line for line in resuming):
            self.errors.append(f"{name}: NeMo did not resume from the step-{SAVED_AT} checkpoint "
                               f"(lines with {RESUMING!r}: {resuming})")
        got = self.step_losses(name)
        want = {s: v for s, v in self.step_losses(baseline).items() if s > SAVED_AT}
        after = list(range(SAVED_AT + 1, STEPS + 1))
        if sorted(got) != after:
            self.errors.append(f"{name}: losses reported for steps {sorted(got)}, expected {after} "
                               f"(resumed after step {SAVED_AT})")
        elif got != want:
            self.errors.append(f"resumed losses differ from the uninterrupted run '{baseline}': "
                               f"{got} vs {want}")
        rows = self.alignment(name, dp_ranks=(0, 1), want_steps=range(SAVED_AT, STEPS))
        before = [r for r in self.records(saved) if r["step"] >= SAVED_AT]
        if placement(rows) != placement(before):
            self.errors.append(f"{name}: the resumed steps' transposes are placed differently "
                               f"from the same steps of the uninterrupted run '{saved}'")
        # NeMo 2.3.3 launches the first step after a load like any other (fwd_bwd_step binds
        # param_sync_func; nothing turns the pre-hooks off): the aligner must not have seen
        # training forwards without launches (Megatron-LM's first step after a load).
        print(f"\nResumed run '{name}': {len(resuming)} resume line(s) {resuming[:1]}; forwards "
              f"without launches reported: {log.count(UNLAUNCHED)} warning line(s)")

    def fault_detected(self, name, baseline):
        a, b = self.losses(name), self.losses(baseline)
        if len(a) < 3:
            self.errors.append(f"{name}: {len(a)} step losses reported, expected >= 3")
        elif a == b:
            self.errors.append(f"negative control: run '{name}' (transposes built without waiting "
                               f"for the all-gather) has the same losses as '{baseline}': the "
                               "loss comparison cannot catch a stale transpose")


def report(name, rows, policy):
    steps = sorted({r["step"] for r in rows})
    print("\nAlignment report, run '%s' (policy=%s, PP=%d, VP=%d, DP ranks %s, %d steps, "
          "backend %s)" % (name, policy, PP, VP, sorted({r["dp_rank"] for r in rows}),
                           len(steps), rows[0]["backend"] if rows else "?"))
    print("%-6s %-12s %-28s %-22s %s" % ("chunk", "aligned slot", "slot per pp rank (all steps)",
                                         "transposes per step", "after all-gather"))
    for c in sorted({r["chunk"] for r in rows}):
        mine = [r for r in rows if r["chunk"] == c]
        ranks = sorted({r["pp_rank"] for r in mine})
        slots = {p: sorted({r["slot"] for r in mine if r["pp_rank"] == p}) for p in ranks}
        per_step = defaultdict(int)
        for r in mine:
            per_step[r["step"]] += r["transposed"]
        print("%-6d %-12s %-28s %-22s %s" % (
            c, sorted({r["aligned_slot"] for r in mine}),
            " ".join(f"r{p}:{s}" for p, s in slots.items()),
            " ".join(str(per_step[s]) for s in steps), all(r["after_all_gather"] for r in mine)))


def placement(rows):
    return sorted((r["step"], r["chunk"], r["pp_rank"], r["dp_rank"], r["vmid"], r["slot"],
                   r["transposed"]) for r in rows)


def main(out):
    c = Checks(out)
    aligned = c.alignment("aligned", dp_ranks=(0, 1))
    stock = c.alignment("stock", dp_ranks=(0, 1))
    if placement(aligned) != placement(stock):
        c.errors.append("the stock-flow run (entry-point callback) placed transposes differently "
                        "from the mixin run")
    c.logged_metrics("stock")
    c.attached_once("stock", "aligned FP8 transposes attached (entry point")
    c.alignment("lazy", dp_ranks=(0, 1), policy="lazy")
    c.logged_metrics("lazy", policy="lazy")
    c.attached_once("lazy", "lazy FP8 transposes attached (entry point")
    if c.records("off"):
        c.errors.append("off: plugin disabled but telemetry was written")
    print()
    for name in ("aligned", "stock", "lazy", "off", "fault"):
        print("losses  %-8s %s" % (name + ":", c.losses(name)))
    if os.path.isdir(c.path("resume")):
        print("losses  resume:   %s (by step)" % c.step_losses("resume"))
    for name in ("aligned", "stock", "lazy"):
        c.equal_losses(name, "off")  # 'aligned' saved its checkpoint after step SAVED_AT
    c.fault_detected("fault", "off")
    c.resumed("resume", saved="aligned", baseline="off")
    if os.path.isdir(c.path("dp1")):
        c.alignment("dp1", dp_ranks=(0,))  # PP=2 DP=1
        c.alignment("dp1_lazy", dp_ranks=(0,), policy="lazy")
        print("losses  dp1:      %s\nlosses  dp1_lazy: %s" % (c.losses("dp1"), c.losses("dp1_lazy")))
        c.equal_losses("dp1", "dp1_lazy")
    if c.errors:
        print("\nsmoke_nemo: FAILED")
        for e in c.errors:
            print("  - " + e)
        return 1
    print("\nsmoke_nemo: OK (mixin and stock flow + entry point: every chunk's transposes at its "
          "aligned slot on every pipeline and data-parallel rank, once per step, after its "
          "all-gather; lazy at each rank's first use; losses identical with the plugin off, also "
          f"after saving a checkpoint at step {SAVED_AT} and in a new process resumed from it; "
          "the fault run's differ)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2 or not os.path.isdir(sys.argv[1]):
        raise SystemExit("usage: python validation/smoke_nemo_check.py SMOKE_DIR (a directory)")
    sys.exit(main(sys.argv[1]))
