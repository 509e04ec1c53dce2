"""Run the fuzz targets of tests/fuzz_targets.py for longer than CI does, and print executions
and coverage per target.

    python bench/fuzz.py [SECONDS_PER_TARGET] [--targets gguf,chat,...] [--seed N] [--keep DIR]

Each target runs under atheris (libFuzzer) in its own process, starting from the committed
corpus in tests/fuzz_corpus/<target>/, which is not modified; the inputs it finds are kept under
--keep (default: a temporary folder). A crash, hang or out-of-memory input is written there and
its path printed; the exit status is 1 when any target failed. `cov` counts the instrumented
edges (npllama's module under test; jinja2 too for chat) that the run reached, `ft` libFuzzer's
finer features.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import fuzz_targets as ft  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("seconds", nargs="?", type=int, default=300, help="seconds per target (default 300)")
    ap.add_argument("--targets", default=",".join(ft.CAMPAIGN_TARGETS),
                    help=f"comma-separated, of {', '.join(ft.CAMPAIGN_TARGETS)}")
    ap.add_argument("--seed", type=int, default=0, help="libFuzzer's random seed")
    ap.add_argument("--keep", type=Path, help="folder for the grown corpora and any crashing inputs")
    args = ap.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    unknown = sorted(set(targets) - set(ft.CAMPAIGN_TARGETS))
    if unknown:
        ap.error(f"unknown targets {', '.join(unknown)}; choose from {', '.join(ft.CAMPAIGN_TARGETS)}")
    work = args.keep or Path(tempfile.mkdtemp(prefix="npllama-fuzz-"))
    print(f"{'target':10} {'seconds':>8} {'executions':>11} {'exec/s':>8} {'cov':>6} {'ft':>6} {'corpus':>7}  result")
    failed = False
    for target in targets:
        r = ft.run_campaign(target, args.seconds, work_dir=work, seed=args.seed)
        rate = r.executions / r.seconds if r.executions else 0
        if r.crash is not None or r.returncode != 0:
            failed = True
            found = sorted((work / f"artifacts-{target}").iterdir())
            result = f"{r.crash_kind or 'exit ' + str(r.returncode)}: {found[0] if found else '(no artifact)'}"
        else:
            result = "ok"
        print(f"{target:10} {r.seconds:8.0f} {r.executions or 0:11d} {rate:8.0f} {r.coverage or 0:6d} "
              f"{r.features or 0:6d} {r.corpus_size or 0:7d}  {result}", flush=True)
        if result != "ok":
            print(r.output[-4000:], file=sys.stderr)
    print(f"corpora and artifacts: {work}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
