"""Deployment files checked against the code: deployment/ (kustomize), Dockerfile.ubi, the Makefile.

Neither a container engine nor a cluster exists where these tests run, so nothing is built or
applied. Instead every model overlay, every patch, the KServe runtime, the monitoring and storage
manifests are rendered with kustomize (tests/deployment_tools.py finds or fetches the tool), and
each rendered container's environment (the image's ENV under the manifest's) goes through the
launcher's own click parsing and resolve_config, then through the shard's and the router's parsing
of the command lines the launcher would give them. Ports, probe paths, metrics targets, volumes
and security settings are compared with the code; the Dockerfile is parsed and linted.
"""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from unittest import mock

import click
import pytest
import yaml

from launcher import cli as launcher_cli
from launcher.config import (
    CACHE_ENV_VARS,
    LaunchConfig,
    LaunchError,
    LaunchFlags,
    resolve_config,
    router_command,
    router_env,
    shard_command,
    shard_env,
)
from launcher.supervisor import SHARD_GRACE_S
from router import cli as router_cli
from router.config import DEFAULT_GRPC_PORT, DEFAULT_PORT
from router.core.metrics import METRICS
from router.http.http_app import PROBE_PATHS
from router.http.http_server import READY_WINDOW_S
from tests.deployment_tools import (
    REPO,
    Renderer,
    ToolUnavailable,
    dockerignore_excludes,
    env_of,
    env_values,
    find_renderer,
    mounted_from,
    mounts,
    only,
    parse_dockerfile,
    quantity,
    server,
    substitute,
)
from text_generation_server import cli as shard_cli

DEPLOYMENT = REPO / "deployment"
MODELS = sorted(p.parent.name for p in (DEPLOYMENT / "models").glob("*/kustomization.yaml"))
PATCHES = DEPLOYMENT / "base" / "patches"
# Each patch on top of base alone; mTLS needs the server certificate of tls.yaml.
PATCH_SETS = [[p] for p in sorted(PATCHES.rglob("*.yaml")) if p.name != "mtls.yaml"]
PATCH_SETS.append([PATCHES / "tls.yaml", PATCHES / "mtls.yaml"])
DOCKERFILE = parse_dockerfile((REPO / "Dockerfile.ubi").read_text())
RELEASE_ENV = env_of(DOCKERFILE.stages["base"]) | env_of(DOCKERFILE.stages["release"])
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

# Env the launcher reads besides its flags (each must appear in its source, checked below).
LAUNCHER_OTHER_ENV = {
    *CACHE_ENV_VARS,
    "HF_HOME",
    "NUM_GPUS",
    "CUDA_VISIBLE_DEVICES",
    "NVIDIA_VISIBLE_DEVICES",
    "TERMINATION_LOG_PATH",
    "PYTORCH_CUDA_ALLOC_CONF",
}
# TGIS env that a patch sets ahead of the feature: no code reads it yet (deployment/README.md).
RESERVED_ENV: set[str] = set()  # names the manifests set before the code reads them


def envvars(command: click.Command) -> set[str]:
    names: set[str] = set()
    for param in command.params:
        names.update([param.envvar] if isinstance(param.envvar, str) else param.envvar or [])
    return names


SERVE = shard_cli.app.commands["serve"]
# The launcher's flags and other env, plus the shard's flags it passes through in the environment
# it gives the shards (not RANK and WORLD_SIZE: it sets those per shard).
KNOWN_ENV = envvars(launcher_cli.main) | LAUNCHER_OTHER_ENV | (envvars(SERVE) - {"RANK", "WORLD_SIZE"})


ROUTES = set(PROBE_PATHS)  # served by the HTTP app (tests/router/test_http_doors.py checks it)


@pytest.fixture(scope="session")
def renderer() -> Renderer:
    try:
        tool = find_renderer()
    except ToolUnavailable as exc:
        pytest.skip(f"no kustomize renderer: {exc}")
    return tool


