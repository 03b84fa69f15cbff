#!/usr/bin/env python3
"""Checks deepclone_bench's output is well-formed: every line of results.jsonl parses and
carries the required fields with sensible types, table.md has one row per line, chart.svg
is XML. No timing assertions. With --run-smoke, first runs $BENCH on a tiny configuration
into $OUT (the bench-smoke CTest test)."""
import json, os, subprocess, sys
import xml.etree.ElementTree as ET

REQUIRED = {"model": str, "strategy": str, "pipeline": str, "reconstruction": str, "sources": int, "clones": int,
            "state_bytes": int, "iteration_s": (int, float, type(None)), "overhead_s": (int, float, type(None)),
            "standby_s": (int, float), "readiness_s": (int, float), "first_layer_s": (int, float),
            "bound_s": (int, float), "link": str, "verified": bool}

def check(out):
    lines = [l for l in open(os.path.join(out, "results.jsonl")) if l.strip()]
    assert lines, "no measurements"
    for l in lines:
        r = json.loads(l)
        for k, t in REQUIRED.items():
            assert k in r, f"missing {k} in {l}"
            assert isinstance(r[k], t), f"{k} has type {type(r[k]).__name__} in {l}"
        assert r["readiness_s"] >= 0 and r["bound_s"] > 0 and r["state_bytes"] > 0
        assert r["verified"], f"clone state differs from the source's: {l}"
    rows = [l for l in open(os.path.join(out, "table.md")) if l.startswith("| ") and not l.startswith("| link")]
    assert len(rows) == len(lines), f"{len(rows)} table rows for {len(lines)} measurements"
    ET.parse(os.path.join(out, "chart.svg"))
    assert os.path.getsize(os.path.join(out, "scaling.md")) > 0
    print(f"ok: {len(lines)} measurements")

if __name__ == "__main__":
    if "--run-smoke" in sys.argv:
        out = os.environ["OUT"]
        subprocess.run([os.environ["BENCH"], "--model", "mobilenet_v3_large", "--scale", "0.05", "--sources", "2", "--clones", "2",
                        "--iteration", "0.02", "--warmup", "3", "--link-gbs", "2", "--storage-gbs", "4", "--quick", "--out", out],
                       check=True, stdout=subprocess.DEVNULL)
        check(out)
    else:
        check(sys.argv[1] if len(sys.argv) > 1 else ".")
