"""Run one bench command and append its output, with the machine it ran on, to a results log.

    python bench/record.py [--out FILE] -- python bench/experiments.py --only attention_parts --shapes 1x4096
    python bench/record.py -- env MALLOC_MMAP_THRESHOLD_=1073741824 python bench/profile_forward.py --dtype bfloat16

The figures README quotes from the experiments and the profiler (scripts that print, not results folders)
come from this log, so each can be traced to the command, the CPU (model, ISA flags), the commit and the
load it ran under. Default log: `bench/results/<cpu folder>/experiments.md` (one per CPU kind, like
`run_all.py`'s folders). The command runs from the repository root; its exit status is returned, and a
failed command is logged as failed, with the last lines of its stderr.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time

from common import cpu_flags, cpu_tag, machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="log to append to (default: bench/results/<cpu folder>/experiments.md)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given: python bench/record.py -- python bench/experiments.py ...")
    out = args.out or os.path.join(ROOT, "bench", "results", cpu_tag(), "experiments.md")
    info = machine()
    flags = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in cpu_flags())
    start = time.time()
    # "python" means this interpreter (the venv's), also after `env VAR=value`; the log shows the command as given
    runnable = [sys.executable if word == "python" else word for word in command]
    run = subprocess.run(runnable, cwd=ROOT, capture_output=True, text=True)
    minutes = (time.time() - start) / 60
    sys.stdout.write(run.stdout)
    sys.stderr.write(run.stderr)
    status = "" if run.returncode == 0 else f" — **failed, exit {run.returncode}**"
    lines = [
        f"## `{shlex.join(command)}`{status}",
        "",
        f"{info['date (UTC)']} UTC, {minutes:.1f} min; CPU {info['CPU']}, {info['CPU family/model']}; lscpu flags: {flags};",
        f"torch {info['torch']} ({info['torch threads']} threads), transformers {info['transformers']},"
        f" roformer_rope {info['roformer_rope']}; load average at start {info['load average at start']},"
        f" at end {' '.join(f'{x:.2f}' for x in os.getloadavg())}; ISA limits: {info['ISA limits']}",
        "",
        "```",
        run.stdout.rstrip(),
        "```",
        "",
    ]
    if run.returncode != 0:  # why it failed: the end of stderr (progress bars and warnings come before it)
        tail = [line.rstrip() for line in run.stderr.replace("\r", "\n").splitlines() if line.strip()][-20:]
        lines[-1:-1] = ["", "stderr (last lines):", "", "```", *tail, "```"]
    new = not os.path.exists(out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "a") as f:
        if new:
            f.write(
                f"# Experiment and profiler logs: {cpu_tag()}\n\nAppended by `python bench/record.py -- <command>`.\n\n"
            )
        f.write("\n".join(lines) + "\n")
    print(f"[logged to {os.path.relpath(out, ROOT)}]", file=sys.stderr)
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