@pytest.fixture(scope="session")
def rendered(renderer: Renderer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Every renderable directory: models/<name>, patch:<files>, kserve, monitoring, storage."""
    dirs = {f"models/{m}": DEPLOYMENT / "models" / m for m in MODELS}
    dirs |= {name: DEPLOYMENT / name for name in ("kserve", "monitoring", "storage", "inference-gateway")}
    for patch_set in PATCH_SETS:
        overlay = tmp_path_factory.mktemp("overlay")
        rel = [os.path.relpath(p, overlay) for p in patch_set]
        (overlay / "kustomization.yaml").write_text(
            yaml.safe_dump(
                {
                    "resources": [os.path.relpath(DEPLOYMENT / "base", overlay)],
                    "patches": [{"path": r} for r in rel],
                }
            )
        )
        dirs["patch:" + "+".join(str(p.relative_to(PATCHES)) for p in patch_set)] = overlay
    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(dirs, pool.map(renderer.render, dirs.values()), strict=True))


def parse(command: click.Command, argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    """The parameters `command` parses from argv and exactly this environment."""
    try:
        with mock.patch.dict(os.environ, env, clear=True):
            return command.make_context(command.name or "command", list(argv)).params
    except click.ClickException as exc:
        raise AssertionError(f"{command.name} rejects its flags: {exc.format_message()}") from None


def resolve(env: dict[str, str], args: list[str], tmp_path: Path) -> LaunchConfig:
    """What the launcher resolves for this container env and args (LaunchError if it refuses),
    with a stand-in model directory and readable stand-ins for the TLS files."""
    model = tmp_path / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text('{"max_position_embeddings": 4096}')
    env = {**RELEASE_ENV, **env, "MODEL_NAME": str(model)}
    args = [f"--model-name={model}" if a.startswith("--model-name") else a for a in args]
    for var in ("TLS_CERT_PATH", "TLS_KEY_PATH", "TLS_CLIENT_CA_CERT_PATH"):
        if var in env:
            (tmp_path / var).write_text("pem")
            env[var] = str(tmp_path / var)
    config = resolve_config(LaunchFlags(**parse(launcher_cli.main, args, env)), env)
    # The children the launcher would start must accept their command lines and environments.
    child_env = shard_env(config, 0, env)
    overridden = {k for k in env if k in child_env and child_env[k] != env[k] and k in KNOWN_ENV}
    assert not overridden - {"HF_HUB_OFFLINE"}, f"the launcher overrides {overridden} for the shards"
    argv = shard_command(config)
    parse(SERVE, argv[argv.index("serve") + 1 :], child_env)
    parse(router_cli.main, router_command(config, model)[1:], router_env(config, env))
    return config


def not_deployable_yet() -> set[str]:
    """Overlays (models/<name>) and patches (patch:<file>) that deployment/README.md lists between
    its not-deployable markers."""
    text = (DEPLOYMENT / "README.md").read_text()
    section = text.split("<!-- not-deployable -->")[1].split("<!-- /not-deployable -->")[0]
    models = {f"models/{m}" for m in re.findall(r"models/([\w.-]+)", section)}
    return models | {f"patch:{p}" for p in re.findall(r"patches/([\w./-]+\.yaml)", section)}


def check_hardened(pod: dict, container: dict) -> None:
    pod_sc, sc = pod.get("securityContext", {}), container.get("securityContext", {})
    assert sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert not sc.get("privileged", False)
    assert sc.get("seccompProfile", pod_sc.get("seccompProfile")) == {"type": "RuntimeDefault"}
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    resources = container["resources"]
    for what in ("cpu", "memory"):
        assert quantity(resources["requests"][what]) <= quantity(resources["limits"][what]), what


# --- kustomize: models and patches --------------------------------------------------------------


def deployments(rendered: dict[str, list[dict]]) -> list[str]:
    return [k for k in rendered if k.startswith(("models/", "patch:"))]


def test_every_overlay_and_patch_renders(rendered: dict[str, list[dict]]) -> None:
    assert len(MODELS) >= 3, MODELS
    for key in deployments(rendered):
        kinds = sorted(d["kind"] for d in rendered[key])
        assert kinds == ["Deployment", "Service"], (key, kinds)


def test_env_is_known_to_the_launcher_and_resolves(rendered: dict[str, list[dict]], tmp_path: Path) -> None:
    refused = {}
    for key in deployments(rendered):
        pod, container = server(rendered[key])
        env = env_values(container)
        unknown = set(env) - KNOWN_ENV - RESERVED_ENV
        assert not unknown, f"{key}: env vars no code reads: {sorted(unknown)}"
        try:
            config = resolve(env, container.get("args", []), tmp_path / key.replace("/", "_"))
        except LaunchError as exc:
            refused[key] = str(exc)
            continue
        assert (config.port, config.grpc_port) == (DEFAULT_PORT, DEFAULT_GRPC_PORT), key
        grace = pod["terminationGracePeriodSeconds"]
        needed = config.drain_timeout_s + launcher_cli.ROUTER_STOP_MARGIN_S + SHARD_GRACE_S
        assert grace > needed, f"{key}: grace {grace} s <= drain + router + shard stop {needed} s"
        gpus = int(container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))
        assert config.num_shard == max(gpus, 1), key
    # What the launcher refuses today is exactly what the README says cannot be deployed yet.
    assert set(refused) == not_deployable_yet(), refused


def test_env_outside_the_flags_is_read_by_the_launcher() -> None:
    source = "".join((REPO / "launcher" / name).read_text() for name in ("config.py", "cli.py"))
    for var in LAUNCHER_OTHER_ENV:
        assert f'"{var}"' in source, var
    readme = (DEPLOYMENT / "README.md").read_text()
    for var in RESERVED_ENV:
        assert var not in KNOWN_ENV, f"{var} is read now: drop it from RESERVED_ENV"
        assert re.search(rf"`{var}`[^\n]*not read yet", readme), f"README must say {var} is not read yet"


def test_ports_probes_and_volumes_match_the_code(rendered: dict[str, list[dict]]) -> None:
    for key in deployments(rendered):
        pod, container = server(rendered[key])
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"http": DEFAULT_PORT, "grpc": DEFAULT_GRPC_PORT}, key
        probes = {kind: container[f"{kind}Probe"]["httpGet"] for kind in ("startup", "readiness", "liveness")}
        assert {kind: p["path"] for kind, p in probes.items()} == {
            "startup": "/health/ready",
            "readiness": "/health/ready",
            "liveness": "/health/live",
        }, key
        assert {p["path"] for p in probes.values()} <= ROUTES
        assert all(ports.get(p["port"], p["port"]) == DEFAULT_PORT for p in probes.values()), key
        for kind in ("startup", "readiness"):  # /health/ready may wait READY_WINDOW_S for the shards
            assert container[f"{kind}Probe"]["timeoutSeconds"] > READY_WINDOW_S, (key, kind)
        annotations = only(rendered[key], "Deployment")["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/port"] == str(DEFAULT_PORT)
        assert annotations["prometheus.io/path"] in ROUTES
        check_hardened(pod, container)
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, key
        table, env = mounts(pod, container), env_values(container)
        for path in ("/tmp", RELEASE_ENV["HOME"]):
            assert "emptyDir" in table[path], (key, path)
        cache = mounted_from(env["HF_HUB_CACHE"], table)
        assert cache is not None and "persistentVolumeClaim" in cache, key
        for var in ("TLS_CERT_PATH", "TLS_KEY_PATH", "TLS_CLIENT_CA_CERT_PATH", "PREFIX_STORE_PATH"):
            if var in env:
                assert mounted_from(env[var], table) is not None, (key, var)
        if "TLS_CERT_PATH" in env:
            assert "secret" in (mounted_from(env["TLS_CERT_PATH"], table) or {}), key
        assert env.get("NUM_GPUS", "1") == str(container["resources"]["limits"].get("nvidia.com/gpu", "1"))


def test_services_and_names(rendered: dict[str, list[dict]]) -> None:
    dns_label = re.compile(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?")
    for key in deployments(rendered):
        service, deployment = only(rendered[key], "Service"), only(rendered[key], "Deployment")
        _, container = server(rendered[key])
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for port in service["spec"]["ports"]:
            assert ports[port["targetPort"]] == port["port"], (key, port)
        assert {p["name"] for p in service["spec"]["ports"]} == {"http", "grpc"}
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items(), key
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items(), key
        for name in (service["metadata"]["name"], deployment["metadata"]["name"]):
            assert dns_label.fullmatch(name), name
    selectors = [only(rendered[f"models/{m}"], "Service")["spec"]["selector"] for m in MODELS]
    assert len({tuple(sorted(s.items())) for s in selectors}) == len(MODELS), "model selectors overlap"


def test_monitors_scrape_the_metrics_port(rendered: dict[str, list[dict]]) -> None:
    monitor = only(rendered["monitoring"], "ServiceMonitor")
    pod_monitor = yaml.safe_load((DEPLOYMENT / "monitoring" / "pod-monitor.yaml").read_text())
    (endpoint,) = monitor["spec"]["endpoints"]
    (pod_endpoint,) = pod_monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == pod_endpoint["path"] == "/metrics" and "/metrics" in ROUTES
    for model in MODELS:
        docs = rendered[f"models/{model}"]
        service, (_, container) = only(docs, "Service"), server(docs)
        pod_labels = only(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
        assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
        assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
        (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
        (target,) = [p for p in container["ports"] if p["name"] == port["targetPort"]]
        assert target["containerPort"] == DEFAULT_PORT
        (target,) = [p for p in container["ports"] if p["name"] == pod_endpoint["port"]]
        assert target["containerPort"] == DEFAULT_PORT


# the endpoint picker's metric flags -> (the metric's type, the labels it reads)
PICKER_METRICS = {
    "total-queued-requests-metric": ("gauge", set()),
    "total-running-requests-metric": ("gauge", set()),
    "kv-cache-usage-percentage-metric": ("gauge", set()),
    "lora-info-metric": ("gauge", {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}),
    "cache-info-metric": ("gauge", {"block_size", "num_gpu_blocks"}),
}


def test_the_inference_pool_selects_a_models_pods_and_reads_our_metrics(
    rendered: dict[str, list[dict]],
) -> None:
    """The inferencepool chart's values: the pool's pods are a model overlay's, its port the one
    the OpenAI routes and /metrics answer on, and each metric the endpoint picker reads is one
    the router exports, of the protocol's type with the labels it reads; the HTTPRoute sends the
    Gateway's requests to that pool."""
    values = yaml.safe_load((DEPLOYMENT / "inference-gateway" / "inferencepool-values.yaml").read_text())
    pool = values["inferencePool"]
    docs = rendered["models/granite-8b-instruct"]
    _, container = server(docs)
    pod_labels = only(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pool["modelServers"]["matchLabels"].items() <= pod_labels.items()
    (http,) = [p for p in container["ports"] if p["name"] == "http"]
    assert [p["number"] for p in pool["targetPorts"]] == [http["containerPort"]] == [DEFAULT_PORT]
    assert "/metrics" in ROUTES
    flags = values["inferenceExtension"]["flags"]
    assert set(flags) == set(PICKER_METRICS)
    exported = {spec.name: spec for spec in METRICS}
    for flag, (kind, labels) in PICKER_METRICS.items():
        spec = exported[flags[flag]]
        assert (spec.kind, set(spec.labels)) == (kind, labels), flag
    route = only(rendered["inference-gateway"], "HTTPRoute")
    ((backend,),) = [rule["backendRefs"] for rule in route["spec"]["rules"]]
    assert backend == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": "granite-8b-instruct",
    }


def test_kserve_runtime(rendered: dict[str, list[dict]], tmp_path: Path) -> None:
    runtime = only(rendered["kserve"], "ServingRuntime")
    (container,) = runtime["spec"]["containers"]
    assert container["command"] == ["text-generation-launcher"]
    assert "text-generation-launcher" in PYPROJECT["project"]["scripts"]
    assert set(env_values(container)) <= KNOWN_ENV
    config = resolve(env_values(container), container["args"], tmp_path)
    assert container["ports"] == [{"name": "h2c", "containerPort": config.grpc_port, "protocol": "TCP"}]
    assert (config.port, config.grpc_port) == (DEFAULT_PORT, DEFAULT_GRPC_PORT)
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/port"] == str(config.port)
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/path"] in ROUTES
    check_hardened({}, container)
    example = yaml.safe_load((DEPLOYMENT / "kserve" / "inference-service.yaml").read_text())
    model = example["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {f["name"] for f in runtime["spec"]["supportedModelFormats"]}


def test_download_job_fills_the_cache_the_server_reads(rendered: dict[str, list[dict]]) -> None:
    pvc = only(rendered["storage"], "PersistentVolumeClaim")
    job = only(rendered["storage"], "Job")
    pod = job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    check_hardened(pod, container)
    command = container["command"]
    assert command[0] in PYPROJECT["project"]["scripts"] and command[1] in shard_cli.app.commands
    env = env_values(container)
    download = shard_cli.app.commands[command[1]]
    assert set(env) <= envvars(download) | {"HF_HUB_CACHE", "HF_HUB_OFFLINE", "MODEL_NAME"}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    without_secrets = {k: v for k, v in env.items() if k != "HF_TOKEN"}
    assert parse(download, args, without_secrets)["model_name"] == env["MODEL_NAME"]
    assert env["HF_HUB_OFFLINE"] == "0"
    job_volume = mounted_from(env["HF_HUB_CACHE"], mounts(pod, container))
    assert job_volume is not None
    for model in MODELS:
        served, server_container = server(rendered[f"models/{model}"])
        cache = env_values(server_container)["HF_HUB_CACHE"]
        assert cache == env["HF_HUB_CACHE"] == RELEASE_ENV["HF_HUB_CACHE"]
        volume = mounted_from(cache, mounts(served, server_container))
        assert volume is not None
        claim = volume["persistentVolumeClaim"]["claimName"]
        assert claim == job_volume["persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]


def test_deploy_model_script(renderer: Renderer, tmp_path: Path) -> None:
    script = DEPLOYMENT / "deploy_model.sh"
    assert os.access(script, os.X_OK)
    model = MODELS[0]
    fake = tmp_path / "bin" / "kubectl"  # renders with the real tool, records `apply`
    fake.parent.mkdir()
    log = tmp_path / "applied"
    render = " ".join(f'"{a}"' for a in renderer.argv)
    fake.write_text(
        "#!/usr/bin/env bash\n"
        f'if [[ "$1" == kustomize ]]; then shift; exec {render} "$@"; fi\n'
        f'echo "$*" > "{log}.args"; cat > "{log}"\n'
    )
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}"}
    if renderer.tool.endswith("kustomize"):
        env["PATH"] = f"{fake.parent}:{Path(renderer.tool).parent}:/usr/bin:/bin"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(script), *args], capture_output=True, text=True, env=env, timeout=60)

    dry = run("--dry-run", model)
    assert dry.returncode == 0, dry.stderr
    expected = renderer.render(DEPLOYMENT / "models" / model)
    assert [d for d in yaml.safe_load_all(dry.stdout) if d] == expected
    assert not log.exists()
    applied = run(f"models/{model}/", "-n", "ns")
    assert applied.returncode == 0, applied.stderr
    assert (tmp_path / "applied.args").read_text().split() == ["apply", "-n", "ns", "-f", "-"]
    assert [d for d in yaml.safe_load_all(log.read_text()) if d] == expected
    assert run().returncode == 2 and run("--dry-run", "no-such-model").returncode == 2


