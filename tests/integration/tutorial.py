#!/usr/bin/env python3
"""Runs a tutorial of docs/tutorials/ as a reader would: writes its files into an empty
directory and runs its commands there.

  tutorial.py TUTORIAL.md WORK_DIR

Every fenced code block must be preceded by a marker line:
  <!-- file: NAME -->   the block is (the next part of) file NAME; parts are joined in order
  <!-- run -->          the block is shell commands, run in order with `sh -e` in WORK_DIR
A block without a marker fails the test, so that no snippet goes untested. The commands see
the environment of the test (CTest sets DEEPCLONE_PREFIX, where deepclone is installed).
"""
import os
import re
import shutil
import subprocess
import sys


def main():
    md, work = sys.argv[1], sys.argv[2]
    lines = open(md, encoding="utf-8").read().split("\n")
    files, runs, marker, i = {}, [], None, 0
    while i < len(lines):
        line = lines[i]
        m = re.match(r"\s*<!--\s*(file:\s*(\S+)|run)\s*-->\s*$", line)
        if m:
            marker = ("file", m.group(2)) if m.group(2) else ("run", None)
            i += 1
            continue
        if line.startswith("```"):
            start = i
            i += 1
            body = []
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            if i == len(lines):
                sys.exit(f"{md}:{start + 1}: unterminated code block")
            if marker is None:
                sys.exit(f"{md}:{start + 1}: code block without a <!-- file: NAME --> or <!-- run --> marker")
            if marker[0] == "file":
                files.setdefault(marker[1], []).append("\n".join(body))
            else:
                runs.append((start + 1, "\n".join(body)))
            marker = None
        elif line.strip() and marker is not None:
            sys.exit(f"{md}:{i + 1}: a marker must be followed directly by its code block")
        i += 1
    if not files or not runs:
        sys.exit(f"{md}: no files or no commands")

    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    for name, parts in files.items():
        path = os.path.join(work, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n\n".join(parts) + "\n")
        print(f"tutorial: wrote {name} ({len(parts)} snippet(s))")
    for line, script in runs:
        print(f"tutorial: running the commands at {os.path.basename(md)}:{line}", flush=True)
        rc = subprocess.run(["sh", "-ec", script], cwd=work).returncode
        if rc != 0:
            sys.exit(f"{md}:{line}: the commands failed with exit status {rc}")
    print(f"tutorial: {os.path.basename(md)}: {len(files)} file(s) built, {len(runs)} command block(s) ran")


if __name__ == "__main__":
    main()
