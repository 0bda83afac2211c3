"""docs/examples, without a cluster or a network: the Pod manifest validated
against Kubernetes' own schemas (strict: an unknown field is an error, as
with the API server's strict field validation), which kubernetes-validate
ships for every Kubernetes release it knows; its two instances checked to
share one lock folder and one budget; the Dockerfile built on vLLM's image;
and docs/deploying.md showing both as they are. Broken copies of each are
refused, so that every check can fail."""

from __future__ import annotations

import copy
import re
import socket
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import all_versions, major_minor

from tests.conftest import REPO
from vllm_kv_cache_limit.logic.autoscale_policy import check_settings, fits_floors
from vllm_kv_cache_limit.logic.errors import KVCacheMaxMemoryError
from vllm_kv_cache_limit.logic.sizes import parse_size

EXAMPLES = REPO / "docs" / "examples"
MANIFEST = EXAMPLES / "two-instances-one-gpu.yaml"
DOCKERFILE = EXAMPLES / "Dockerfile"
DEPLOYING = REPO / "docs" / "deploying.md"
LOCK_DIR = "VLLM_KV_CACHE_LIMIT_LOCK_DIR"
GPU = "nvidia.com/gpu"
KUBERNETES = sorted({major_minor(v) for v in all_versions()}, key=lambda v: tuple(map(int, v.split("."))))
"""Every Kubernetes release whose schemas the installed kubernetes-validate ships."""


def manifest() -> dict[str, Any]:
    documents = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    assert len(documents) == 1, [d.get("kind") for d in documents]
    return documents[0]


def validate(resource: dict[str, Any], version: str) -> None:
    """Raises ``kubernetes_validate.ValidationError`` for a resource the API
    server of ``version`` would refuse."""
    assert kubernetes_validate.validate(resource, version, strict=True) == version


def flags(container: dict[str, Any]) -> dict[str, str | bool]:
    """A container's ``--flag value``, ``--flag=value`` and ``--flag``
    arguments (command and args together), by flag."""
    words = [str(w) for w in container.get("command", []) + container.get("args", [])]
    found: dict[str, str | bool] = {}
    for i, word in enumerate(words):
        if not word.startswith("--"):
            continue
        name, eq, value = word.partition("=")
        if eq:
            found[name] = value
        elif i + 1 < len(words) and not words[i + 1].startswith("--"):
            found[name] = words[i + 1]
        else:
            found[name] = True
    return found


def env(container: dict[str, Any], name: str) -> str | None:
    return next((e.get("value") for e in container.get("env", []) if e["name"] == name), None)


def problems(pod: dict[str, Any]) -> list[str]:
    """What keeps the Pod's two instances from sharing one GPU's start-up
    lock and budget (empty: nothing)."""
    found = []
    spec = pod["spec"]
    containers = spec["containers"]
    if len(containers) != 2:
        found.append(f"{len(containers)} containers, not 2")
    if spec.get("shareProcessNamespace") is not True:
        found.append("no shared PID namespace: the instances' '<host name> pid <pid>' labels can be the same")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    lock_volumes, budgets, floors, ports = set(), [], [], []
    for c in containers:
        name, args = c["name"], flags(c)
        for flag in ("--kv-cache-max-memory", "--kv-cache-autoscale", "--kv-cache-shared-budget", "--port"):
            if flag not in args:
                found.append(f"{name}: no {flag}")
        cap, floor, budget = (
            parse_size(value) if isinstance(value := args.get(flag), str) else None
            for flag in ("--kv-cache-max-memory", "--kv-cache-min-memory", "--kv-cache-shared-budget")
        )
        try:  # the plugin's own start-up check of these flags
            check_settings(cap, args.get("--kv-cache-autoscale") is True, floor, budget)
        except KVCacheMaxMemoryError as exc:
            found.append(f"{name}: {exc}")
        budgets.append(budget)
        floors.append(floor)
        port = args.get("--port")
        declared = [p["containerPort"] for p in c.get("ports", [])]
        if not isinstance(port, str) or int(port) not in declared:
            found.append(f"{name}: --port {port} is not among its container ports {declared}")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            get = c.get(probe, {}).get("httpGet")
            if get and isinstance(port, str) and get["port"] != int(port):
                found.append(f"{name}: its {probe} asks port {get['port']}, the server listens on {port}")
        ports.append(port)
        if str(c.get("resources", {}).get("limits", {}).get(GPU)) != "1":
            found.append(f"{name}: does not ask {GPU}: 1")
        folder = env(c, LOCK_DIR)
        mounts = [m for m in c.get("volumeMounts", []) if m["mountPath"] == folder]
        if folder is None or not mounts:
            found.append(f"{name}: {LOCK_DIR}={folder} is not the mount path of a volume")
            continue
        if mounts[0].get("readOnly"):
            found.append(f"{name}: the lock folder is mounted read-only")
        lock_volumes.add(mounts[0]["name"])
    if len(lock_volumes) != 1:
        found.append(f"the lock folders are on {len(lock_volumes)} volumes, not one: {sorted(lock_volumes)}")
    elif "emptyDir" not in volumes.get(next(iter(lock_volumes)), {}):
        found.append(f"the lock folder's volume {sorted(lock_volumes)} is not an emptyDir of the Pod")
    if len(set(budgets)) != 1 or None in budgets:
        found.append(f"the shared budgets differ: {budgets}")
    elif None not in floors and not fits_floors(floors[0], floors[1:], budgets[0]):
        found.append(f"the shared budget {budgets[0]} cannot hold the floors {floors}")
    if len(set(ports)) != len(ports):
        found.append(f"the servers' ports are not distinct: {ports}")
    return found


