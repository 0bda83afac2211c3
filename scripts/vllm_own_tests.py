#!/usr/bin/env python3
"""Run vLLM's own unit tests of the code the plugin hooks twice in the CUDA
wheel's environment (``.venv-cuda-VERSION``, no GPU): once with the plugin
excluded (``VLLM_PLUGINS=""``, which its start-up hook honours too) and once
with it installed and unused (no cap), and compare the outcomes test by test.

    scripts/vllm_own_tests.py 0.34.0
    scripts/vllm_own_tests.py 0.34.0 tests/v1/core/test_scheduler.py   # other files of vLLM's tests/

By default the files of :data:`TEST_FILES` the release has: one new in a
later release (its ``since``) is skipped and named; one that should be there
and is not stops the run (exit status 2), as does a named file that is not.

The tests come from vLLM's source distribution: ``pip download -vv`` names
its address (then fails to prepare its metadata, a CUDA build never needed
here); the file is fetched from there into ``.cache/sdists`` and only its
``tests/`` and ``pyproject.toml`` are extracted (``.cache/vllm-sdist``).
Once collection has imported vLLM, ``scripts/vllm_own_platform.py`` sets
vLLM's CUDA platform on a faked device; it also records each test's outcome.
The text models the tests name get their ``config.json`` from a hub cache the
script writes (:data:`MODEL_CONFIGS`; nothing is downloaded from the hub).
The plugin must already be installed there (``make test-cuda-wheel
VLLM_VERSION=...`` does it); test-only packages vLLM's ``tests/conftest.py``
imports are installed when missing. The pytest logs are kept in
``.cache/vllm-own-tests/VERSION``.

Exit status: 0 when every test has the same outcome in both runs (failing in
both is the same outcome), 1 when one differs (each is listed), 2 when a run
could not be made or the plugin was not active in the run with it, 3 when
the source distribution could not be fetched.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_hooks import CACHE, EXIT_FETCH_FAILED, FetchError  # noqa: E402

from vllm_kv_cache_limit.logic import envs  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"


@dataclass(frozen=True)
class OwnTestFile:
    """A file of vLLM's ``tests/`` and the first release whose source
    distribution has it (None: every supported release)."""

    path: str
    since: str | None = None


TEST_FILES = (
    OwnTestFile("tests/v1/core/test_scheduler.py"),
    OwnTestFile("tests/v1/core/test_prefix_caching.py"),
    OwnTestFile("tests/v1/core/test_kv_cache_utils.py"),
    OwnTestFile("tests/v1/worker/test_extensible_kv_cache.py", since="0.34"),
)
"""vLLM's tests of the scheduler, block pool, KV cache sizing and the
extensible KV cache (new in vLLM 0.34): the code the plugin hooks or reads."""
MODEL_CONFIGS: dict[str, dict[str, object]] = {
    "facebook/opt-125m": {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "activation_function": "relu",
        "do_layer_norm_before": True,
        "hidden_size": 768,
        "word_embed_proj_dim": 768,
        "ffn_dim": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "max_position_embeddings": 2048,
        "vocab_size": 50272,
        "bos_token_id": 2,
        "eos_token_id": 2,
        "pad_token_id": 1,
        "torch_dtype": "float16",
    },
    "Qwen/Qwen3-0.6B": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 40960,
        "max_window_layers": 28,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "sliding_window": None,
        "vocab_size": 151936,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    },
    "Qwen/Qwen1.5-7B": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 32768,
        "max_window_layers": 28,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "vocab_size": 151936,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "torch_dtype": "bfloat16",
    },
}
"""The Hugging Face ``config.json`` of the text models these tests name (the
published values; no weights, no tokenizer), served from a hub cache of our
own (``HF_HUB_CACHE``, offline). Left out: ``llava-hf/llava-1.5-7b-hf``
(its vLLM model needs torchvision, not in the environment) and
``Qwen/Qwen3-Next-80B-A3B-Instruct``; their tests fail in both runs."""
HUB_REVISION = "0" * 40
TEST_REQUIREMENTS = {"tblib": "tblib"}
"""Import name -> package: what vLLM's ``tests/conftest.py`` imports beyond
the wheel's own requirements."""
PLATFORM_PLUGIN = "vllm_own_platform"
OUTCOMES_ENV = "KV_CACHE_LIMIT_OWN_OUTCOMES"
TEST_TIMEOUT_S = 600
EXIT_DIFFERENT = 1
EXIT_NO_RUN = 2
OUTCOME_ORDER = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "collection error")


