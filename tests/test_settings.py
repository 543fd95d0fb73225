"""Settings: one parser per kind for every duration and size, and launch options that reach
both backends (server processes and colocated shards) alike."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest
from conftest import subprocess_env
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsparse import config, errors
from kvsparse.cli.main import _launch_parser
from kvsparse.server.main import _parser as server_parser

# -- one grammar for every duration and every size --------------------------------------------

_SECOND_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0, "min": 60.0, "h": 3600.0}
_BYTE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}


def reference_seconds(text: str):
    """What a duration's text means, written apart from the code: seconds, or None."""
    folded = text.strip().lower()
    if folded in ("inf", "infinity"):
        return math.inf
    match = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(ms|s|min|m|h)?", folded)
    return None if match is None else float(match.group(1)) * _SECOND_UNITS[match.group(2) or ""]


def reference_bytes(text: str):
    match = re.fullmatch(r"(\d+)\s*([kmgt]?)(?:i?b)?", text.strip().lower())
    return None if match is None else int(match.group(1)) * _BYTE_UNITS[match.group(2)]


def in_range(setting: config.Setting, value) -> bool:
    if value is None or (math.isinf(value) and not setting.infinite):
        return False
    if value < setting.minimum or (setting.above_minimum and value == setting.minimum):
        return False
    return True


def readers(setting: config.Setting):
    """Every public way this setting is read: its variable and its flag."""
    found = []
    if setting.variable is not None:
        found.append(("env", lambda text: setting.read({setting.variable: text})))
    if setting.flag is not None:
        parser = server_parser() if setting.flag.startswith("--max-") else _launch_parser()
        dest = setting.flag.lstrip("-").replace("-", "_")

        def from_flag(text, parser=parser, dest=dest):
            try:
                args = parser.parse_known_args([f"{setting.flag}={text}"])[0]
            except SystemExit:
                raise errors.InvalidArgument(f"{setting.flag} refused {text!r}") from None
            return getattr(args, dest)

        found.append(("flag", from_flag))
    return found


NUMBERS = st.one_of(
    st.integers(0, 10**6).map(str),
    st.floats(0, 1e6, allow_nan=False).map(lambda x: f"{x:g}"),
    st.decimals(0, 1000, places=3).map(str),
)
DURATIONS = st.one_of(
    st.tuples(NUMBERS, st.sampled_from(["", "s", "ms", "m", "min", "h", " s", "x"])).map("".join),
    st.sampled_from(["inf", "Infinity", "-1", "nan", "", "soon", "1e3", "0", "2.5"]),
)
SIZES = st.one_of(
    st.tuples(
        st.integers(0, 4096).map(str),
        st.sampled_from(["", "k", "M", "g", "KiB", "MiB", "GiB", "MB", " k", "q"]),
    ).map("".join),
    st.sampled_from(["-1", "1.5GiB", "", "lots", "0"]),
)


@pytest.mark.parametrize(
    "name", sorted(n for n, s in config.SETTINGS.items() if s.kind == "seconds")
)
@settings(max_examples=150, deadline=None)
@given(text=DURATIONS)
def test_every_duration_setting_parses_the_same_grammar(name, text):
    setting = config.SETTINGS[name]
    value = reference_seconds(text)
    for how, read in readers(setting):
        if text.strip() == "" and how == "env":
            assert read(text) == setting.default  # an empty variable counts as unset
        elif in_range(setting, value):
            assert read(text) == pytest.approx(value), (name, how, text)
        else:
            with pytest.raises(errors.InvalidArgument):
                read(text)


@pytest.mark.parametrize("name", sorted(n for n, s in config.SETTINGS.items() if s.kind == "bytes"))
@settings(max_examples=150, deadline=None)
@given(text=SIZES)
def test_every_size_setting_parses_the_same_grammar(name, text):
    setting = config.SETTINGS[name]
    value = reference_bytes(text)
    for how, read in readers(setting):
        if text.strip() == "" and how == "env":
            assert read(text) == setting.default
        elif setting.unlimited is not None and text.strip() == str(setting.unlimited):
            assert read(text) == setting.unlimited
        elif value is not None and value >= setting.minimum:
            assert read(text) == value, (name, how, text)
        else:
            with pytest.raises(errors.InvalidArgument):
                read(text)


