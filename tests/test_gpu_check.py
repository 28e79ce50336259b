"""`make gpu-check` run as a GPU host runs it, on the CPU.

The host (duplex/gpucheck/host.py) is made here: a fresh venv holding only what a stock CUDA
PyTorch image holds (torch and the rest linked from this venv's installed copies, transformers
5.17.0 and the huggingface-hub it requires installed from their wheels, nothing of what the
image lacks), and the wheels `make gpu-wheels` downloads for this CPython, installed by the
check itself with `pip install --no-index --no-deps --target`. A wheel missing from
wheels.txt, or an import of something the host lacks, fails here, not on the first GPU run.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from filelock import FileLock
from packaging.requirements import Requirement

from duplex.gpucheck.host import IMAGE, NOT_IN_IMAGE, TRANSPORT_ONLY, carried, wheel_dir
from duplex.gpucheck.wheels import RECORD, WheelsError, check_size, download
from tests.builds import built_once

pytestmark = pytest.mark.cpu_bound

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
PYTHON = "{}.{}".format(*sys.version_info[:2])
IMAGE_WHEELS = ("transformers==5.17.0", "huggingface-hub==1.33.0")
"""The image's own transformers and the hub it requires (5.17 wants hub < 2): pure Python."""
SMALL = ("--set", "batches=2", "--set", "repeats=1", "--set", "reply_steps=2",
         "--set", "bench_max_sessions=1", "--set", "bench_duration_s=4")
"""The CPU profile cut further: the test proves the check runs, the figures are a GPU's."""


def artifacts_lock() -> FileLock:
    """test-artifacts is the checkout's, shared by every pytest process running in it."""
    ARTIFACTS.mkdir(exist_ok=True)
    return FileLock(ARTIFACTS / ".lock")


def _name(requirement: str) -> str:
    return re.sub(r"[-_.]+", "-", requirement).lower()


def _wheel_requires(wheel: Path) -> tuple[str, list[str]]:
    with zipfile.ZipFile(wheel) as archive:
        meta = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        text = archive.read(meta).decode()
    name = re.search(r"^Name: (.+)$", text, re.M).group(1)
    return _name(name), [line.split(":", 1)[1].strip() for line in text.splitlines()
                         if line.startswith("Requires-Dist:")]


def _image_closure(wheels: dict[str, list[str]]) -> set[str]:
    """IMAGE and what it requires, by the metadata of this venv's copies (and of `wheels` for
    the distributions they provide), less what the image lacks."""
    def requires(name: str) -> list[str]:
        if name in wheels:
            return wheels[name]
        try:
            return metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            return []

    seen: set[str] = set()
    todo = [_name(n) for n in (*IMAGE, "pip")]
    while todo:
        name = todo.pop()
        if name in seen or name in map(_name, NOT_IN_IMAGE):
            continue
        seen.add(name)
        for text in requires(name):
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_name(req.name))
    return seen


@pytest.fixture(scope="session")
def host_python(tmp_path_factory) -> Path:
    """The host's python3; its venv (a minute of CPU) built once for the run's workers."""
    return built_once(tmp_path_factory, "host", build_host)


def build_host(folder: Path) -> Path:
    image_wheels = ARTIFACTS / "host-image"
    with artifacts_lock():
        if len(list(image_wheels.glob("*.whl"))) != len(IMAGE_WHEELS):
            shutil.rmtree(image_wheels, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                            "--only-binary=:all:", "--dest", str(image_wheels), *IMAGE_WHEELS],
                           check=True)
    provided = dict(_wheel_requires(w) for w in image_wheels.glob("*.whl"))
    venv = folder / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next(venv.glob("lib/python*/site-packages"))
    for name in sorted(_image_closure(provided) - set(provided)):
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # in the image, not needed here (xxhash)
        tops = {f.parts[0] for f in dist.files or ()} - {"..", "__pycache__"}
        for top in tops:
            if not (site / top).exists():
                (site / top).symlink_to(Path(dist.locate_file(top)))
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                    "--no-compile", *map(str, image_wheels.glob("*.whl"))], check=True)
    return python


@pytest.fixture(scope="module")
def wheels() -> Path:
    """What `make gpu-wheels GPU_PYTHON=<this CPython>` downloads (once; reused after)."""
    dest = ARTIFACTS / "gpu-wheels"
    with artifacts_lock():
        download(PYTHON, dest, log=lambda line: None)
    return dest


