"""Static checks of deploy/ (no Docker, no cluster): the Kubernetes manifests validate against
the Kubernetes JSON schema, the pieces point at each other (selectors, Secrets, ports, HPA,
PDB, drain timeouts), every `fd ...` command line parses with the real CLI parser, and the
small `python -c` hooks (engine drain, engine heartbeat) do what they claim against fakeredis.
"""

from __future__ import annotations

import base64
import importlib
import re
from pathlib import Path

import pytest

from fd.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose"
DOCKER = DEPLOY / "docker"
K8S_VERSION = "1.30"  # the schema the manifests are held to (kubernetes-validate ships 1.25+)


def _need(module: str, package: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        pytest.fail(
            f"{package} is needed to validate deploy/: pip install {package} (or pip install -e '.[test]')",
            pytrace=False,
        )


@pytest.fixture(scope="module")
def yaml():
    return _need("yaml", "pyyaml")


@pytest.fixture(scope="module")
def kv():
    return _need("kubernetes_validate", "kubernetes-validate")


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def docs(yaml) -> list[dict]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for d in yaml.safe_load_all(path.read_text()):
            if d:
                d["__file__"] = path.name
                out.append(d)
    assert out, "no manifests under deploy/k8s"
    return out


def _of(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def _named(docs, kind, name):
    found = [d for d in _of(docs, kind) if d["metadata"]["name"] == name]
    assert found, f"no {kind} named {name!r} in deploy/k8s"
    return found[0]


def _workloads(docs):
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def _pod_labels(w) -> dict:
    return w["spec"]["template"]["metadata"]["labels"]


def _containers(w) -> list[dict]:
    return w["spec"]["template"]["spec"]["containers"]


def _matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _secret_data(s: dict) -> dict[str, str]:
    data = dict(s.get("stringData") or {})
    for k, v in (s.get("data") or {}).items():
        data[k] = base64.b64decode(v).decode()
    return data


def _env_value(docs, e: dict, pod_name: str) -> str:
    if "value" in e:
        return str(e["value"])
    ref = e["valueFrom"]
    if "configMapKeyRef" in ref:
        r = ref["configMapKeyRef"]
        return _named(docs, "ConfigMap", r["name"])["data"][r["key"]]
    if "secretKeyRef" in ref:
        r = ref["secretKeyRef"]
        return _secret_data(_named(docs, "Secret", r["name"]))[r["key"]]
    if "fieldRef" in ref:
        assert ref["fieldRef"]["fieldPath"] == "metadata.name", ref
        return pod_name
    raise AssertionError(f"unhandled env source {ref}")


def _expand(docs, container: dict, pod_name: str) -> list[str]:
    """The container's command line as the kubelet runs it: $(VAR) from its env expanded."""
    env = {e["name"]: _env_value(docs, e, pod_name) for e in container.get("env", [])}
    argv = list(container.get("command", [])) + list(container.get("args", []))

    def sub(m):
        assert m.group(1) in env, f"{container['name']}: $({m.group(1)}) is not in its env"
        return env[m.group(1)]

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, a) for a in argv]


def _fd_args(argv: list[str]):
    assert argv and argv[0] == "fd", f"not an fd command line: {argv}"
    try:
        return build_parser().parse_args(argv[1:])
    except SystemExit:
        pytest.fail(
            f"`{' '.join(argv)}` does not parse with fd.cli.main.build_parser() (see the argparse error above)",
            pytrace=False,
        )


def _python_c(argv: list[str]) -> str | None:
    if len(argv) >= 3 and re.fullmatch(r"python3?", argv[0]) and argv[1] == "-c":
        return argv[2]
    return None