class RunError(RuntimeError):
    """A run could not be made or proves nothing."""


def release_files(version: str, root: Path) -> tuple[list[str], list[str]]:
    """The files of :data:`TEST_FILES` that vLLM ``version``'s tests in
    ``root`` should have, and one line per file left out as new in a later
    release. A left-out file that is there after all is an error: its
    ``since`` is wrong."""
    from packaging.version import Version

    release = Version(version).release
    files, left_out = [], []
    for test_file in TEST_FILES:
        if test_file.since is None or release >= Version(test_file.since).release:
            files.append(test_file.path)
        elif (root / test_file.path).is_file():
            raise RunError(
                f"vLLM {version}'s source distribution has {test_file.path}, listed as new in "
                f"{test_file.since}: correct its since in TEST_FILES"
            )
        else:
            left_out.append(f"{test_file.path} (new in vLLM {test_file.since})")
    return files, left_out


def sdist_url(version: str, pip_output: str) -> str | None:
    """The address of ``vllm-VERSION.tar.gz`` in ``pip download -vv`` output."""
    name = re.escape(f"vllm-{version}.tar.gz")
    match = re.search(rf"(\w+://\S+/{name})\b", pip_output)
    return match[1] if match else None


def download_sdist(version: str, sdists: Path) -> Path:
    """vLLM ``version``'s source distribution, from ``sdists`` or fetched there."""
    target = sdists / f"vllm-{version}.tar.gz"
    if target.is_file():
        return target
    sdists.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # pip downloads the file, then fails to prepare its metadata (a CUDA
        # build); --no-build-isolation makes that fail at once. -vv names the address.
        command = [sys.executable, "-m", "pip", "download", "-vv", "--no-deps", "--no-binary", ":all:"]
        command += ["--no-build-isolation", "--dest", tmp, f"vllm=={version}"]
        proc = subprocess.run(command, capture_output=True, text=True)
        saved = list(Path(tmp).glob(f"vllm-{version}.tar.gz"))
        if saved:
            shutil.move(saved[0], target)
            return target
        output = proc.stdout + proc.stderr
        url = sdist_url(version, output)
        if url is None:
            errors = [line for line in output.splitlines() if line.startswith("ERROR:")] or [output[-2000:]]
            raise FetchError(f"pip found no source distribution of vllm=={version}: {' '.join(errors)}")
        partial = target.with_suffix(".part")
        try:
            with urllib.request.urlopen(url, timeout=180) as response, partial.open("wb") as out:
                shutil.copyfileobj(response, out)
            with tarfile.open(partial) as archive:  # a whole archive, not a cut one
                archive.getmembers()
        except (OSError, tarfile.TarError) as exc:
            partial.unlink(missing_ok=True)
            raise FetchError(f"could not fetch {url}: {exc}") from exc
        partial.rename(target)
    return target


def extract_tests(sdist: Path, dest_root: Path) -> Path:
    """Extract only ``tests/`` and ``pyproject.toml`` (its pytest settings)
    of ``sdist`` to ``dest_root/<its name>`` (once) and return that folder.
    vLLM itself stays out: the installed wheel is what the tests import."""
    dest = dest_root / sdist.name.removesuffix(".tar.gz")
    marker = dest / ".complete"
    if marker.exists():
        return dest
    if dest.exists():
        shutil.rmtree(dest)
    with tarfile.open(sdist) as archive:
        members = []
        for member in archive.getmembers():
            _, _, name = member.name.partition("/")  # under the top folder vllm-VERSION/
            if not (name.startswith("tests/") or name == "pyproject.toml"):
                continue
            if name.startswith("/") or ".." in Path(name).parts or not (member.isfile() or member.isdir()):
                raise ValueError(f"unsafe member {member.name!r} in {sdist.name}")
            member.name = name
            members.append(member)
        archive.extractall(dest, members=members, filter="data")
    marker.write_text(sdist.name)
    return dest


