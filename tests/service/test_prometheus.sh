#!/bin/sh
# `normctl stats` in its three forms after real jobs (the demo):
# the text shows per-op latency percentiles; --json is valid JSON whose
# per-op counts add up to the totals; --prometheus parses with the Prometheus
# client library's own parser (python3-prometheus-client), every metric is
# normd_*, counters end in _total, the latency histograms are cumulative and
# their +Inf bucket equals _count, and jobs by op and status add up to the
# daemon's totals. With the daemon gone, --prometheus prints normd_up 0 and
# exits 1.
. tests/service/lib.sh
PY=/usr/bin/python3
$PY -c 'import prometheus_client.parser' 2>/dev/null ||
	fail "python3-prometheus-client is missing (tests/install-deps.sh installs it)"
S="$T/n.sock"
"$B/bin/normd" --config /dev/null --device cpu --socket "$S" 2>"$T/normd.log" &
DAEMON_PID=$!
wait_socket "$S" || fail "normd did not start"
"$B/bin/normctl" --socket "$S" demo --rows 8 --cols 64 >"$T/demo.log" 2>&1 || fail "demo"

"$B/bin/normctl" --socket "$S" stats >"$T/stats.txt" || fail "normctl stats"
grep -q '^latency  *p50 [0-9]* us, p90 [0-9]* us, p99 [0-9]* us' "$T/stats.txt" ||
	fail "no latency percentiles in: $(cat "$T/stats.txt")"
grep -q '^layernorm_bwd ' "$T/stats.txt" || fail "no per-op lines"
check "normctl stats prints per-op counts and p50/p90/p99"

"$B/bin/normctl" --socket "$S" stats --json >"$T/stats.json" || fail "normctl stats --json"
"$B/bin/normctl" --socket "$S" stats --prometheus >"$T/stats.prom" || fail "--prometheus"
$PY - "$T/stats.json" "$T/stats.prom" <<'PYEOF' || fail "the stats outputs do not hold together"
import json, sys
from prometheus_client.parser import text_string_to_metric_families

stats = json.load(open(sys.argv[1]))
ops = stats["ops"]
assert sum(o["jobs_by_status"]["OK"] for o in ops.values()) == stats["jobs_ok"], "json ok"
assert sum(sum(o["jobs_by_status"].values()) for o in ops.values()) == \
    stats["jobs_ok"] + stats["jobs_failed"], "json jobs"
assert sum(sum(o["latency_buckets"]) for o in ops.values()) == stats["jobs_ok"], "json hist"
assert stats["devices"] and stats["devices"][0]["index"] == -1, "json devices"

text = open(sys.argv[2]).read()
families = {f.name: f for f in text_string_to_metric_families(text)}
for name, fam in families.items():
    assert name.startswith("normd_"), name
    assert fam.documentation, "no HELP for " + name
    for s in fam.samples:
        assert s.name.startswith("normd_"), s.name
        if fam.type == "counter":
            assert s.name.endswith("_total"), s.name
for want in ("normd_up", "normd_jobs", "normd_job_latency_seconds", "normd_replies",
             "normd_clients", "normd_device_jobs"):
    assert want in families, "missing " + want
assert families["normd_up"].samples[0].value == 1
jobs = [s for s in families["normd_jobs"].samples if s.name == "normd_jobs_total"]
assert sum(s.value for s in jobs) == stats["jobs_ok"] + stats["jobs_failed"], "prom jobs"
assert sum(s.value for s in jobs if s.labels["status"] == "ok") == stats["jobs_ok"]
hist = families["normd_job_latency_seconds"]
assert hist.type == "histogram"
by_op = {}
for s in hist.samples:
    by_op.setdefault(s.labels["op"], []).append(s)
count_all = 0
for op, samples in by_op.items():
    buckets = [s for s in samples if s.name.endswith("_bucket")]
    values = [s.value for s in buckets]
    assert values == sorted(values), op + " buckets not cumulative"
    assert buckets[-1].labels["le"] == "+Inf"
    count = [s.value for s in samples if s.name.endswith("_count")][0]
    assert buckets[-1].value == count, op
    count_all += count
assert count_all == stats["jobs_ok"], "histogram counts"
print("prometheus: %d families, %d jobs in the histograms" % (len(families), count_all))
PYEOF
check "--json and --prometheus agree with each other and the Prometheus parser"

kill -TERM "$DAEMON_PID"
wait_exit "$DAEMON_PID"
[ "$WAIT_RC" -eq 0 ] || fail "normd exited with $WAIT_RC"
"$B/bin/normctl" --socket "$S" stats --prometheus >"$T/down.prom" 2>/dev/null &&
	fail "--prometheus exits 0 with the daemon gone"
grep -qx 'normd_up 0' "$T/down.prom" || fail "no normd_up 0 with the daemon gone"
check "with the daemon gone: normd_up 0, exit 1"
