#!/usr/bin/env python3
"""Compare the junit files of run.sh: which tests pass in `plain` but fail/error in a CO2 mode.

Usage: python scripts/trainer_suite/compare.py --results DIR [--all]
  reads DIR/plain.xml, DIR/identity.xml, DIR/defaults.xml (written by run.sh)
  prints the counts per mode, then, for identity and defaults, every test that passed in plain
  but failed or errored there, with the first meaningful error line (exception type + message).
  --all also prints the status of every test in every mode, and tests that fail in plain but pass
  in a CO2 mode.
"""

import argparse
import os
import re
import sys
import xml.etree.ElementTree as ET

MODES = ("plain", "identity", "defaults")


def first_error_line(node):
    """The exception line of a <failure>/<error>: pytest's first 'E   ...' line, else the message."""
    text = node.text or ""
    e_lines = [ln[1:].strip() for ln in text.splitlines() if re.match(r"^E\s", ln)]
    # prefer a line that looks like 'SomeError: message'
    for ln in e_lines:
        if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning|Failed|failed)\b", ln):
            return ln
    if e_lines:
        return e_lines[0]
    msg = (node.get("message") or "").strip()
    if msg:
        return msg.splitlines()[0]
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "(no message)"


def load(path):
    """{test id: (status, error line)}; status in passed/failed/error/skipped."""
    out = {}
    root = ET.parse(path).getroot()
    for tc in root.iter("testcase"):
        tid = f"{tc.get('classname', '')}::{tc.get('name')}"
        status, line = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error"):
                # an error in teardown after a failure: keep the first problem
                if status in ("passed", "skipped"):
                    status, line = ("failed" if child.tag == "failure" else "error"), first_error_line(child)
            elif child.tag == "skipped" and status == "passed":
                status, line = "skipped", (child.get("message") or "").splitlines()[0] if child.get("message") else ""
        out[tid] = (status, line)
    return out


def short(tid):
    # classname is e.g. tests.trainer.test_trainer.TrainerLoggingTest (unittest classes) or
    # tests.trainer.test_x (module-level pytest functions): keep the module and the class
    cls, name = tid.split("::", 1)
    parts = cls.split(".")
    mods = [i for i, p in enumerate(parts) if p.startswith("test_")]
    keep = parts[mods[-1] :] if mods else parts[-1:]
    return f"{'.'.join(keep)}::{name}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--all", action="store_true")
    a = ap.parse_args()

    runs = {}
    for m in MODES:
        p = os.path.join(a.results, f"{m}.xml")
        if os.path.exists(p):
            runs[m] = load(p)
        else:
            print(f"(missing {p})", file=sys.stderr)
    if "plain" not in runs:
        sys.exit("plain.xml is needed as the baseline")

    print("counts (passed / failed / error / skipped):")
    for m, r in runs.items():
        c = {s: sum(1 for st, _ in r.values() if st == s) for s in ("passed", "failed", "error", "skipped")}
        print(f"  {m:9s} {c['passed']:3d} / {c['failed']:3d} / {c['error']:3d} / {c['skipped']:3d}   ({len(r)} tests)")

    plain = runs["plain"]
    for m in ("identity", "defaults"):
        if m not in runs:
            continue
        r = runs[m]
        failing = ("failed", "error", "missing")
        broken = [t for t, (st, _) in plain.items() if st == "passed" and r.get(t, ("missing", ""))[0] in failing]
        print(f"\n== passed in plain, failed/error in {m}: {len(broken)}")
        for t in sorted(broken):
            st, line = r.get(t, ("missing", "not run"))
            print(f"  [{st}] {short(t)}\n        {line}")
        if a.all:
            fixed = [t for t, (st, _) in plain.items() if st in ("failed", "error") and r.get(t, ("",))[0] == "passed"]
            print(f"-- failed/error in plain, passed in {m}: {len(fixed)}")
            for t in sorted(fixed):
                print(f"  {short(t)}")

    if a.all:
        print("\n== status per test")
        names = sorted(set().union(*[set(r) for r in runs.values()]))
        print("  " + "  ".join(f"{m:9s}" for m in runs) + "  test")
        for t in names:
            print("  " + "  ".join(f"{runs[m].get(t, ('-',))[0]:9s}" for m in runs) + f"  {short(t)}")
        print("\n== baseline (plain) failures/errors, for reference")
        for t in names:
            st, line = plain.get(t, ("-", ""))
            if st in ("failed", "error"):
                print(f"  [{st}] {short(t)}\n        {line}")


if __name__ == "__main__":
    main()