def write_model_configs(hub: Path) -> None:
    """:data:`MODEL_CONFIGS` as a Hugging Face hub cache in ``hub``."""
    for repo, config in MODEL_CONFIGS.items():
        folder = hub / f"models--{repo.replace('/', '--')}"
        snapshot = folder / "snapshots" / HUB_REVISION
        snapshot.mkdir(parents=True, exist_ok=True)
        (snapshot / "config.json").write_text(json.dumps(config, indent=1))
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / "main").write_text(HUB_REVISION)


def environment_versions(python: Path) -> dict[str, str | None]:
    """The installed versions of ``vllm`` and ``vllm-kv-cache-limit`` in
    ``python``'s environment (read from the metadata: no vLLM import)."""
    code = (
        "import json, importlib.metadata as m\n"
        "def v(name):\n"
        "    try: return m.version(name)\n"
        "    except m.PackageNotFoundError: return None\n"
        "print(json.dumps({n: v(n) for n in ('vllm', 'vllm-kv-cache-limit')}))\n"
    )
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=run_env(None))
    if proc.returncode != 0:
        raise RunError(f"{python} cannot run: {proc.stderr.strip()[-500:]}")
    versions: dict[str, str | None] = json.loads(proc.stdout.strip().splitlines()[-1])
    return versions


