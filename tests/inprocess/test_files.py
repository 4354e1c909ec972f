"""Saved profiles load back: .pyspy.gz exactly, in another process too; speedscope
files as far as they hold. Damaged and foreign files are a ValueError naming them."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading

import pytest

from dask_pyspy import Profile, Sampler
from dask_pyspy._native import _testing
from tests.conftest import wait_for

SPANS = {"span-1": {"names": ["load", "parse"], "ids": ["span-0", "span-1"]}}
KEY = "('parse-8d2c', 3)"


def parse(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(2000))


@pytest.fixture(scope="module")
def tagged() -> Profile:
    """A real profile of a thread running a task in a dask span, the span's names known."""
    s = Sampler(rate=500, cpu_budget=1.0)
    stop = threading.Event()
    runner = threading.Thread(target=parse, args=(stop,), name="runner")
    s.start()
    runner.start()
    try:
        s.set_thread_tag(runner.ident, KEY, "parse", span="span-1")
        wait_for(lambda: s.profile().summary()["prefixes"] and s.profile().n_samples >= 200)
    finally:
        stop.set()
        runner.join()
        s.stop()
    prof = s.profile(by="task").with_metadata(window=[1.25, 2.5], note="ünïcode")
    return Profile(prof._native.with_spans(SPANS), by="task")


def digest_in_subprocess(path) -> list[str]:
    code = (
        "import sys; from dask_pyspy import Profile, _native; p = Profile.load(sys.argv[1]); "
        "print(_native._testing.digest(p._native), p.by, p.n_samples)"
    )
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_pyspy_file_loads_back_exactly_in_another_process(tagged, tmp_path):
    path = tagged.save(tmp_path / "run.pyspy.gz", by="prefix")
    assert path.read_bytes()[:2] == b"\x1f\x8b", "a plain gzip file"
    assert json.loads(gzip.decompress(path.read_bytes()))["version"] == 1
    back = Profile.load(path)
    assert _testing.digest(back._native) == _testing.digest(tagged._native), (
        "every sample, tag, span, process and metadata entry"
    )
    assert back.by == "prefix", "the grouping saved with it"
    assert back._native.span_ids() == ["span-1"] and back.metadata == tagged.metadata
    assert back.summary() == tagged.summary()
    assert digest_in_subprocess(path) == [_testing.digest(tagged._native), "prefix", str(tagged.n_samples)]


def test_an_empty_profile_saves_losslessly(tagged, tmp_path):
    empty = Profile.merge([], window=[0, 1])
    back = Profile.load(empty.save(tmp_path / "empty.pyspy.gz"))
    assert back.n_samples == 0 and back.metadata["window"] == [0, 1]


def with_version(tagged: Profile, path, version) -> None:
    doc = json.loads(gzip.decompress(tagged._native.to_file("task")))
    doc["version"] = version
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))


def test_another_version_names_the_file_and_both_versions(tagged, tmp_path):
    path = tmp_path / "future.pyspy.gz"
    with_version(tagged, path, 2)
    with pytest.raises(ValueError) as err:
        Profile.load(path)
    assert str(err.value) == (
        f"cannot load {str(path)!r}: file format version 2 (written by a newer dask-pyspy); "
        f"dask-pyspy 0.1.0 reads version 1 only"
    )


PYSPY_SPEEDSCOPE = {
    "$schema": "https://www.speedscope.app/file-format-schema.json",
    "exporter": "py-spy@0.3.14",
    "shared": {"frames": [{"name": "f", "file": "f.py", "line": 1}]},
    "profiles": [
        {
            "type": "sampled",
            "name": "thread",
            "unit": "none",
            "startValue": 0,
            "endValue": 1,
            "samples": [[0]],
            "weights": [1],
        }
    ],
}