# --- Dockerfile.ubi -----------------------------------------------------------------------------


def test_dockerfile_stages() -> None:
    stages = DOCKERFILE.stages
    assert list(stages) == ["base", "builder", "cpu-tests", "release"]
    image = substitute(stages["base"].base, DOCKERFILE.global_args)
    assert image.startswith("registry.access.redhat.com/ubi9/"), image
    assert (stages["builder"].base, stages["cpu-tests"].base, stages["release"].base) == (
        "base",
        "builder",
        "base",
    )
    assert DOCKERFILE.global_args["PYTHON"] == "python3.11"
    assert any("make test" in i.args for i in stages["cpu-tests"].all("RUN"))


def test_dockerfile_release_stage() -> None:
    release = DOCKERFILE.stages["release"]
    user = release.all("USER")[-1].args
    assert re.fullmatch(r"2000(:0)?", user), f"USER {user}: numeric uid 2000 (runAsNonRoot), group 0"
    assert {int(p) for i in release.all("EXPOSE") for p in i.words()} == {DEFAULT_PORT, DEFAULT_GRPC_PORT}
    (cmd,) = release.all("CMD")
    assert cmd.words() == ["text-generation-launcher"] and cmd.args.startswith("[")
    assert cmd.words()[0] in PYPROJECT["project"]["scripts"]
    assert not release.all("ENTRYPOINT")
    assert RELEASE_ENV["PORT"] == str(DEFAULT_PORT) and RELEASE_ENV["GRPC_PORT"] == str(DEFAULT_GRPC_PORT)
    assert RELEASE_ENV["HF_HUB_OFFLINE"] == "1" and RELEASE_ENV["HF_HUB_CACHE"].startswith("/")
    home = RELEASE_ENV["HOME"]
    setup = " ".join(i.args for i in release.all("RUN"))
    assert "tgis:x:2000:0:" in setup and f":{home}:" in setup and "chmod -R g=u" in setup
    labels = " ".join(i.args for i in release.all("LABEL"))
    for key in ("title", "description", "version", "revision", "licenses"):
        assert f"org.opencontainers.image.{key}=" in labels, key
    assert f'licenses="{PYPROJECT["project"]["license"]}"' in labels
    # No toolchain in what the release image is made of (base + release).
    installs = " ".join(i.args for s in ("base", "release") for i in DOCKERFILE.stages[s].all("RUN"))
    assert not re.search(r"\b(gcc|g\+\+|clang|cmake|make|[\w.+-]+-devel)\b", installs), installs
    assert [i.words()[0] for i in release.all("COPY")] == ["--from=builder"]


