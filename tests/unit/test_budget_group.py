"""A budget restricted to one group, checked as unprivileged users: two
members of the group share the budget, and a user outside it can neither
join nor claim it. The users are uids and gids that no account has, taken
with ``setpriv`` (root only; skipped with the reason elsewhere)."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from vllm_kv_cache_limit.logic.budget_ledger import folder_name

KEY = "cpu-node0"
PACKAGE = Path(__file__).resolve().parents[2] / "vllm_kv_cache_limit"

JOIN = textwrap.dedent(
    """
    import json, sys
    from vllm_kv_cache_limit.logic.budget_ledger import Ledger
    try:
        ledger = Ledger(sys.argv[1], sys.argv[2], label=sys.argv[3])
        with ledger.transaction(wait=False) as view:
            view.write({"budget": 10**6, "holds": int(sys.argv[4]), "wants": int(sys.argv[4]), "floor": 1})
            others = [o["label"] for o in view.others]
    except OSError as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        sys.exit(0)
    print(json.dumps({"others": others}), flush=True)
    sys.stdin.read()  # hold the entry until the test closes stdin
    ledger.close()
    """
)


def _unused_ids(count: int) -> list[int]:
    """Ids that no account and no group has (so nothing outside the test owns them)."""
    found: list[int] = []
    candidate = 61000
    while len(found) < count:
        try:
            pwd.getpwuid(candidate)
        except KeyError:
            try:
                grp.getgrgid(candidate)
            except KeyError:
                found.append(candidate)
        candidate += 1
    return found


@dataclass
class Users:
    base: Path
    python: str
    team: int
    member: int
    second_member: int
    outsider: int

    def run(self, uid: int, groups: list[int], *args: str, hold: bool = False) -> subprocess.Popen[str]:
        groups_arg = f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"
        command = ["setpriv", f"--reuid={uid}", f"--regid={uid}", groups_arg, self.python, "-S", "-c", JOIN, *args]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(self.base / "src")}
        return subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )


def _reply(process: subprocess.Popen[str]) -> dict:
    assert process.stdout is not None
    line = process.stdout.readline()  # bounded: the script answers at once or exits
    if not line:
        _, err = process.communicate(timeout=30)
        raise AssertionError(f"no answer (exit {process.returncode}): {err}")
    return json.loads(line)


@pytest.fixture
def users() -> Iterator[Users]:
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to act as other users")
    base = Path(tempfile.mkdtemp(prefix="kvcl-group-", dir="/tmp"))
    try:
        base.chmod(0o755)
        shutil.copytree(PACKAGE, base / "src" / "vllm_kv_cache_limit", ignore=shutil.ignore_patterns("__pycache__"))
        for path in [base / "src", *(base / "src").rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        team, member, second_member, outsider = _unused_ids(4)
        python = next(
            (
                candidate
                for candidate in (os.path.realpath(sys.executable), "/usr/bin/python3")
                if subprocess.run(
                    [
                        "setpriv",
                        f"--reuid={outsider}",
                        f"--regid={outsider}",
                        "--clear-groups",
                        candidate,
                        "-S",
                        "-c",
                        "",
                    ],
                    capture_output=True,
                    timeout=30,
                ).returncode
                == 0
            ),
            None,
        )
        if python is None:
            pytest.skip("no Python interpreter that an unprivileged user may run")
        yield Users(base, python, team, member, second_member, outsider)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _group_folder(path: Path, team: int) -> None:
    path.mkdir()
    os.chown(path, 0, team)
    path.chmod(0o2770)


@pytest.mark.parametrize("where", ["budget folder", "lock folder"])
def test_a_budget_restricted_to_a_group_admits_its_members_only(users: Users, where: str) -> None:
    """An operator's group folder (mode 2770, group ``team``): as the budget
    folder inside a shared lock folder, or as the lock folder itself."""
    locks = users.base / "locks"
    if where == "budget folder":
        locks.mkdir(mode=0o1777)
        locks.chmod(0o1777)
        _group_folder(locks / folder_name(KEY), users.team)
    else:
        _group_folder(locks, users.team)
    first = users.run(users.member, [users.team], str(locks), KEY, "member one", "100")
    try:
        assert _reply(first) == {"others": []}
        outsider = users.run(users.outsider, [], str(locks), KEY, "outsider", "1000")
        answer = _reply(outsider)
        outsider.communicate(timeout=30)
        assert "PermissionError" in answer.get("error", ""), answer
        second = users.run(users.second_member, [users.team], str(locks), KEY, "member two", "50")
        try:
            assert _reply(second) == {"others": ["member one"]}  # the group shares it; the outsider is not in it
        finally:
            second.communicate("", timeout=30)
        assert second.returncode == 0
    finally:
        first.communicate("", timeout=30)
    assert first.returncode == 0
    entries = sorted(p.name for p in (locks / folder_name(KEY)).iterdir() if p.name.endswith(".entry"))
    assert entries == []  # both members left; the outsider never wrote one
