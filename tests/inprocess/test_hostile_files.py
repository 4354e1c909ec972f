"""Small hostile files: each is refused with one clear error, by `Profile.load` and by
the CLI, in a process under a 2 GiB address-space limit, so a blow-up fails the test
instead of taking the machine."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import zlib

import pytest

from dask_pyspy import Profile, Sampler

LIMIT = f"--as={2 << 30}"
LOAD = """
import sys
from dask_pyspy import Profile
try:
    Profile.load(sys.argv[1])
except ValueError as e:
    print(e)
else:
    print("loaded")
"""


def load_limited(path, **env: str) -> str:
    """What `Profile.load(path)` raised, in a fresh process under the memory limit."""
    cmd = ["prlimit", LIMIT, sys.executable, "-c", LOAD, str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def peak_rss_mib(code: str, *args: str) -> float:
    """The peak RSS of a fresh `python -c code args` (VmHWM, which exec resets, where
    ru_maxrss would count the forking process's pages too)."""
    report = "\nprint(next(line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM:')))"
    done = subprocess.run([sys.executable, "-c", code + report, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1]) / 1024


def diff_limited(base, new, tmp_path) -> str:
    """The one line `dask-pyspy diff` says, under the memory limit, with exit code 2."""
    cli = [sys.executable, "-m", "dask_pyspy", "diff", str(base), str(new), "-o", str(tmp_path / "d.html")]
    done = subprocess.run(["prlimit", LIMIT, *cli], capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, (done.returncode, done.stderr)
    return lines[0]


def speedscope(samples: int, seconds: float, threads: int) -> bytes:
    """A speedscope file as dask-pyspy writes them: `threads` threads naming one profile
    of `samples` samples weighted `seconds` each."""
    doc = {
        "shared": {"frames": [{"name": "f", "file": "f.py", "line": 1}]},
        "profiles": [
            {"type": "sampled", "unit": "seconds", "samples": [[0]] * samples, "weights": [seconds] * samples}
        ],
        "x-dask-pyspy": {
            "metadata": {},
            "processes": [{"name": "w", "pid": 1, "host": "h", "token": "t", "stats": {}}],
            "by": "thread",
            "threads": [{"profile": 0, "process": 0, "ident": i, "name": None} for i in range(threads)],
        },
    }
    return gzip.compress(json.dumps(doc, separators=(",", ":")).encode(), 9)


def zeros_gzip(path, gib: int) -> None:
    """`gib` GiB of zeros in one gzip member of a few MB: one deflate block repeated."""
    chunk = bytes(1 << 20)
    deflate = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = deflate.compress(chunk) + deflate.flush(zlib.Z_FULL_FLUSH)
    block = deflate.compress(chunk) + deflate.flush(zlib.Z_FULL_FLUSH)
    crc = 0
    for _ in range(gib << 10):
        crc = zlib.crc32(chunk, crc)
    with open(path, "wb") as f:
        f.write(b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff" + first)
        for _ in range((gib << 10) - 1):
            f.write(block)
        f.write(deflate.flush() + crc.to_bytes(4, "little") + ((gib << 30) & 0xFFFFFFFF).to_bytes(4, "little"))


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict:
    """A valid .pyspy.gz file's document: one process with real sampler stats, a window, tasks."""
    doc = json.loads(gzip.decompress(Profile.merge([], window=[1.0, 2.0])._native.to_file("thread")))
    doc["profile"]["processes"] = [{"name": "w", "pid": 1, "host": "h", "token": "t", "stats": Sampler().stats()}]
    doc["profile"]["metadata"].update(missing={"w2": "no answer"}, tasks={"w": {"f": {"count": 2, "seconds": 0.5}}})
    return doc


def write(path, doc: dict):
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return path


def test_a_valid_file_loads_and_renders(good, tmp_path):
    assert load_limited(write(tmp_path / "good.pyspy.gz", good)) == "loaded"
    assert "w2" in Profile.load(tmp_path / "good.pyspy.gz").to_html(), "a file that loads renders"


STALL = {"thread": "loop", "start": 1.5, "duration": 0.3, "activity": None, "states": {"gil-wait": 0.3}}
STALL.update(stack=["f (x.py:1)"], call=None, gil_holders=[])
STALLS = {"watched": True, "threshold": 0.2, "holders": "known", "records": [[1.5, 0.3]], "explained": [STALL]}
STALLS.update(dropped=0, dropped_s=0.0, lost=0)


def test_a_file_with_stalls_renders_them(good, tmp_path):
    path = write(tmp_path / "stalls.pyspy.gz", set_path(good, "profile.processes.0.stats.stalls", STALLS))
    assert load_limited(path) == "loaded"
    assert "Event-loop stalls" in Profile.load(path).to_html()


@pytest.mark.parametrize(
    "samples, seconds, threads, message",
    [
        # 3 KB: 100,000 samples of 4e6 s each, split into 932 apiece: 93M samples, 3.6 GiB.
        (
            100_000,
            4e6,
            1,
            "its sample weights expand into 93200000 samples, more than config pyspy.max-result (512 MiB) holds",
        ),
        # 10,000 threads all naming one profile of 10,000 samples: 1e8 samples.
        (10_000, 1.0, 10_000, "profile 0 is named by more than one thread"),
    ],
)
def test_weights_never_expand_past_a_bound(good, tmp_path, samples, seconds, threads, message):
    path = tmp_path / "small.speedscope.json.gz"
    path.write_bytes(speedscope(samples, seconds, threads))
    assert path.stat().st_size < 30_000
    assert load_limited(path) == f"cannot load {str(path)!r}: {message}"
    assert message in diff_limited(write(tmp_path / "good.pyspy.gz", good), path, tmp_path)


def test_a_gzip_bomb_stops_at_its_cap(good, tmp_path):
    path = tmp_path / "bomb.pyspy.gz"
    zeros_gzip(path, 5)
    assert path.stat().st_size < 6 << 20
    message = "it decompresses to more than 256 MiB of JSON (half of config pyspy.max-result, 512 MiB)"
    assert load_limited(path) == f"cannot load {str(path)!r}: {message}"
    assert message in diff_limited(write(tmp_path / "good.pyspy.gz", good), path, tmp_path)
    # Refused having counted what it would decompress to, not held it: the cap alone is 256 MiB.
    assert peak_rss_mib(LOAD, str(path)) < peak_rss_mib("import dask_pyspy") + 64


@pytest.mark.parametrize("item, count", [(b'{"a":0}', 2_000_000), (b"[0]", 8_000_000), (b"0", 30_000_000)])
def test_json_that_would_parse_into_gigabytes_is_refused_unparsed(good, tmp_path, item, count):
    """Tens of MB of tiny objects, arrays or numbers in the metadata: a few hundred KB
    gzipped, gigabytes as `serde_json` values and their Python copies."""
    doc = json.dumps(set_path(good, "profile.metadata.x", "X")).encode()
    path = tmp_path / "values.pyspy.gz"
    path.write_bytes(gzip.compress(doc.replace(b'"X"', b"[" + b",".join([item] * count) + b"]"), 1))
    assert path.stat().st_size < 2 << 20
    said = load_limited(path)
    assert said.startswith(f"cannot load {str(path)!r}: parsing its JSON could take ") and said.endswith(
        " MiB, more than twice config pyspy.max-result (512 MiB)"
    ), said


@pytest.mark.parametrize(
    "name, target, what",
    [
        ("zero.pyspy.gz", "/dev/zero", "a character device"),
        ("urandom.json", "/dev/urandom", "a character device"),
        ("fifo.pyspy.gz", None, "a FIFO"),
        ("dir.json.gz", "", "a directory"),
    ],
)
def test_only_regular_files_are_read(good, tmp_path, name, target, what):
    path = tmp_path / name
    if target is None:
        os.mkfifo(path)  # a FIFO nobody writes: opening it for reading would block
    elif target:
        path.symlink_to(target)
    else:
        path.mkdir()
    assert load_limited(path) == f"cannot load {str(path)!r}: not a regular file but {what}"
    assert f"not a regular file but {what}" in diff_limited(path, write(tmp_path / "good.pyspy.gz", good), tmp_path)


def test_a_file_over_max_result_is_not_read(tmp_path):
    path = tmp_path / "big.json"
    path.write_bytes(b" " * (2 << 20))
    message = f"{2 << 20} bytes, more than config pyspy.max-result (1 MiB) allows"
    assert load_limited(path, DASK_PYSPY__MAX_RESULT="1MiB") == f"cannot load {str(path)!r}: {message}"


def set_path(doc: dict, where: str, value) -> dict:
    """A copy of `doc` with the field at dotted path `where` set to `value`."""
    doc = json.loads(json.dumps(doc))
    *parents, last = where.split(".")
    node = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[last] = value
    return doc


@pytest.mark.parametrize(
    "where, value, message",
    [
        ("profile.processes.0.stats", {}, "processes[0].stats.requested_rate is missing"),
        ("profile.processes.0.stats.config", "x", "processes[0].stats.config must be an object, got 'x'"),
        (
            "profile.processes.0.stats.config.cpu_budget",
            None,
            "processes[0].stats.config.cpu_budget must be a number, got None",
        ),
        ("profile.metadata.window", [1], "metadata.window must be [start, stop] in Unix seconds, got [1]"),
        (
            "profile.metadata.window",
            [1e300, 2],
            "metadata.window must be [start, stop] in Unix seconds, got [1e+300, 2]",
        ),
        ("profile.metadata.missing", ["w2"], "metadata.missing must be an object, got ['w2']"),
        ("profile.metadata.missing", {"w2": 1}, "metadata.missing['w2'] must be a string, got 1"),
        ("profile.metadata.tasks", [], "metadata.tasks must be an object, got []"),
        ("profile.metadata.tasks", {"w": {"f": 3}}, "metadata.tasks['w']['f'] must be an object, got 3"),
        (
            "profile.processes.0.stats.window_cpu",
            {"process_cpu_s": 1.0, "native_cpu_s": "x"},
            "processes[0].stats.window_cpu.native_cpu_s must be a number, got 'x'",
        ),
        ("profile.processes.0.stats.cores", -2, "processes[0].stats.cores must be a count, got -2"),
        (
            "profile.processes.0.stats.stalls",
            {**STALLS, "records": [[1.5, "x"]]},
            "processes[0].stats.stalls.records[0] must be [start, duration] in seconds, got [1.5, 'x']",
        ),
        (
            "profile.processes.0.stats.stalls",
            {**STALLS, "explained": [{**STALL, "gil_holders": [{"thread": 3}]}]},
            "processes[0].stats.stalls.explained[0].gil_holders[0].thread must be a string, got 3",
        ),
        (
            "profile.processes.0.stats.stalls",
            {**STALLS, "explained": {}},
            "processes[0].stats.stalls.explained must be a list, got {}",
        ),
    ],
)
def test_metadata_a_report_cannot_read_is_refused_at_load(good, tmp_path, where, value, message):
    path = write(tmp_path / "bad.pyspy.gz", set_path(good, where, value))
    assert load_limited(path) == f"cannot load {str(path)!r}: {message}"
    assert message in diff_limited(write(tmp_path / "good.pyspy.gz", good), path, tmp_path)
