"""deploy/: manifests rendered and validated offline, names checked against a live runtime.

* `kubectl kustomize deploy/` renders; built-in kinds validate against Kubernetes' schemas
  (`kubernetes-validate`, strict: unknown fields are errors); KEDA ScaledObjects validate against
  KEDA's published CRD schema (tests/data/deploy, unknown fields rejected as kubectl's strict
  field validation would);
* every agent and model of deploy/config.yaml has a ScaledObject whose nats-jetstream trigger names
  the stream and durable consumer the runtime really creates — read back from a live server's
  `/jsz?consumers=true`, whose lag is checked against the real backlog during a batch;
* deploy/compose.yaml validates against the Compose specification's JSON schema;
* the Dockerfile's build steps run as far as this machine allows (no container daemon here):
  its COPY list is copied into a fresh context, its `pip install .` is built there as a wheel,
  and the entry point runs from it. `docker build` itself, `useradd` and the final stage are not run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from gym_runtime.config import load_config
from gym_runtime.ops.nats_server import EmbeddedServer
from gym_runtime.transport.subjects import Subjects
from tests.helpers import REPO, cli, node_ports, read_jsonl, write_jsonl

DEPLOY = REPO / "deploy"
DATA = REPO / "tests" / "data" / "deploy"
K8S_VERSION = "1.32"


def deploy_config() -> Any:
    return load_config(DEPLOY / "config.yaml")


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (Debian: kubectl / kubernetes-client); cannot render deploy/")
    res = subprocess.run([kubectl, "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_builtin_kinds_validate_against_kubernetes_schemas(rendered: list[dict[str, Any]]) -> None:
    import kubernetes_validate

    kinds = sorted({d["kind"] for d in rendered})
    assert kinds == ["ConfigMap", "Deployment", "Namespace", "PodDisruptionBudget", "ScaledObject"]
    for doc in rendered:
        if doc["apiVersion"].startswith("keda.sh/"):
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)  # raises on any error
    for name, dep in by_kind(rendered, "Deployment").items():
        pod = dep["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] >= 120, name
        assert pod["securityContext"]["runAsNonRoot"] is True
        worker = next(c for c in pod["containers"] if c["name"] == "worker")
        assert "livenessProbe" in worker and "readinessProbe" in worker, name
        assert dep["metadata"]["namespace"] == "gym"
    assert set(by_kind(rendered, "PodDisruptionBudget")) == set(by_kind(rendered, "Deployment"))


def test_misspelt_field_is_caught_by_the_validation() -> None:
    """The validation above can fail: a typo in a Deployment is an error."""
    import kubernetes_validate

    doc = yaml.safe_load((DEPLOY / "k8s" / "pdb.yaml").read_text().split("---")[0])
    doc["spec"]["maxUnavailble"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def strict(schema: Any) -> Any:
    """An OpenAPI object schema that rejects unknown fields (what kubectl's strict validation does)."""
    if isinstance(schema, dict):
        out = {k: strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes")}
        if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def keda_validator() -> jsonschema.Validator:
    crd = yaml.safe_load((DATA / "keda.sh_scaledobjects.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    return jsonschema.Draft7Validator(strict(version["schema"]["openAPIV3Schema"]))


def test_scaled_objects_validate_against_kedas_crd(rendered: list[dict[str, Any]]) -> None:
    validator = keda_validator()
    scaled = by_kind(rendered, "ScaledObject")
    assert scaled
    for name, so in scaled.items():
        errors = [e.message for e in validator.iter_errors(so)]
        assert not errors, (name, errors)
        assert so["spec"]["scaleTargetRef"]["name"] in by_kind(rendered, "Deployment")
    bad = json.loads(json.dumps(scaled["gym-agents"]))
    bad["spec"]["triggers"][0]["metdata"] = bad["spec"]["triggers"][0].pop("metadata")
    assert list(validator.iter_errors(bad)), "a misspelt trigger key must fail validation"


def triggers(rendered: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Deployment name -> its ScaledObject's first trigger."""
    return {
        so["spec"]["scaleTargetRef"]["name"]: so["spec"]["triggers"][0]
        for so in by_kind(rendered, "ScaledObject").values()
    }


def role_of(dep: dict[str, Any]) -> str:
    args = next(c for c in dep["spec"]["template"]["spec"]["containers"] if c["name"] == "worker")["args"]
    return args[args.index("--only") + 1]


def test_every_role_has_a_scaler_naming_the_runtimes_stream_and_consumer(rendered: list[dict[str, Any]]) -> None:
    cfg = deploy_config()
    names = Subjects(cfg.namespace)
    deployments = by_kind(rendered, "Deployment")
    trig = triggers(rendered)
    roles = {role_of(d): n for n, d in deployments.items()}
    # each Deployment starts every entry of its role that the mounted config declares: no name baked in
    assert set(roles) == {"agents", "models", "resources"}
    for role, dep in roles.items():
        t = trig[dep]
        if role == "resources":  # a queue group has no consumer: scale on the sessions asked of it, the lag of
            # the agents that open sessions on it, per its concurrency (placement.backlog's signal)
            [name] = cfg.resources  # KEDA reads one consumer: the config's one resource entry
            using = [a for a, e in cfg.agents.items() if e.resource == name]
            assert t["type"] == "nats-jetstream" and t["metadata"]["consumer"] in {f"agent_{a}" for a in using}
            assert int(t["metadata"]["lagThreshold"]) == cfg.resources[name].concurrency
            assert t["metadata"]["stream"] == names.tasks_stream
            continue
        kind = "task" if role == "agents" else "model"
        [name] = cfg.agents if role == "agents" else cfg.models  # KEDA reads one consumer: the config's one entry
        assert t["type"] == "nats-jetstream"
        assert (t["metadata"]["stream"], t["metadata"]["consumer"]) == (
            names.stream(kind),
            Subjects.durable(kind, name),
        )
        assert t["metadata"]["account"] == "$G"


def jsz(monitor_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{monitor_url}/jsz?acc=$G&consumers=true&config=true", timeout=5) as r:
        return json.loads(r.read())


def streams_of(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    acc = next(a for a in data["account_details"] if a["name"] == "$G")
    return {s["name"]: s for s in acc.get("stream_detail") or []}


def test_scaler_lag_from_live_jsz_matches_the_real_backlog(rendered: list[dict[str, Any]], tmp_path: Path) -> None:
    """Run deploy/config.yaml's workers against a real server and read /jsz as KEDA does."""
    srv = EmbeddedServer(store_dir=str(tmp_path / "js"), http_port=0)
    srv.start()
    worker = None
    err_path = tmp_path / "start.err"
    err = err_path.open("w")
    try:
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gym_runtime.cli",
                "start",
                str(DEPLOY / "config.yaml"),
                "--nats",
                srv.url,
                "--in-process",
                "--set",
                "jetstream.replicas=1",
                "--set",
                "models.policy.delay_s=0.1",
                "--set",
                "agents.weather_agent.concurrency=4",
                "--set",  # the file's 20GB per stream is reserved on disk: a CI box may lack it
                "jetstream.tasks_max_bytes=1GB",
                "--set",
                "jetstream.results_max_bytes=1GB",
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        assert worker.stdout is not None and "ready" in worker.stdout.readline(), err_path.read_text()[-2000:]
        base = read_jsonl(REPO / "resources/weather/data/example.jsonl")
        n = 120
        tasks = write_jsonl(tmp_path / "tasks.jsonl", [base[i % len(base)] for i in range(n)])
        # the workers' config (tasks carry its fingerprint; another config's would be refused)
        res = cli(
            "publish",
            str(DEPLOY / "config.yaml"),
            "-i",
            str(tasks),
            "--nats",
            srv.url,
            "--batch",
            "keda",
            "--set",
            "jetstream.replicas=1",
            "--set",
            "models.policy.delay_s=0.1",
            "--set",
            "jetstream.tasks_max_bytes=1GB",
            "--set",
            "jetstream.results_max_bytes=1GB",
        )
        assert res.returncode == 0, res.stderr
        trig = {t["metadata"]["consumer"]: t["metadata"] for t in triggers(rendered).values() if t["type"] != "cpu"}
        samples = 0
        deadline = time.monotonic() + 60

        def results_stored() -> int:
            s = streams_of(jsz(srv.monitor_url)).get("GYM_RESULTS_weather_agent")
            return int(s["state"]["messages"]) if s else 0

        while time.monotonic() < deadline:
            before = results_stored()
            streams = streams_of(jsz(srv.monitor_url))
            after = results_stored()
            for consumer, meta in trig.items():  # what each scaler names exists, on the stream it names
                found = [c["name"] for c in streams[meta["stream"]].get("consumer_detail") or []]
                assert consumer in found, (meta["stream"], found)
            tasks_stream = streams["GYM_TASKS"]
            agent = next(
                c for c in tasks_stream["consumer_detail"] if c["name"] == trig["agent_weather_agent"]["consumer"]
            )
            stored = (
                streams["GYM_RESULTS_weather_agent"]["state"]["messages"]
                if "GYM_RESULTS_weather_agent" in streams
                else 0
            )
            queued = tasks_stream["state"]["messages"]  # a work queue keeps a task until it is acked
            if stored >= n:
                break
            # the lag the scaler reads, plus what is in flight, is the queue's backlog (a task acked while
            # /jsz is assembled may already be gone from one side only: at most one per slot) ...
            assert queued - 4 <= agent["num_pending"] + agent["num_ack_pending"] <= queued
            # ... and the backlog is what was published and not finished (a result stored just before its task's
            # ack may count on both sides, at most one per slot), read between two counts of the results: /jsz
            # reads its streams one by one, and on a loaded machine a slot finished two rollouts in between
            assert queued + after >= n and queued + before <= n + 4, (before, queued, after)
            if agent["num_pending"] > 0:
                samples += 1
            time.sleep(0.2)
        assert samples >= 3, "no moment with lag to scale on was observed mid-batch"
        assert stored >= n
    finally:
        if worker is not None:
            worker.send_signal(signal.SIGTERM)
            worker.wait(30)
        err.close()
        srv.stop()


def test_compose_file_validates_against_the_compose_spec() -> None:
    schema = json.loads((DATA / "compose_spec.json").read_text())
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    validator = jsonschema.Draft201909Validator(schema)  # the schema's own $schema (draft 2019-09)
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors, errors
    services = compose["services"]
    nats = [s for s in services if s.startswith("nats")]
    assert len(nats) == 3
    for s in nats:
        cmd = services[s]["command"]
        assert cmd[cmd.index("--routes") + 1] == "nats://nats1:6222,nats://nats2:6222,nats://nats3:6222"
    only = {
        svc["command"][svc["command"].index("--only") + 1]
        for svc in services.values()
        if "command" in svc and "--only" in svc["command"] and not svc.get("profiles")
    }
    # the sandbox pools' service is opt-in (a config with a ``sandboxes`` section: ``--profile sandboxes``)
    assert services["sandboxes"]["profiles"] == ["sandboxes"] and "sandboxes" in services["sandboxes"]["command"]
    assert only == {"agents", "models", "resources"}  # what the mounted config declares, no entry's name
    assert services["jaeger"]["profiles"] == ["tracing"]
    bad = json.loads(json.dumps(compose))
    bad["services"]["agents"]["restrat"] = "always"
    assert list(validator.iter_errors(bad)), "a misspelt service key must fail validation"


RECIPES = [
    "compose.yaml",
    "compose.host.yaml",
    "k8s/agents.yaml",
    "k8s/resources.yaml",
    "k8s/models.yaml",
    "slurm/gym-runtime.sbatch",
]


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_starts_the_roles_its_config_declares_not_an_entry_by_name(recipe: str) -> None:
    """Issue 67: `--only agents.weather_agent` restart-looped on any other config; a recipe names roles."""
    text = (DEPLOY / recipe).read_text()
    starts = re.findall(r"--only\W+([\w.]+)", text)
    assert starts, recipe
    assert all("." not in s for s in starts), (recipe, starts)
    probes = re.findall(r"--role\W+([\w.]+)", text)
    assert all("." not in p for p in probes), (recipe, probes)


def test_deploy_config_loads_with_a_cluster_url_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GYM_NATS", "nats://a:4222,nats://b:4222")
    cfg = deploy_config()
    from gym_runtime.transport.connect import server_list

    assert server_list(cfg.nats) == ["nats://a:4222", "nats://b:4222"]
    assert cfg.jetstream.replicas == 3


def dockerfile_steps() -> list[tuple[str, str]]:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    return [(m.group(1), m.group(2).strip()) for m in re.finditer(r"^([A-Z]+)\s+(.*)$", text, re.M)]


def test_dockerfile_build_steps_run_here(tmp_path: Path) -> None:
    steps = dockerfile_steps()
    assert ("USER", "10001:10001") in steps  # non-root
    assert ("ENTRYPOINT", '["gym-runtime"]') in steps
    context = tmp_path / "src"
    context.mkdir()
    for op, arg in steps:
        if op == "COPY" and not arg.startswith("--from"):
            *sources, _dest = arg.split()
            for s in sources:
                src = REPO / s
                if src.is_dir():
                    shutil.copytree(src, context / s, ignore=shutil.ignore_patterns("__pycache__", "tests"))
                else:
                    shutil.copy(src, context / s)
    run = next(arg for op, arg in steps if op == "RUN" and "pip install" in arg)
    assert '".${EXTRAS:+[${EXTRAS}]}"' in run
    # The RUN step's install, as pip does it in the image (isolated build: setuptools from the
    # index), from the copied context only; dependencies are not downloaded (--no-deps).
    wheels = tmp_path / "wheels"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(context)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if res.returncode != 0 and ("NewConnectionError" in res.stderr or "No matching distribution" in res.stderr):
        pytest.skip("pip cannot reach a package index for the isolated build (setuptools)")
    assert res.returncode == 0, res.stderr[-3000:]
    wheel = next(wheels.glob("gym_runtime-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for must in (
        "gym_runtime/cli/__init__.py",
        "gym_runtime/resources/weather/config.yaml",
        "gym_runtime/agents/simple.py",
        "gym_runtime/models/scripted.py",
    ):
        assert must in names, must
    assert (
        "gym-runtime = gym_runtime.cli:main"
        in zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    )
    target = tmp_path / "site"
    res = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    # the image's entry point, from the installed wheel (dependencies from this environment)
    env = {**os.environ, "PYTHONPATH": str(target)}
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, gym_runtime.cli as c; print(c.__file__); sys.argv=['gym-runtime','start','--help']; c.main()",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert str(target) in res.stdout and "--only ROLE.NAME" in res.stdout, res.stdout + res.stderr


# ------------------------------------------------------------------------------------------------ Slurm

SBATCH = REPO / "deploy/slurm/gym-runtime.sbatch"


def sbatch_dry_run(env: dict[str, str], *args: str) -> list[tuple[str, str, list[str]]]:
    """The recipe's command lines, from its own arrays: (where: on|here, node, argv) in the order it runs them."""
    res = subprocess.run(
        ["bash", str(SBATCH), *args],
        env={**os.environ, **env, "GYM_DRY_RUN": "1"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    out = []
    for line in res.stdout.splitlines():
        head, _, cmd = line.partition(": ")
        where, _, node = head.partition(" ")
        out.append((where, node, shlex.split(cmd)))
    return out


def test_slurm_header_gpu_node_arithmetic_matches_the_script() -> None:
    header = SBATCH.read_text()
    assert "GYM_GPU_NODES [number of nodes - 4, at least 1" in header
    for nodes, gpus in ((4, 1), (5, 1), (6, 2), (8, 4)):
        names = " ".join(f"n{i}" for i in range(nodes))
        lines = sbatch_dry_run({"GYM_NODES": names, "GYM_VENV": "/v"}, "c.yaml", "in.jsonl", "out.jsonl")
        model_nodes = {node for where, node, argv in lines if where == "on" and "models.policy" in " ".join(argv)}
        assert len(model_nodes) == max(1, nodes - 4), (nodes, model_nodes)
        assert len(model_nodes) == gpus


def test_secured_slurm_recipe_runs_on_a_secured_local_cluster(tmp_path: Path) -> None:
    """Every command the recipe's dry run prints, executed as printed: three secured NATS nodes (loopback
    addresses 127.0.0.2-4 stand in for node names), health, model and agent/resource workers, publish, collect."""
    auth = tmp_path / "auth"  # empty: the first server writes it, naming every NATS node
    keys = ("GYM_NATS_PORT", "GYM_ROUTE_PORT", "GYM_MONITOR_PORT")
    ports = dict(zip(keys, node_ports(len(keys)), strict=True))  # nodes start one by one: no client takes one meanwhile
    env = {
        "GYM_NODES": "127.0.0.2 127.0.0.3 127.0.0.4 127.0.0.5",
        "GYM_VENV": str(Path(sys.executable).parent.parent),
        "GYM_SECURE_DIR": str(auth),
        "GYM_STORE": str(tmp_path / "store"),
        "GYM_LISTEN": "node",  # three servers on one machine: each on its own address
        "GYM_VLLM": "0",  # the config's scripted policy: no vLLM server to start
        "GYM_REPLICAS": "1",
        "GYM_BATCH": "slurm1",
        **{k: str(v) for k, v in ports.items()},
    }
    out = tmp_path / "out.jsonl"
    # deploy/config.yaml, its 20GB stream limits lowered: the secured servers reserve them (three times on one disk)
    config = tmp_path / "config.yaml"
    config.write_text((REPO / "deploy/config.yaml").read_text().replace("_max_bytes: 20GB", "_max_bytes: 1GB"))
    lines = sbatch_dry_run(env, str(config), "resources/weather/data/example.jsonl", str(out))
    clients = [argv for _, _, argv in lines if argv[1] != "server"]
    assert clients and all(argv[-2:] == ["--auth-dir", str(auth)] for argv in clients), clients
    assert sum(1 for _, _, argv in lines if argv[1] == "server" and "--secure" in argv) == 3

    steps: list[subprocess.Popen[str]] = []
    logs: list[Path] = []
    said: list[str] = []  # the stderr of the batch script's own commands
    try:
        servers = 0
        for where, _node, argv in lines:
            if where == "on":  # an srun step: in the background, as srun ... & runs it
                log = tmp_path / f"step{len(steps)}.log"
                logs.append(log)
                steps.append(subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=log.open("w")))
                if argv[1] == "server":
                    servers += 1
                    deadline = time.monotonic() + 30
                    while servers == 1 and not (auth / "server.pem").exists():  # as the script waits
                        assert time.monotonic() < deadline, log.read_text()
                        time.sleep(0.2)
                continue
            if argv[1] == "health":  # the script retries until healthy
                deadline = time.monotonic() + 90
                while (res := subprocess.run(argv, cwd=REPO, capture_output=True, text=True)).returncode != 0:
                    assert time.monotonic() < deadline, (res.stderr, [p.read_text()[-1500:] for p in logs])
                    time.sleep(1)
                continue
            res = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=240)
            assert res.returncode == 0, (argv[1], res.stderr[-3000:], [p.read_text()[-1500:] for p in logs])
            said.append(res.stderr)
        rows = read_jsonl(out)
        assert len(rows) == 5 and all(r["reward"] == 1.0 for r in rows)
        # the servers provisioned what the clients' `--set jetstream.replicas=3` asks: no client found less
        said += [p.read_text() for p in logs]
        assert not [line for text in said for line in text.splitlines() if "stream.replicas_differ" in line]
        jsz = f"http://127.0.0.4:{ports['GYM_MONITOR_PORT']}/jsz?streams=true&config=true"
        with urllib.request.urlopen(jsz, timeout=5) as r:
            streams = [s for a in json.loads(r.read())["account_details"] for s in a.get("stream_detail") or []]
        assert len(streams) >= 6 and {s["config"]["num_replicas"] for s in streams} == {3}, streams
        limits = {s["name"]: s["config"]["max_bytes"] for s in streams}
        assert limits["GYM_TASKS"] == limits["GYM_RESULTS_weather_agent"] == 1024**3, (
            limits
        )  # the config's, not the defaults
    finally:
        for p in steps:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in steps:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