def run_check(python: Path, wheels: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    """`python3 -m duplex.gpucheck` from the checkout's root, as on the host: no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(python), "-m", "duplex.gpucheck", "--device", "cpu", "--wheels", str(wheels),
         "--out", str(out), "--site", str(out.parent / "site"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )


def phase(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


@pytest.mark.slow
def test_the_check_runs_on_a_host_holding_only_the_image_and_the_wheels(
        host_python, wheels, tmp_path):
    out = tmp_path / "out"
    done = run_check(host_python, wheels, out, *SMALL)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["statuses"] == dict.fromkeys(
        ("install", "environment", "correctness", "stages", "bench"), "ok")
    assert "| stages | B=2 thinker_decode wall ms |" in (out / "summary.md").read_text()

    env = phase(out, "environment")["figures"]
    assert env["transformers"] == "5.17.0"
    # 5.17 names the cache argument past_key_values: every forward below ran with its KV.
    assert env["cache keyword (thinker, talker, code predictor)"] == ", ".join(
        ["past_key_values"] * 3)
    for requirement in carried():
        dist, version = requirement.split("==")
        assert env[f"{dist} (carried)"] == version
    assert all(env[f"{dist} (transport only)"] == "absent" for dist in TRANSPORT_ONLY)

    fig = phase(out, "correctness")["figures"]
    assert fig["thinker hidden bf16 vs fp32: worst cosine"] > 0.99
    assert fig["code2wav bf16 vs fp32 SNR dB (6 frames)"] > 30
    # fp32 on the CPU: batching and the eager code predictor change nothing.
    assert fig["greedy tokens batched = alone (B=4, share of 2 steps)"] == 1.0
    assert fig["greedy frames batched = alone (B=4, share of 2 steps)"] == 1.0
    assert fig["sampled frame graphed = eager (B=8, share of codes)"] == "needs CUDA"
    # Nothing is captured on the CPU: the graphs' fixed buffers ran, and changed nothing.
    ran = fig["decode steps run as static (thinker, talker, code predictor)"]
    assert all(int(n) > 0 for n in ran.split(", ")), ran
    assert fig["greedy tokens graphed = eager (B=4, share of 2 steps)"] == 1.0
    assert fig["greedy frames graphed = eager (B=4, share of 2 steps)"] == 1.0

    stages = phase(out, "stages")["figures"]
    for batch in (2,):
        for stage in ("encode_audio", "thinker_prefill", "thinker_decode", "talker_step",
                      "codec_decode"):
            assert stages[f"B={batch} {stage} wall ms"] > 0
        # Each step reads its sampled tokens on the host at least once.
        assert stages[f"B={batch} thinker_decode syncs (dispatch count)"] >= 1
        # The timed decode steps (one, and one counted) ran from the buckets the start made.
        for stage in ("thinker", "talker", "code_predictor"):
            assert stages[f"B={batch} {stage} steps ran as"] == "static 2"
    for stage in ("thinker", "talker", "code_predictor"):
        assert stages[f"{stage} buckets"] == "1, 2"
        assert stages[f"{stage} step eager ms (B=2)"] > 0

    bench = phase(out, "bench")["figures"]
    assert "batched N=1" in bench
    assert isinstance(bench["max realtime sessions"], int)
    # --batched-only: one model build, no per-session search.
    report = json.loads((out / "bench-report.json").read_text())
    assert list(report["modes"]) == ["batched"] and report["ratio"] is None


@pytest.mark.slow
def test_an_import_the_host_lacks_fails_the_check(host_python, wheels, tmp_path):
    # wheels.txt without soxr: the bench imports it with every session's resampler.
    short = wheel_dir(tmp_path / "wheels", PYTHON)
    short.mkdir(parents=True)
    record = json.loads((wheel_dir(wheels, PYTHON) / RECORD).read_text())
    record["wheels"] = [w for w in record["wheels"] if not w.startswith("soxr-")]
    for name in record["wheels"]:
        shutil.copy(wheel_dir(wheels, PYTHON) / name, short)
    (short / RECORD).write_text(json.dumps(record))
    out = tmp_path / "out"
    done = run_check(host_python, tmp_path / "wheels", out, "--phases", "environment")
    assert done.returncode == 1
    env = phase(out, "environment")
    assert env["status"] == "failed"
    assert "soxr" in env["errors"]["import duplex.cli"]
    assert env["figures"]["bench imports"] == "failed"


@pytest.mark.slow
def test_a_phase_past_its_limit_is_stopped_and_the_next_still_runs(wheels, tmp_path):
    out = tmp_path / "out"
    done = run_check(Path(sys.executable), wheels, out, "--phases", "stages,environment",
                     "--limit", "stages=3")
    assert done.returncode == 1
    stages, env = phase(out, "stages"), phase(out, "environment")
    assert stages["status"] == "timeout" and stages["limit_s"] == 3
    assert 3 <= stages["seconds"] < 3 + 10
    assert env["status"] == "ok"
    # This venv has the transports' packages: the bench's imports still bring none of them in.
    closure = env["figures"]["import closure (distributions)"].split(", ")
    assert {"torch", "transformers", "pydantic", "soxr", "starlette"} <= set(closure)
    assert not set(closure) & set(TRANSPORT_ONLY)
    assert json.loads((out / "summary.json").read_text())["statuses"] == {
        "install": "ok", "stages": "timeout", "environment": "ok"}


def test_wheels_over_the_limit_are_refused_naming_the_largest(tmp_path):
    small, large = tmp_path / "a-1.0-py3-none-any.whl", tmp_path / "b-1.0-py3-none-any.whl"
    small.write_bytes(b"x" * 1024)
    with open(large, "wb") as f:
        f.truncate(64 * 2**20)  # sparse: 64 MiB that take no disk
    assert check_size([large]) == 64 * 2**20
    with pytest.raises(WheelsError, match=r"64\.0 MiB, over the 64 MiB.*b-1\.0"):
        check_size([small, large])