def ensure_requirements(python: Path) -> None:
    """Install the test-only packages that ``python``'s environment lacks."""
    missing = []
    for module, package in TEST_REQUIREMENTS.items():
        probe = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True, env=run_env(None))
        if probe.returncode != 0:
            missing.append(package)
    if missing:
        print(f"installing vLLM's test requirements: {' '.join(missing)}")
        proc = subprocess.run([str(python), "-m", "pip", "install", "-q", *missing], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RunError(f"pip install {' '.join(missing)} failed:\n{(proc.stdout + proc.stderr)[-2000:]}")


def run_env(vllm_plugins: str | None, hub: Path | None = None) -> dict[str, str]:
    """The environment of a run: no cap or other setting of the plugin,
    ``VLLM_PLUGINS`` as given (None: unset), offline with the hub cache
    ``hub``, ``scripts/`` (the platform plugin) the only extra path: vLLM's
    ``tests`` is the one found."""
    dropped = (*envs.USER_VARIABLES, envs.ERROR_FILE, envs.INACTIVE_WARNED, "VLLM_PLUGINS")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env["PYTHONPATH"] = str(SCRIPTS)
    env["HF_HUB_OFFLINE"] = "1"
    if hub is not None:
        env["HF_HUB_CACHE"] = str(hub)
    if vllm_plugins is not None:
        env["VLLM_PLUGINS"] = vllm_plugins
    return env


@dataclass
class Run:
    """One pytest run's outcomes, as ``vllm_own_platform`` wrote them."""

    label: str
    outcomes: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    hooks: dict[str, Any] = field(default_factory=dict)
    exitstatus: int = 0
    seconds: float = 0.0

    @classmethod
    def load(cls, label: str, path: Path, seconds: float = 0.0) -> Run:
        data = json.loads(path.read_text())
        return cls(label, data["outcomes"], data["messages"], data["hooks"], data["exitstatus"], seconds)


def run_tests(python: Path, root: Path, files: list[str], vllm_plugins: str | None, label: str, logs: Path) -> Run:
    """Run ``files`` of vLLM's tests in ``root`` with ``python``; the log
    goes to ``logs/<label>.log``, the model configs to ``logs/hub``."""
    logs.mkdir(parents=True, exist_ok=True)
    outcomes = logs / f"{label}.json"
    outcomes.unlink(missing_ok=True)
    hub = logs / "hub"
    write_model_configs(hub)
    env = run_env(vllm_plugins, hub) | {OUTCOMES_ENV: str(outcomes)}
    command = [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-p", PLATFORM_PLUGIN, "-q", "--tb=short"]
    command += ["--timeout", str(TEST_TIMEOUT_S), *files]
    start = time.monotonic()
    with (logs / f"{label}.log").open("w") as log:
        proc = subprocess.run(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - start
    # 0: all passed, 1: some failed; anything else (interrupted, internal or
    # usage error, no tests) is no run to compare.
    if proc.returncode not in (0, 1) or not outcomes.is_file():
        raise RunError(f"pytest ({label}) exited {proc.returncode}; see {logs / f'{label}.log'}")
    return Run.load(label, outcomes, seconds)


def counts(outcomes: dict[str, str]) -> str:
    """``592 passed, 70 failed, 26 skipped``."""
    counted = Counter(outcomes.values())
    order = [o for o in OUTCOME_ORDER if o in counted] + sorted(set(counted) - set(OUTCOME_ORDER))
    return ", ".join(f"{counted[o]} {o}" for o in order) or "no tests"


def differences(without: Run, with_plugin: Run) -> list[str]:
    """One line per test whose outcome differs (or that ran in one only)."""
    lines = []
    for nodeid in sorted(set(without.outcomes) | set(with_plugin.outcomes)):
        before = without.outcomes.get(nodeid, "absent")
        after = with_plugin.outcomes.get(nodeid, "absent")
        if before != after:
            why = with_plugin.messages.get(nodeid) or without.messages.get(nodeid, "")
            lines.append(f"{nodeid}: {before} without the plugin, {after} with it" + (f" ({why})" if why else ""))
    return lines


def check_plugin_states(without: Run, with_plugin: Run) -> None:
    """The plugin off in the first run, its hooks installed in the second."""
    if without.hooks.get("installed"):
        raise RunError('the plugin installed its hooks with VLLM_PLUGINS=""')
    if not with_plugin.hooks.get("installed"):
        raise RunError("the plugin installed no hooks in the run with it: is it installed in that environment?")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="the vLLM release (its CUDA wheel installed in .venv-cuda-VERSION)")
    parser.add_argument(
        "files", nargs="*", help="test files of vLLM's tests/ (default: those of TEST_FILES the release has)"
    )
    parser.add_argument("--python", type=Path, help="the environment's interpreter (.venv-cuda-VERSION/bin/python)")
    args = parser.parse_args(argv)
    python = args.python or REPO / f".venv-cuda-{args.version}" / "bin" / "python"
    try:
        sdist = download_sdist(args.version, CACHE / "sdists")
    except FetchError as exc:
        print(f"ERROR {exc}", file=sys.stderr)
        print(f"vLLM {args.version}'s source distribution could not be fetched")
        return EXIT_FETCH_FAILED
    root = extract_tests(sdist, CACHE / "vllm-sdist")
    logs = CACHE / "vllm-own-tests" / args.version
    try:
        if not python.is_file():
            raise RunError(f"no {python}: make test-cuda-wheel VLLM_VERSION={args.version} makes it")
        versions = environment_versions(python)
        if versions["vllm"] != args.version:
            raise RunError(f"{python} has vllm {versions['vllm']}, not the CUDA wheel {args.version}")
        if versions["vllm-kv-cache-limit"] is None:
            raise RunError(f"the plugin is not installed in {python}: make test-cuda-wheel VLLM_VERSION={args.version}")
        ensure_requirements(python)
        files, left_out = (args.files, []) if args.files else release_files(args.version, root)
        for line in left_out:
            print(f"skipped {line}: not in vLLM {args.version}")
        missing = [name for name in files if not (root / name).is_file()]
        if missing:
            raise RunError(f"vLLM {args.version}'s source distribution has no {', '.join(missing)}")
        runs = []
        for label, plugins in (("without-plugin", ""), ("with-plugin", None)):
            run = run_tests(python, root, files, plugins, label, logs)
            where = 'VLLM_PLUGINS=""' if plugins == "" else "plugin installed, no cap"
            hooked = (
                f"; hooks ran on {len(run.hooks.get('modules', []))} vLLM modules" if run.hooks["installed"] else ""
            )
            print(f"{where}: {counts(run.outcomes)} in {run.seconds:.0f} s{hooked}")
            runs.append(run)
        without, with_plugin = runs
        check_plugin_states(without, with_plugin)
    except RunError as exc:
        print(f"ERROR {exc}")
        return EXIT_NO_RUN
    differing = differences(without, with_plugin)
    total = len(set(without.outcomes) | set(with_plugin.outcomes))
    if differing:
        print(f"{len(differing)} tests differ:")
        for line in differing:
            print(f"  - {line}")
        print(f"{len(differing)} of {total} tests differ with the plugin installed and unused (logs: {logs})")
        return EXIT_DIFFERENT
    skipped = f"; skipped, not in {args.version}: {', '.join(left_out)}" if left_out else ""
    print(f"same outcome for all {total} tests with and without the plugin ({counts(without.outcomes)}){skipped}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
