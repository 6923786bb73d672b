#!/bin/bash
# a partial reward: one quarter per check passed (data.csv intact, count, sum, max), in reward.json
# (run as [verifier] user: nobody)
mkdir -p /logs/verifier
python3 - <<'PY'
import json, os

expected = [4, 8, 15, 16, 23, 42]
checks = []
try:
    checks.append([int(x) for x in open("/app/data.csv").read().split()] == expected)
except Exception:
    checks.append(False)
try:
    stats = json.load(open(os.environ["STATS_PATH"]))
except Exception:
    stats = {}
checks.append(stats.get("count") == len(expected))
checks.append(stats.get("sum") == sum(expected))
checks.append(stats.get("max") == max(expected))
passed = sum(checks) if os.getuid() != 0 else 0  # nothing for a verifier that runs as root
json.dump({"reward": passed / len(checks), "checks_passed": passed}, open("/logs/verifier/reward.json", "w"))
PY