def _run_snippet(code: str, env: dict[str, str], monkeypatch, server) -> int:
    """Run a `python -c` hook with redis.Redis.from_url pointed at a fakeredis server."""
    import fakeredis
    import redis

    monkeypatch.setattr(
        redis.Redis, "from_url", classmethod(lambda cls, url, **kw: fakeredis.FakeRedis(server=server))
    )
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        exec(compile(code, "<python -c>", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def _duration_s(text: str) -> float:
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", str(text))
    assert parts and "".join(n + u for n, u in parts) == str(text), f"bad duration {text!r}"
    scale = {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}
    return sum(float(n) * scale[u] for n, u in parts)


POD = "fd-engine-7c9d5b6f4-x2x9z"


# --------------------------------------------------------------------------- Kubernetes


def test_k8s_manifests_validate_against_schema(docs, kv):
    errors = []
    for d in docs:
        doc = {k: v for k, v in d.items() if k != "__file__"}
        try:
            kv.validate(doc, K8S_VERSION, strict=True)
        except kv.ValidationError as e:
            errors.append(
                f"{d['__file__']}: {d['kind']}/{d['metadata'].get('name')}: {str(e).splitlines()[0]}"
            )
        except kv.SchemaNotFoundError:
            errors.append(
                f"{d['__file__']}: no Kubernetes {K8S_VERSION} schema for {d['apiVersion']} {d['kind']}"
            )
    assert not errors, "\n".join(errors)


def test_kustomization_lists_every_manifest_and_image(docs, yaml):
    k = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(k["resources"]) == files
    assert k.get("namespace") == _of(docs, "Namespace")[0]["metadata"]["name"]
    names = {i["name"] for i in k.get("images", [])}
    for w in _workloads(docs):
        for c in _containers(w):
            base = c["image"].rsplit(":", 1)[0]
            if base.startswith("fd"):
                assert base in names, f"image {c['image']} is not in kustomization images"


def test_selectors_match_pod_labels(docs):
    for w in _workloads(docs):
        assert _matches(w["spec"]["selector"]["matchLabels"], _pod_labels(w)), w["metadata"]["name"]
    for svc in _of(docs, "Service"):
        sel = svc["spec"]["selector"]
        targets = [w for w in _workloads(docs) if _matches(sel, _pod_labels(w))]
        assert len(targets) == 1, f"Service {svc['metadata']['name']} selects {len(targets)} workloads"
        ports = {p.get("name") for c in _containers(targets[0]) for p in c.get("ports", [])}
        ports |= {p["containerPort"] for c in _containers(targets[0]) for p in c.get("ports", [])}
        for p in svc["spec"]["ports"]:
            assert p.get("targetPort", p["port"]) in ports, f"{svc['metadata']['name']}: {p}"
    for pdb in _of(docs, "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert [w for w in _workloads(docs) if _matches(sel, _pod_labels(w))], (
            f"PDB {pdb['metadata']['name']} selects no pods"
        )
    pdb_targets = {
        w["metadata"]["name"]
        for w in _workloads(docs)
        for pdb in _of(docs, "PodDisruptionBudget")
        if _matches(pdb["spec"]["selector"]["matchLabels"], _pod_labels(w))
    }
    assert {"fd-api", "fd-engine"} <= pdb_targets


def test_statefulset_redis_has_aof_pvc_and_headless_service(docs):
    sts = _named(docs, "StatefulSet", "fd-redis")
    svc = _named(docs, "Service", sts["spec"]["serviceName"])
    assert svc["spec"].get("clusterIP") == "None"
    argv = " ".join(_expand(docs, _containers(sts)[0], "fd-redis-0"))
    assert "--appendonly yes" in argv and "--maxmemory-policy noeviction" in argv
    claims = {t["metadata"]["name"] for t in sts["spec"]["volumeClaimTemplates"]}
    mounts = {m["name"]: m["mountPath"] for m in _containers(sts)[0]["volumeMounts"]}
    assert mounts.get("data") == "/data" and "data" in claims
    # the URL the fd pods use carries the password Redis is started with
    secret = _secret_data(_named(docs, "Secret", "fd-redis"))
    assert f":{secret['password']}@" in secret["url"]


def test_hpa_targets_a_deployment_with_cpu_requests(docs):
    hpas = _of(docs, "HorizontalPodAutoscaler")
    assert hpas and all(h["apiVersion"] == "autoscaling/v2" for h in hpas)
    for h in hpas:
        ref = h["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment"
        dep = _named(docs, "Deployment", ref["name"])
        if any(m["resource"]["name"] == "cpu" for m in h["spec"]["metrics"] if m["type"] == "Resource"):
            for c in _containers(dep):
                assert "cpu" in c.get("resources", {}).get("requests", {}), (
                    f"HPA on CPU needs cpu requests on {ref['name']}/{c['name']}"
                )


def test_secret_configmap_and_pvc_references_exist(docs):
    for w in _workloads(docs):
        spec = w["spec"]["template"]["spec"]
        for c in spec["containers"] + spec.get("initContainers", []):
            for e in c.get("env", []):
                if "valueFrom" in e:
                    _env_value(docs, e, POD)  # raises KeyError / AssertionError on a dangling ref
            for src in c.get("envFrom", []):
                for kind, key in (("Secret", "secretRef"), ("ConfigMap", "configMapRef")):
                    if key in src:
                        _named(docs, kind, src[key]["name"])
        templates = {t["metadata"]["name"] for t in w["spec"].get("volumeClaimTemplates", [])}
        vols = {v["name"] for v in spec.get("volumes", [])} | templates
        for v in spec.get("volumes", []):
            if "persistentVolumeClaim" in v:
                _named(docs, "PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"])
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                assert m["name"] in vols, f"{w['metadata']['name']}: mount of unknown volume {m['name']}"


def test_fd_command_lines_parse(docs):
    seen = set()
    for w in _workloads(docs):
        for c in _containers(w):
            argv = _expand(docs, c, POD)
            if argv and argv[0] == "fd":
                seen.add(_fd_args(argv).cmd)
    assert seen == {"api", "engine"}


def test_api_listens_on_its_port_and_probes_hit_health(docs):
    dep = _named(docs, "Deployment", "fd-api")
    (c,) = _containers(dep)
    args = _fd_args(_expand(docs, c, "fd-api-x"))
    assert args.host == "0.0.0.0", "fd api binds 127.0.0.1 by default: pods need --host 0.0.0.0"
    ports = {p.get("name"): p["containerPort"] for p in c["ports"]}
    assert args.port in ports.values()
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    # /health fails while Redis is down: liveness must not use it, or an outage restarts all pods
    assert c["livenessProbe"].get("httpGet", {}).get("path") != "/health"
    for w in _workloads(docs):
        for cc in _containers(w):
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                get = cc.get(probe, {}).get("httpGet")
                if get:
                    assert get["path"] == "/health", f"{w['metadata']['name']} {probe}"
                    port = get["port"]
                    named = {p.get("name"): p["containerPort"] for p in cc["ports"]}
                    assert (named.get(port) if isinstance(port, str) else port) == args.port


def test_engine_gpu_drain_and_grace_period(docs):
    dep = _named(docs, "Deployment", "fd-engine")
    spec = dep["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    args = _fd_args(_expand(docs, c, POD))
    assert args.cmd == "engine" and args.engine_id == POD and args.device.startswith("gpu")
    assert args.model == _named(docs, "ConfigMap", "fd-config")["data"]["model-dir"]
    drain = getattr(args, "drain_timeout", None)
    assert drain is not None, "the engine must be started with --drain-timeout"
    assert spec["terminationGracePeriodSeconds"] > float(drain) + 5, (
        "terminationGracePeriodSeconds must exceed --drain-timeout (plus the preStop hook)"
    )
    for side in ("requests", "limits"):
        assert int(c["resources"][side]["nvidia.com/gpu"]) == 1
    assert "preStop" in c["lifecycle"]
    assert "readinessProbe" in c and "livenessProbe" not in c


def test_engine_prestop_publishes_a_drain_for_its_own_id(docs, monkeypatch):
    import fakeredis

    from fd.control.bus import Bus  # noqa: F401  (the hook must not need more than fd/control/)
    from fd.control.events import Drain, decode
    from fd.control.keys import Keys

    (c,) = _containers(_named(docs, "Deployment", "fd-engine"))
    code = _python_c(c["lifecycle"]["preStop"]["exec"]["command"])
    assert code, "preStop should be a `python3 -c` drain publisher"
    server = fakeredis.FakeServer()
    assert (
        _run_snippet(code, {"FD_REDIS_URL": "redis://x:6379/0", "FD_ENGINE_ID": POD}, monkeypatch, server)
        == 0
    )
    entries = fakeredis.FakeRedis(server=server).xrange(Keys().control)
    assert len(entries) == 1
    ev = decode(entries[0][1], entries[0][0])
    assert isinstance(ev, Drain) and ev.engine == POD


def test_engine_readiness_is_its_heartbeat(docs, monkeypatch):
    import fakeredis

    from fd.control.keys import Keys

    (c,) = _containers(_named(docs, "Deployment", "fd-engine"))
    env = {"FD_REDIS_URL": "redis://x:6379/0", "FD_ENGINE_ID": POD}
    for probe in ("startupProbe", "readinessProbe"):
        code = _python_c(c[probe]["exec"]["command"])
        assert code, probe
        server = fakeredis.FakeServer()
        assert _run_snippet(code, env, monkeypatch, server) == 1, f"{probe} passes with no heartbeat"
        fakeredis.FakeRedis(server=server).hset(Keys().engine(POD), "step", "1")
        assert _run_snippet(code, env, monkeypatch, server) == 0, f"{probe} fails with a heartbeat"


# --------------------------------------------------------------------------- compose


@pytest.fixture(scope="module")
def compose(yaml) -> dict:
    return yaml.safe_load((COMPOSE / "compose.yaml").read_text())


def _services(compose, prefix):
    return {n: s for n, s in compose["services"].items() if n.startswith(prefix)}


def test_compose_services_and_dependencies(compose):
    svcs = compose["services"]
    assert {"redis", "lb"} <= set(svcs)
    assert len(_services(compose, "api")) >= 2 and len(_services(compose, "engine")) >= 2
    for name, s in svcs.items():
        deps = s.get("depends_on", {})
        for dep, cond in deps.items() if isinstance(deps, dict) else ((d, {}) for d in deps):
            assert dep in svcs, f"{name} depends on unknown service {dep}"
            assert cond.get("condition") in ("service_healthy", "service_completed_successfully"), (
                f"{name} -> {dep}: give depends_on a condition"
            )
            if cond.get("condition") == "service_healthy":
                assert "test" in svcs[dep].get("healthcheck", {}), f"{dep} has no healthcheck"
    for name, s in list(_services(compose, "api").items()) + list(_services(compose, "engine").items()):
        assert s["depends_on"]["redis"]["condition"] == "service_healthy", name
        assert "test" in s.get("healthcheck", {}), f"{name} has no healthcheck"
    for vol in (v.split(":")[0] for s in svcs.values() for v in s.get("volumes", [])):
        assert vol.startswith(".") or vol in (compose.get("volumes") or {}), f"undeclared volume {vol}"


def test_compose_redis_has_aof_on_a_volume(compose):
    r = compose["services"]["redis"]
    cmd = " ".join(r["command"])
    assert "--appendonly yes" in cmd and "--maxmemory-policy noeviction" in cmd
    assert any(v.endswith(":/data") for v in r["volumes"])


def test_compose_fd_command_lines(compose):
    ids = []
    for name, s in compose["services"].items():
        cmd = s.get("command")
        image = s.get("image", "")
        if not image.startswith("fd:"):
            continue
        args = _fd_args(["fd", *cmd])
        env = s.get("environment") or {}
        if name.startswith("api"):
            assert args.cmd == "api" and args.host == "0.0.0.0"
            assert str(args.port) in " ".join(s["healthcheck"]["test"]) and "/health" in " ".join(
                s["healthcheck"]["test"]
            )
        if name.startswith("engine"):
            assert args.cmd == "engine" and args.engine_id
            assert env.get("FD_ENGINE_ID") == args.engine_id, f"{name}: healthcheck id != --engine-id"
            ids.append(args.engine_id)
            drain = getattr(args, "drain_timeout", None)
            assert drain is not None, f"{name} must be started with --drain-timeout"
            assert _duration_s(s["stop_grace_period"]) > float(drain), (
                f"{name}: stop_grace_period must exceed --drain-timeout"
            )
        if name.startswith(("api", "engine")):
            assert env.get("FD_REDIS_URL", "").startswith("redis://redis:")
    assert len(ids) >= 2 and len(set(ids)) == len(ids), f"engine ids must be distinct: {ids}"


def test_compose_engine_healthcheck_is_its_heartbeat(compose, monkeypatch):
    import fakeredis

    from fd.control.keys import Keys

    for name, s in _services(compose, "engine").items():
        code = _python_c(s["healthcheck"]["test"][1:])
        assert code, name
        eid = s["environment"]["FD_ENGINE_ID"]
        env = {"FD_REDIS_URL": s["environment"]["FD_REDIS_URL"], "FD_ENGINE_ID": eid}
        server = fakeredis.FakeServer()
        assert _run_snippet(code, env, monkeypatch, server) == 1
        fakeredis.FakeRedis(server=server).hset(Keys().engine(eid), "step", "1")
        assert _run_snippet(code, env, monkeypatch, server) == 0


def test_nginx_upstream_is_the_api_services(compose):
    conf = (COMPOSE / "nginx.conf").read_text()
    conf = re.sub(r"#[^\n]*", "", conf)
    upstreams = dict(re.findall(r"upstream\s+(\S+)\s*\{([^}]*)\}", conf))
    assert len(upstreams) == 1
    ((name, body),) = upstreams.items()
    servers = re.findall(r"^\s*server\s+([\w.-]+):(\d+)", body, re.M)
    want = {(n, str(_fd_args(["fd", *s["command"]]).port)) for n, s in _services(compose, "api").items()}
    assert set(servers) == want
    assert re.search(rf"proxy_pass\s+http://{re.escape(name)}\s*;", conf)
    assert re.search(r"proxy_buffering\s+off\s*;", conf), "SSE needs proxy_buffering off"
    m = re.search(r"proxy_read_timeout\s+(\S+?)\s*;", conf)
    assert m and _duration_s(m.group(1)) >= 600, "long generations need a long proxy_read_timeout"
    lb = compose["services"]["lb"]
    assert any(v.startswith("./nginx.conf:") for v in lb["volumes"])
    assert set(lb["depends_on"]) == set(_services(compose, "api"))


# --------------------------------------------------------------------------- Dockerfiles


def _instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.gpu"])
def test_dockerfiles(name):
    ins = _instructions(DOCKER / name)
    ops = [op for op, _ in ins]
    get = lambda op: [r for o, r in ins if o == op]  # noqa: E731
    users = get("USER")
    assert users and users[-1].split(":")[0] not in ("0", "root"), "run as a non-root user"
    assert get("ENTRYPOINT") == ['["fd"]']
    assert "8000" in get("EXPOSE")[0].split()
    assert any("/health" in h for h in get("HEALTHCHECK"))
    import json

    cmd = json.loads(get("CMD")[-1])
    _fd_args(["fd", *cmd])
    copied = {r.split()[0] for r in get("COPY")}
    for src in copied:
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
    assert {"fd", "pyproject.toml"} <= copied
    installs = " ".join(r for r in get("RUN") if "pip install" in r)
    if name == "Dockerfile":
        assert get("FROM")[0].startswith("python:3.11-slim")
        assert "'.[cpu]'" in installs
    else:
        assert "paddle" in (get("ARG")[0] + get("FROM")[0])
        assert "[cpu]" not in installs and "pip install ." in installs
    assert ops.index("USER") > max(i for i, (o, r) in enumerate(ins) if o == "RUN")