def test_dockerfile_pins_match_the_project() -> None:
    constraints = dict(
        line.split("==") for line in (REPO / "constraints.txt").read_text().splitlines() if "==" in line
    )
    args = DOCKERFILE.global_args
    assert f"torch=={args['TORCH_VERSION']}" in PYPROJECT["project"]["dependencies"]
    assert args["TORCH_VERSION"] == constraints["torch"]
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    runs = [i.args for s in DOCKERFILE.stages.values() for i in s.all("RUN")]
    pips = [cmd for run in runs for cmd in run.split("&&") if "pip install" in cmd]
    for cmd in pips:
        pinned = "-c constraints.txt" in cmd or "--index-url" in cmd or "pip==" in cmd
        assert pinned, f"unpinned: {cmd}"
        for name, version in re.findall(r'"([\w-]+)==([\w.]+)"', cmd):
            assert constraints.get(name, version) == version, cmd
    # The generated code is made exactly as `make gen-protos` makes it.
    makefile = (REPO / "Makefile").read_text().replace("\\\n", " ")
    recipes = [" ".join(line.split()[3:]) for line in makefile.splitlines() if "grpc_tools.protoc" in line]
    assert len(recipes) == 2 and all(r in " ".join(" ".join(runs).split()) for r in recipes), recipes