def test_the_windows_agree_on_no_bound():
    # The launcher passes the retry window on as the rejoin window: both take "inf".
    assert config.retry_window({config.RETRY_WINDOW: "inf"}) == math.inf
    assert config.rejoin_window({config.REJOIN_WINDOW: "inf"}) == math.inf
    with pytest.raises(errors.InvalidArgument, match="KVSPARSE_HEARTBEAT_TIMEOUT"):
        config.heartbeat_timeout({config.HEARTBEAT_TIMEOUT: "inf"})  # 0 turns them off


def test_max_message_size_takes_units_like_the_other_limits():
    args = server_parser().parse_args(["--max-message-size", "1MiB", "--max-reply-bytes", "1MiB"])
    assert args.max_message_size == args.max_reply_bytes == 1 << 20
    assert server_parser().parse_args(["--max-message-size", "-1"]).max_message_size == -1


# -- launch options reach both backends alike --------------------------------------------------

REPORT = r"""
import json, sys, time
import numpy as np
import kvsparse

kv = kvsparse.create("dist_sparse")
kv.init("t", kvsparse.SparseTable(dim=4))
kv.set_optimizer(kvsparse.optimizers.SGD(learning_rate=0.1))
ids = np.arange(16) + 16 * kv.rank
start = time.monotonic()
while time.monotonic() - start < 2.5:  # long enough for several saves every 0.5 s
    kv.push("t", (ids, np.ones((16, 4), np.float32)))
    time.sleep(0.02)
backend = kv._backend
saver = kv._saver
print("REPORT " + json.dumps({
    "backend": type(backend).__name__,
    "rank": kv.rank,
    "timeout": backend.session.timeout,
    "retry_window": backend.session.retry_window,
    "keys": backend.session.keys is not None,
    "mode": str(backend.mode.value),
    "staleness": backend.staleness,
    "checkpoint_dir": kv._checkpoint_dir,
    "saver": None if saver is None else [saver.every, saver.keep],
}), flush=True)
kv.barrier()
kv.close()
"""


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    directory = tmp_path_factory.mktemp("keys")
    subprocess.run(
        [sys.executable, "-m", "kvsparse", "keys", str(directory)],
        check=True,
        env=subprocess_env(),
        capture_output=True,
        timeout=60,
    )
    return directory


@pytest.mark.parametrize("colocated", [False, True], ids=["servers", "colocated"])
def test_launch_options_reach_both_backends_alike(tmp_path, keys, colocated):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    checkpoints = tmp_path / "ckpt"
    command = [sys.executable, "-m", "kvsparse", "launch", "-n", "2"]
    command += ["--colocated"] if colocated else ["-s", "1"]
    command += ["--timeout", "45", "--staleness", "3", "--retry-window", "1m"]
    command += ["--checkpoint-dir", str(checkpoints), "--save-every", "500ms", "--keep", "2"]
    command += ["--keys", str(keys), "--", sys.executable, str(script)]
    job = subprocess.run(
        command, capture_output=True, text=True, env=subprocess_env(), cwd=tmp_path, timeout=180
    )
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-5000:]
    reports = sorted(
        (
            json.loads(line.split("REPORT ", 1)[1])
            for line in job.stdout.splitlines()
            if "REPORT" in line
        ),
        key=lambda report: report["rank"],
    )
    assert [r["rank"] for r in reports] == [0, 1], job.stdout
    expected_backend = "ColocatedBackend" if colocated else "RemoteBackend"
    for report in reports:
        assert report["backend"] == expected_backend
        assert report["timeout"] == 45.0 and report["retry_window"] == 60.0
        assert report["keys"] is True
        assert report["mode"] == "ssp" and report["staleness"] == 3
        assert report["checkpoint_dir"] == str(checkpoints)
    # --save-every: rank 0 saves, on either backend (the colocated one once saved nothing).
    assert reports[0]["saver"] == [0.5, 2] and reports[1]["saver"] is None
    manifests = sorted(checkpoints.glob("ckpt-*.manifest.json"))
    assert len(manifests) >= 2, (sorted(p.name for p in checkpoints.iterdir()), job.stderr[-3000:])
