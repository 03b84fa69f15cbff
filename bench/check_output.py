#!/usr/bin/env python3
"""Checks the benchmarks' output is well-formed: every JSON line parses and carries the
required fields with sensible types, every clone verified, the tables have one row per
measurement (or per strategy and link), and the chart is drawn (bench/plot.py, when
matplotlib is installed). No timing assertions.
  --run-smoke       first runs $BENCH (deepclone_bench, in process) on a tiny configuration into $OUT
  --run-smoke-mpi   first runs $MPIRUN $BENCH (deepclone_bench_mpi, 2 sources + 2 clones) likewise
  --run-smoke-partition  first runs $BENCH (deepclone_partition_bench) on bert_large at 1/64
These are the bench-smoke CTest tests."""
import importlib.util, json, os, shlex, subprocess, sys

NUM = (int, float)
OPT = (int, float, type(None))
REQUIRED = {"model": str, "strategy": str, "pipeline": str, "reconstruction": str, "sources": int, "clones": int,
            "state_bytes": int, "iteration_s": OPT, "overhead_s": OPT, "standby_s": OPT, "readiness_s": NUM,
            "first_layer_s": OPT, "bound_s": NUM, "link": str, "verified": bool, "predicted_readiness_s": OPT}
MPI_REQUIRED = {"round": int, "breakdown": dict, "overhead_by_iteration": list, "loadavg": list, "kind": str}
HERE = os.path.dirname(os.path.abspath(__file__))


def lines(path):
    return [json.loads(l) for l in open(path) if l.strip()]


def check_record(r, extra={}):
    for k, t in {**REQUIRED, **extra}.items():
        assert k in r, f"missing {k} in {r}"
        assert isinstance(r[k], t), f"{k} has type {type(r[k]).__name__} in {r}"
    assert r["readiness_s"] > 0 and r["bound_s"] > 0 and r["state_bytes"] > 0
    assert r["verified"], f"clone state differs from the source's: {r['strategy']} {r['link']}"
    if r["strategy"].startswith("deepclone"):
        assert isinstance(r.get("report"), dict) and r["report"]["clones"], "deepclone row without its report"


def table_rows(path):
    """A markdown file's table rows: its "| " lines but each table's header (the line before "|---")."""
    ls = open(path).readlines()
    return [l for i, l in enumerate(ls) if l.startswith("| ") and not (i + 1 < len(ls) and ls[i + 1].startswith("|---"))]


def python_with_matplotlib():
    """This interpreter if it has matplotlib, else the system's (Debian's python3-matplotlib)."""
    if importlib.util.find_spec("matplotlib") is not None:
        return sys.executable
    for py in ("/usr/bin/python3",):
        if os.path.exists(py) and subprocess.run([py, "-c", "import matplotlib"], capture_output=True).returncode == 0:
            return py
    return None


def chart(out):
    py = python_with_matplotlib()
    if py is None:
        print("matplotlib missing: chart not drawn")
        return
    subprocess.run([py, os.path.join(HERE, "plot.py"), out], check=True, stdout=subprocess.DEVNULL)
    assert os.path.getsize(os.path.join(out, "chart.png")) > 1000


def check(out):
    rs = lines(os.path.join(out, "results.jsonl"))
    assert rs, "no measurements"
    for r in rs:
        check_record(r)
    assert len(table_rows(os.path.join(out, "table.md"))) == len(rs)
    assert os.path.getsize(os.path.join(out, "scaling.md")) > 0
    chart(out)
    print(f"ok: {len(rs)} measurements")


def check_mpi(out, rounds):
    rs = lines(os.path.join(out, "results.jsonl"))
    assert rs, "no measurements"
    for r in rs:
        check_record(r, MPI_REQUIRED)
        bd = r["breakdown"]
        keys = ["request_to_decision_s", "k_updates_s", "final_to_ready_s"] if r["kind"] == "deepclone" else ["request_to_boundary_s", "transfer_s"]
        for k in keys:
            assert isinstance(bd.get(k), NUM), f"breakdown {k} missing in {r['strategy']}"
    assert {r["round"] for r in rs} == set(range(rounds))
    summ = lines(os.path.join(out, "summary.jsonl"))
    assert len(summ) == len({(r["link"], r["strategy"]) for r in rs})
    for s in summ:
        assert s["rounds"] == rounds and s["verified"]
        assert s["readiness_s"]["min"] <= s["readiness_s"]["median"] <= s["readiness_s"]["max"]
    assert len(table_rows(os.path.join(out, "table.md"))) == len(summ)
    assert len(table_rows(os.path.join(out, "breakdown.md"))) == len(summ)
    for f in ("scaling.md", "targets.md", "rounds.md"):
        assert os.path.getsize(os.path.join(out, f)) > 0
    chart(out)
    print(f"ok: {len(rs)} runs, {len(summ)} strategies x links")