def base_image(dockerfile: str) -> str:
    """The image the last stage of ``dockerfile`` is built on, without its
    tag or digest, with the ``ARG`` defaults given before it filled in."""
    text = re.sub(r"\\\n", " ", dockerfile)
    args: dict[str, str] = {}
    image = ""
    for line in text.splitlines():
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0].upper() == "ARG" and "=" in words[1]:
            key, _, value = words[1].partition("=")
            args.setdefault(key, value.strip("\"'"))
        elif words[0].upper() == "FROM":
            ref = next(w for w in words[1:] if not w.startswith("--"))
            image = re.sub(r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), ""), ref)
    image = image.split("@")[0]
    name, _, tag = image.rpartition(":")
    if name and "/" not in tag:
        image = name
    return image.removeprefix("docker.io/")


def fenced_blocks(markdown: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"^```[\w-]*\n(.*?)^```$", markdown, re.S | re.M)]


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """The schemas are files of kubernetes-validate, and their one $ref is
    resolved to its own _definitions.json: nothing is fetched."""

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network use during validation: {args}")

    monkeypatch.setattr(socket, "getaddrinfo", refused)
    monkeypatch.setattr(socket.socket, "connect", refused)


@pytest.mark.parametrize("version", KUBERNETES)
def test_manifest_is_valid_kubernetes(version: str, no_network: None) -> None:
    validate(manifest(), version)


@pytest.mark.parametrize(
    ("what", "break_it"),
    [
        (
            "containerPort as a string",
            lambda pod: pod["spec"]["containers"][0]["ports"][0].update(containerPort="8000"),
        ),
        ("an unknown container field", lambda pod: pod["spec"]["containers"][1].update(volumeMount=[])),
        ("an unknown Pod field", lambda pod: pod["spec"].update(sharedProcessNamespace=True)),
        ("a container without a name", lambda pod: pod["spec"]["containers"][0].pop("name")),
    ],
)
def test_a_broken_manifest_is_refused(what: str, break_it: Any, no_network: None) -> None:
    pod = copy.deepcopy(manifest())
    break_it(pod)
    for version in (KUBERNETES[0], KUBERNETES[-1]):
        with pytest.raises(kubernetes_validate.ValidationError):
            validate(pod, version)


def test_the_instances_share_one_lock_folder_and_one_budget() -> None:
    pod = manifest()
    assert problems(pod) == []
    a, b = pod["spec"]["containers"]
    assert env(a, LOCK_DIR) == env(b, LOCK_DIR)
    assert flags(a)["--kv-cache-shared-budget"] == flags(b)["--kv-cache-shared-budget"]


def _set_arg(container: dict[str, Any], flag: str, value: str) -> None:
    args = container["args"]
    args[args.index(flag) + 1] = value