def damaged(tagged: Profile, kind: str) -> tuple[bytes, str]:
    """Bytes of a bad file and what the error must say about them."""
    whole = tagged._native.to_file("task")
    return {
        "random": (os.urandom(4096), "not gzip-compressed"),
        "empty": (b"", "not gzip-compressed"),
        "truncated": (whole[: len(whole) // 2], "a truncated or corrupt gzip file"),
        "cut trailer": (whole[:-4], "a truncated or corrupt gzip file"),
        "foreign json": (gzip.compress(b'{"name": "x"}'), 'not a dask-pyspy profile file (no "format"'),
        "speedscope inside": (gzip.compress(tagged.to_bytes(compress=False)), "not a dask-pyspy profile file"),
    }[kind]


@pytest.mark.parametrize("kind", ["random", "empty", "truncated", "cut trailer", "foreign json", "speedscope inside"])
def test_damaged_or_foreign_pyspy_files(tagged, tmp_path, kind):
    data, message = damaged(tagged, kind)
    path = tmp_path / "bad.pyspy.gz"
    path.write_bytes(data)
    with pytest.raises(ValueError) as err:
        Profile.load(path)
    assert str(err.value).startswith(f"cannot load {str(path)!r}: {message}"), err.value


@pytest.mark.parametrize(
    "name, data, message",
    [
        ("random.json", b"\x00\xff" * 100, "not a speedscope file"),
        ("cut.json", json.dumps(PYSPY_SPEEDSCOPE).encode()[:50], "not a speedscope file"),
        ("cut.json.gz", gzip.compress(json.dumps(PYSPY_SPEEDSCOPE).encode())[:30], "a truncated or corrupt gzip file"),
        ("foreign.json", b'{"name": "x"}', 'not a speedscope file (no "profiles")'),
        (
            "py-spy.json.gz",
            gzip.compress(json.dumps(PYSPY_SPEEDSCOPE).encode()),
            "a speedscope file not written by dask-pyspy (py-spy@0.3.14)",
        ),
    ],
)
def test_damaged_or_foreign_speedscope_files(tmp_path, name, data, message):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ValueError) as err:
        Profile.load(path)
    assert str(err.value).startswith(f"cannot load {str(path)!r}: {message}"), err.value


def test_what_cannot_be_loaded_says_what_can(tmp_path):
    with pytest.raises(ValueError, match=r"cannot load '.*r\.html': a report cannot be loaded"):
        Profile.load(tmp_path / "r.html")
    with pytest.raises(ValueError, match=r"cannot load '.*p\.pb\.gz': a pprof file cannot be loaded, only \.pyspy\.gz"):
        Profile.load(tmp_path / "p.pb.gz")
    with pytest.raises(
        ValueError, match=r"cannot load '.*random\.bin': the path must end in \.pyspy\.gz, \.json or \.json\.gz$"
    ):
        Profile.load(tmp_path / "random.bin")
    with pytest.raises(FileNotFoundError, match="missing.pyspy.gz"):
        Profile.load(tmp_path / "missing.pyspy.gz")


def held(prof: Profile) -> dict:
    """What a speedscope file holds, from the summary: seconds per prefix with top
    functions, outside tasks and per process."""
    s = prof.summary()
    rounded = lambda x: round(x, 6)  # noqa: E731
    return {
        "prefixes": [
            (p["prefix"], rounded(p["seconds"]), [(f["name"], f["file"], rounded(f["seconds"])) for f in p["top"]])
            for p in s["prefixes"]
        ],
        "untagged": rounded(s["untagged"]["seconds"]),
        "processes": [(p["name"], p["threads"], rounded(p["seconds"])) for p in s["processes"]],
    }


@pytest.mark.parametrize("by", ["task", "prefix", "thread"])
def test_speedscope_files_keep_what_they_hold(tagged, tmp_path, by):
    back = Profile.load(tagged.save(tmp_path / f"{by}.speedscope.json.gz", by=by))
    assert back.by == by and back.metadata == tagged.metadata
    expect = held(tagged)
    if by == "thread":
        # No task tags in a file grouped by thread: every second is outside tasks.
        expect["prefixes"], expect["untagged"] = [], round(tagged.sampled_seconds, 6)
    assert held(back) == expect
    doc = back.speedscope(by="thread")
    assert any(p["name"].startswith(f"{tagged.processes[0]['name']} runner (") for p in doc["profiles"]), "thread names"
    if by == "task":
        assert KEY in [f["name"] for f in back.speedscope(by="task")["shared"]["frames"]], "task keys"
    assert back.summary()["first"] == 0.0, "sample times are not in speedscope files"