PARTITION_REQUIRED = {"layout": str, "link": str, "round": int, "state_bytes": int, "held_bytes": list, "sent_bytes": list,
                      "expected_sent_bytes": list, "received_bytes": list, "bandwidth_Bps": NUM, "bound_s": NUM,
                      "readiness_s": NUM, "send_calls_s": NUM, "plan_s": NUM, "verified": bool, "loadavg": list}


CHECKPOINT_REQUIRED = {"layout": str, "strategy": str, "round": int, "state_bytes": int, "file_bytes": list, "save_s": NUM,
                       "readiness_s": NUM, "cold_read": str, "verified": bool, "loadavg": list}


def check_checkpoint_row(r):
    for k, t in CHECKPOINT_REQUIRED.items():
        assert isinstance(r.get(k), t), f"{k} missing or of the wrong type in {r}"
    assert r["verified"], f"a clone byte differs after the checkpoint's load: {r['layout']} round {r['round']}"
    assert 0 < r["save_s"] < r["readiness_s"], "a load starts after the save"
    assert sum(r["file_bytes"]) == r["state_bytes"], "the checkpoint holds every byte of the state once"


def check_partition(out, rounds):
    rows = lines(os.path.join(out, "partition.jsonl"))
    assert rows, "no measurements"
    rs = [r for r in rows if "strategy" not in r]
    for r in rs:
        for k, t in PARTITION_REQUIRED.items():
            assert isinstance(r.get(k), t), f"{k} missing or of the wrong type in {r}"
        assert r["verified"], f"a clone byte differs from its source's: {r['layout']} {r['link']} round {r['round']}"
        assert r["readiness_s"] > 0 and r["bound_s"] > 0
        for sent, want in zip(r["sent_bytes"], r["expected_sent_bytes"]):  # the plan splits every region over its holders
            assert abs(sent - want) <= 0.01 * want, f"{r['layout']}: a source sends {sent} bytes, expected {want}"
        copies = 1 if r.get("sharing", "none") == "exchange" else len(r["received_bytes"])  # exchange: the clones forward the rest
        assert sum(r["received_bytes"]) == copies * r["state_bytes"], "replicated clones receive the whole state from the sources"
    peers = [r for r in rows if "strategy" in r]
    for r in peers:
        check_checkpoint_row(r)
    groups = {(r["layout"], r.get("sharing", "none"), r["link"]) for r in rs} | {(r["layout"], r["strategy"]) for r in peers}
    assert len(rows) == len(groups) * rounds
    summ = lines(os.path.join(out, "partition_summary.jsonl"))
    assert len(summ) == len(groups) and all(s["verified"] and s["rounds"] == rounds for s in summ)
    assert len(table_rows(os.path.join(out, "partition_table.md"))) == len(summ)
    print(f"ok: {len(rows)} rounds, {len(summ)} layouts x links or peers")


if __name__ == "__main__":
    if "--run-smoke" in sys.argv:
        out = os.environ["OUT"]
        subprocess.run([os.environ["BENCH"], "--model", "mobilenet_v3_large", "--scale", "0.05", "--sources", "2", "--clones", "2",
                        "--iteration", "0.02", "--warmup", "3", "--link-gbs", "2", "--storage-gbs", "4", "--quick", "--out", out],
                       check=True, stdout=subprocess.DEVNULL)
        check(out)
    elif "--run-smoke-mpi" in sys.argv:
        out = os.environ["OUT"]
        subprocess.run(shlex.split(os.environ["MPIRUN"]) + [os.environ["BENCH"], "--model", "mobilenet_v3_large", "--scale", "0.05",
                        "--sources", "2", "--clones", "2", "--iteration", "0.02", "--warmup", "3", "--rounds", "2", "--link-gbs", "2",
                        "--storage-gbs", "4", "--quick", "--out", out], check=True, stdout=subprocess.DEVNULL)
        check_mpi(out, 2)
    elif "--run-smoke-partition" in sys.argv:
        out = os.environ["OUT"]
        subprocess.run([os.environ["BENCH"], "--divisor", "64", "--link-gbs", "32", "--rounds", "2", "--out", out],
                       check=True, stdout=subprocess.DEVNULL)
        check_partition(out, 2)
    else:
        d = sys.argv[1] if len(sys.argv) > 1 else "."
        if os.path.exists(os.path.join(d, "partition.jsonl")):
            check_partition(d, max(r["round"] for r in lines(os.path.join(d, "partition.jsonl"))) + 1)
        elif os.path.exists(os.path.join(d, "summary.jsonl")):
            check_mpi(d, max(r["round"] for r in lines(os.path.join(d, "results.jsonl"))) + 1)
        else:
            check(d)