@pytest.mark.parametrize(
    ("what", "break_it", "expected"),
    [
        (
            "a lock folder of its own",
            lambda a, b, spec: b["env"][0].update(value="/tmp/vllm-kv-cache-limit"),
            "is not the mount path of a volume",
        ),
        (
            "two lock volumes",
            lambda a, b, spec: (
                spec["volumes"].append({"name": "other-locks", "emptyDir": {}}),
                b["volumeMounts"][0].update(name="other-locks"),
            ),
            "not one",
        ),
        (
            "a lock volume that is not the Pod's",
            lambda a, b, spec: spec["volumes"].__setitem__(
                0, {"name": "kv-cache-limit-locks", "hostPath": {"path": "/x"}}
            ),
            "not an emptyDir",
        ),
        (
            "a budget below the floors",
            lambda a, b, spec: [_set_arg(c, "--kv-cache-shared-budget", "1G") for c in (a, b)],
            "cannot hold the floors",
        ),
        ("another budget", lambda a, b, spec: _set_arg(b, "--kv-cache-shared-budget", "7G"), "budgets differ"),
        ("the same port", lambda a, b, spec: _set_arg(b, "--port", "8000"), "--port 8000"),
        ("no autoscaling", lambda a, b, spec: b["args"].remove("--kv-cache-autoscale"), "no --kv-cache-autoscale"),
        ("a floor above the cap", lambda a, b, spec: _set_arg(a, "--kv-cache-min-memory", "6G"), "above"),
        ("no shared PID namespace", lambda a, b, spec: spec.pop("shareProcessNamespace"), "PID namespace"),
        ("no GPU", lambda a, b, spec: a["resources"]["limits"].pop(GPU), GPU),
    ],
)
def test_a_pod_that_cannot_share_is_caught(what: str, break_it: Any, expected: str) -> None:
    pod = copy.deepcopy(manifest())
    spec = pod["spec"]
    a, b = spec["containers"]
    break_it(a, b, spec)
    found = problems(pod)
    assert any(expected in p for p in found), found


def test_dockerfile_adds_the_plugin_to_vllms_image() -> None:
    text = DOCKERFILE.read_text()
    assert base_image(text) == "vllm/vllm-openai"
    instructions = re.sub(r"\\\n", " ", text)
    runs = [line for line in instructions.splitlines() if line.startswith("RUN ")]
    # The plugin alone: an extra ([gpu], [cpu]) would install a second vLLM.
    assert any("pip install" in r for r in runs) and not any(re.search(r"\[(gpu|cpu)", r) for r in runs), runs
    # Every COPY source is in the build context, the repository's root.
    for line in instructions.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (REPO / source).exists(), source


@pytest.mark.parametrize(
    ("dockerfile", "image"),
    [
        ("FROM vllm/vllm-openai:v0.32.0\n", "vllm/vllm-openai"),
        ("ARG V=v0.31.0\nFROM docker.io/vllm/vllm-openai:${V} AS serve\n", "vllm/vllm-openai"),
        ("FROM python:3.12 AS wheel\nFROM vllm/vllm-openai@sha256:abc\n", "vllm/vllm-openai"),
        ("FROM vllm/vllm-openai:v0.32.0 AS base\nFROM python:3.12-slim\n", "python"),
        ("ARG IMAGE=nvidia/cuda:12.8.0-runtime-ubuntu22.04\nFROM $IMAGE\n", "nvidia/cuda"),
        ("FROM localhost:5000/vllm-openai\n", "localhost:5000/vllm-openai"),
    ],
)
def test_base_image_reads_the_last_stage(dockerfile: str, image: str) -> None:
    assert base_image(dockerfile) == image


def test_deploying_shows_the_examples_as_they_are() -> None:
    blocks = fenced_blocks(DEPLOYING.read_text())
    for path in (DOCKERFILE, MANIFEST):
        assert path.read_text() in blocks, f"docs/deploying.md does not show {path.relative_to(REPO)} as it is"


def test_fenced_blocks_finds_a_changed_copy() -> None:
    shown = "# x\n\n```yaml\n" + MANIFEST.read_text().replace("6G", "7G") + "```\n"
    assert MANIFEST.read_text() not in fenced_blocks(shown)
    assert MANIFEST.read_text().replace("6G", "7G") in fenced_blocks(shown)