def test_copy_sources_exist_and_are_in_the_context() -> None:
    rules = (REPO / ".dockerignore").read_text()
    for stage in DOCKERFILE.stages.values():
        for copy in stage.all("COPY"):
            words = copy.words()
            if any(w.startswith("--from=") for w in words):
                source_stage = next(w for w in words if w.startswith("--from="))[7:]
                assert source_stage in DOCKERFILE.stages, copy.args
                continue
            for source in [w for w in words if not w.startswith("--")][:-1]:
                assert (REPO / source).exists(), f"line {copy.line}: COPY {source} does not exist"
                assert not dockerignore_excludes(rules, source), f"COPY {source} is in .dockerignore"
    for path in (".venv", ".git", ".cache/demo-model", "router/pb/generation_pb2.py", "a/__pycache__/x.pyc"):
        assert dockerignore_excludes(rules, path), path
    for path in ("router/pb/__init__.py", "text_generation_common/pb/__init__.py", "pyproject.toml"):
        assert not dockerignore_excludes(rules, path), path


# --- Makefile -----------------------------------------------------------------------------------


def make(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["make", *args], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_make_targets() -> None:
    helped = {line.split()[0] for line in make("help").stdout.splitlines() if line.strip()}
    assert {"build", "integration-tests", "test"} <= helped
    missing = make("build", "CONTAINER_TOOL=")
    assert missing.returncode != 0 and "neither docker nor podman" in missing.stderr
    planned = make("-n", "build", "CONTAINER_TOOL=podman").stdout
    assert "podman build -f Dockerfile.ubi --target release" in planned


def test_manifests_use_the_image_make_builds(rendered: dict[str, list[dict]]) -> None:
    image = re.search(r" -t ([\w./-]+):", make("-n", "build", "CONTAINER_TOOL=podman").stdout)
    assert image is not None
    for key in ("models/" + MODELS[0], "kserve", "storage"):
        for doc in rendered[key]:
            spec: Any = doc["spec"]
            pod = spec.get("template", {}).get("spec", spec)
            for container in pod.get("containers", []):
                assert container["image"].split(":")[0] == image.group(1), (key, container["image"])
